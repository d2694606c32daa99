"""The proxy's settings are built from ``trajstore proxy``'s flags in one place (``ProxyConfig``)
and every engine starts through one path (``serve``): the same checks, in the same order."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("fastapi")

from trajstore.ingest.proxy import add_cli_arguments, main  # noqa: E402
from trajstore.ingest.proxy._serve import ENGINES, ProxyConfig, serve  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default=None)
    add_cli_arguments(parser)
    return parser.parse_args(["--upstream", "http://127.0.0.1:9/v1", *argv])


def test_the_flags_build_one_config_for_either_engine():
    assert ENGINES == ("vllm", "sglang")
    vllm = ProxyConfig.from_args(_args("--version-map", '{"ckpt-a": 3}', "--no-route-skip", "--token", "t"))
    assert (vllm.engine, vllm.version_map, vllm.skip_recorded_routes, vllm.token) == ("vllm", {"ckpt-a": 3}, False, "t")
    assert vllm.route_layout is None and vllm.port == 8701
    sglang = ProxyConfig.from_args(_args("--engine", "sglang", "--route-layout", "48x8", "--pass-through-unrecorded"))
    assert (sglang.engine, sglang.route_layout, sglang.pass_through_unrecorded) == ("sglang", (48, 8), True)


@pytest.mark.parametrize("argv,message", [
    (("--route-layout", "48x8"), "--route-layout is for --engine sglang"),
    (("--engine", "sglang", "--route-layout", "48"), "--route-layout: route layout must be LAYERSxTOPK"),
    (("--version-map", "[1]"), "--version-map must be a JSON object of integers"),
    (("--engine", "sglang", "--version-map", "{"), "--version-map is not JSON"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        ProxyConfig.from_args(_args(*argv))


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="--engine must be one of vllm, sglang"):
        ProxyConfig(upstream="http://127.0.0.1:9", engine="tgi")


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_starts_through_the_same_checks(engine, monkeypatch):
    monkeypatch.delenv("TRAJSTORE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no token"):
        serve(ProxyConfig(upstream="http://127.0.0.1:9", engine=engine))
    # the upstream URL is refused before the store is opened, for SGLang as for vLLM
    with pytest.raises(ValueError, match=r"--upstream must be an http\(s\) URL"):
        serve(ProxyConfig(upstream="ftp://127.0.0.1:9", engine=engine, token="t", store_url="nosuch://x"))


def test_workers_proxy_main_takes_the_engine_flag(monkeypatch):
    monkeypatch.delenv("TRAJSTORE_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="trajstore proxy: --route-layout is for --engine sglang"):
        main(["--upstream", "http://127.0.0.1:9", "--route-layout", "4x2"])
    with pytest.raises(SystemExit, match="trajstore proxy: no token"):
        main(["--upstream", "http://127.0.0.1:9", "--engine", "sglang", "--route-layout", "4x2"])


def test_the_coalescing_flags_reach_the_recorder_s_committer(tmp_path):
    """``--linger-ms`` and ``--max-batch-mb`` (docs/ingest.md "Coalescing") land in the config, and
    the app's group committer runs with them."""
    import trajstore
    from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
    from trajstore.ingest.proxy._serve import _APPS

    assert (ProxyConfig(upstream="http://x").linger_s, ProxyConfig(upstream="http://x").max_batch_bytes) == (
        DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES)
    config = ProxyConfig.from_args(_args("--linger-ms", "150", "--max-batch-mb", "2"))
    assert (config.linger_s, config.max_batch_bytes) == (0.15, 2 << 20)
    with trajstore.connect(f"sqlite:///{tmp_path}/s.db", payload=str(tmp_path / "p")) as store:
        for engine in ENGINES:
            app = _APPS[engine](store, ProxyConfig(upstream="http://127.0.0.1:9", engine=engine, linger_s=0.15,
                                                   max_batch_bytes=2 << 20), None, None)
            committer = app.state.forwarder.recorder.committer
            assert (committer.linger_s, committer.max_group_bytes) == (0.15, 2 << 20)
            committer.close()
    with pytest.raises(ValueError, match="--linger-ms must be 0 or more"):
        ProxyConfig(upstream="http://x", linger_s=-1.0)
