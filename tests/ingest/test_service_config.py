"""``ServeConfig``: the ingest service's settings, built from the flags, checked, and handed to workers."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from trajstore.ingest.service import ServeConfig, _serve_config, add_cli_arguments, main, make_app


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default=None)
    add_cli_arguments(parser)
    return parser.parse_args(argv)


def test_the_flags_default_to_the_configs_defaults():
    assert ServeConfig.from_args(_parse([])) == ServeConfig()


def test_every_flag_lands_in_its_field():
    args = _parse(["--store", "sqlite:///x.db", "--host", "0.0.0.0", "--port", "9000", "--token", "t",
                   "--insecure-no-auth", "--max-body-mb", "2", "--max-in-flight-mb", "3", "--no-group-commit",
                   "--group-wait-ms", "7", "--committers", "2", "--workers", "4", "--log-level", "info"])
    assert ServeConfig.from_args(args) == ServeConfig(
        store_url="sqlite:///x.db", host="0.0.0.0", port=9000, token="t", insecure_no_auth=True,
        max_body_bytes=2 << 20, max_bytes_in_flight=3 << 20, group_commit=False, group_wait_s=0.007, committers=2,
        workers=4, log_level="info")


def test_the_coalescing_flags_land_in_their_fields_and_reach_the_committer(store):
    config = ServeConfig.from_args(_parse(["--linger-ms", "150", "--max-batch-mb", "2"]))
    assert (config.linger_s, config.max_batch_bytes) == (0.15, 2 << 20)
    assert ServeConfig.from_env(config.to_env()) == config
    app = make_app(store, config, token=None)
    committer = app.state.committer
    assert (committer.linger_s, committer.max_group_bytes) == (0.15, 2 << 20)
    committer.close()


def test_workers_receive_the_same_config_through_the_environment_text():
    config = ServeConfig(store_url="sqlite:///x.db", payload="/p", token="t", max_body_bytes=5, committers=3,
                         group_wait_s=0.0, workers=2)
    assert ServeConfig.from_env(config.to_env()) == config


@pytest.mark.parametrize("field, value", [("max_body_bytes", 0), ("max_bytes_in_flight", -1), ("committers", 0),
                                          ("workers", 0), ("group_wait_s", -0.001), ("port", 70000),
                                          ("linger_s", -0.001), ("max_batch_bytes", 0)])
def test_a_nonsense_setting_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**{field: value})


def test_serve_refuses_a_nonsense_flag_in_one_line():
    with pytest.raises(SystemExit, match=r"^trajstore serve: committers must be at least 1, got 0$"):
        main(["--committers", "0", "--insecure-no-auth"])


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServeConfig().port = 1  # type: ignore[misc]


def test_make_app_still_needs_a_token_or_a_config():
    with pytest.raises(TypeError, match="token="):
        make_app(object())


def test_serve_takes_a_config_or_the_documented_positional_form():
    assert _serve_config("sqlite:///x.db", ("0.0.0.0", 9000, "t"), {"workers": 2}) == ServeConfig(
        store_url="sqlite:///x.db", host="0.0.0.0", port=9000, token="t", workers=2)
    base = ServeConfig(store_url="sqlite:///x.db", token="t")
    assert _serve_config(base, (), {"port": 1}) == dataclasses.replace(base, port=1)
    with pytest.raises(TypeError, match="positional"):
        _serve_config(None, ("h", 1, "t", "extra"), {})
