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
