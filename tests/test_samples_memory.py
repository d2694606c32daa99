"""store.samples() decodes a bounded run of samples at a time, not its whole
page: Arrow memory while iterating stays near one run, whatever page_rows is."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import trajstore
from trajstore.sample import _codec as _samples
from trajstore.sample._codec import token_chunks


def _events(i: int, rng) -> list[dict]:
    tid = f"t{i:03d}"
    return [
        {"type": "trajectory_started", "trajectory_id": tid, "num_experts": 128},
        {"type": "generation", "trajectory_id": tid, "seq": 0,
         "prompt_ids": rng.integers(0, 32000, 1000, dtype=np.int32),
         "output_ids": rng.integers(0, 32000, 1000, dtype=np.int32),
         "logprobs": -rng.random(1000, dtype=np.float32), "model_version": 1,
         "routed_experts": rng.integers(0, 128, (1999, 16, 8), dtype=np.uint8)},
        {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"},
    ]


def test_samples_iteration_holds_one_chunk_not_the_page(tmp_path, monkeypatch, chunk_tokens=4000):
    rng = np.random.default_rng(0)
    n = 32
    with trajstore.connect(f"sqlite:///{tmp_path}/m.db") as store:
        for i in range(n):
            store.append(_events(i, rng))
        store.materialize()
        monkeypatch.setattr(_samples, "READ_CHUNK_TOKENS", chunk_tokens)  # two 2,000-token samples per run
        base = pa.total_allocated_bytes()
        peak, count, ids = 0, 0, []
        for s in store.samples(page_rows=256):  # one page holds all 32 samples
            peak = max(peak, pa.total_allocated_bytes() - base)
            count += 1
            ids.append(s.trajectory_id)
            route_bytes = s.routed_experts.nbytes
            del s
        assert count == n and ids == sorted(ids)
        # the whole page decoded at once holds >= 32 x route_bytes (measured: ~38x);
        # one run of two samples and its Parquet read buffers about 10x
        assert peak < n // 2 * route_bytes, (peak, route_bytes)


def test_token_chunks_cover_rows_in_order_within_budget():
    rows = [{"prompt_len": p, "response_len": r} for p, r in [(10, 5), (3, 2), (40, 1), (1, 1), (7, 7), (2, 2)]]
    chunks = list(token_chunks(rows, 20))
    assert [r for c in chunks for r in c] == rows
    for c in chunks:
        assert len(c) == 1 or sum(r["prompt_len"] + r["response_len"] for r in c) <= 20
    assert list(token_chunks([], 20)) == []
