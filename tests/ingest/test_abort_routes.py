"""Route rows of an aborted call (docs/ingest.md): vLLM 0.33.0 and SGLang 0.5.23 may answer an
aborted request with rows for part of its sequence. The adapters say so explicitly (the rows
left out, ``metadata["route_rows_dropped"]``); a call that did not abort with too few rows
goes to the store as sent and is refused (``too_few_route_rows``), never guessed at."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import started
from trajstore.errors import ValidationError
from trajstore.ingest.sglang import generation_from_generate
from trajstore.ingest.vllm import generation_from_output

PROMPT, OUT = [1, 2, 3, 4], [5, 6, 7]


def _rows(n: int) -> np.ndarray:
    return np.arange(n * 2 * 2, dtype=np.int32).reshape(n, 2, 2) % 8


def _vllm(rows: int, finish: str) -> dict:
    out = SimpleNamespace(token_ids=OUT, logprobs=None, routed_experts=_rows(rows), finish_reason=finish,
                          stop_reason=None)
    return generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=1)


def _sglang(rows: int, finish: str) -> dict:
    meta = {"finish_reason": {"type": finish}, "routed_experts": base64.b64encode(_rows(rows).tobytes()).decode()}
    return generation_from_generate({"output_ids": OUT, "meta_info": meta}, {"input_ids": PROMPT}, trajectory_id="t",
                                    seq=0, model_version=1, route_layout="2x2")


@pytest.mark.parametrize("adapter", [_vllm, _sglang])
def test_an_aborted_call_with_partial_rows_is_recorded_without_them_and_says_so(store, adapter):
    full = len(PROMPT) + len(OUT) - 1
    ev = adapter(2, "abort")  # rows for the first two positions only (prefill cut short)
    assert "routed_experts" not in ev and ev["metadata"]["route_rows_dropped"] == 2
    assert ev["finish_reason"] == "abort"
    store.append([started("t"), ev])
    ok = adapter(full, "abort")  # an abort whose rows cover its sequence keeps them
    assert "routed_experts" in ok and "route_rows_dropped" not in ok.get("metadata", {})
    store.append([started("t2"), dict(ok, trajectory_id="t2")])


def test_a_call_that_did_not_abort_with_too_few_rows_is_refused(store):
    ev = _vllm(3, "stop")
    assert len(ev["routed_experts"]) == 3  # passed on as sent
    with pytest.raises(ValidationError) as info:
        store.append([started("t"), ev])
    assert info.value.rule == "too_few_route_rows" and info.value.index == 1
    with pytest.raises(ValidationError) as info:  # SGLang's exact byte count says the same, before the store
        _sglang(3, "stop")
    assert info.value.rule == "route_layout"
