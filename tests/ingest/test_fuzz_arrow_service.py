"""Structure-aware mutations of valid Arrow IPC bodies (``tests/fuzz_arrow.py``)
against a real ``trajstore serve`` process on loopback, on both backends.

Every request is stored whole (200) or refused with a 4xx and the JSON error
body; never a 5xx, never a dead service. No half records: for each 200 the
store holds every event the body decodes to, for each refusal none of its
trajectory. The service's resident memory stays bounded throughout.

The default run sends 600 bodies per backend; ``TRAJSTORE_FUZZ_ARROW_CASES``
sets the count (10,000 is the full run, docs/ingest.md "Hostile bodies")."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from fuzz_arrow import make_cases  # noqa: E402
from sqlalchemy import func, select  # noqa: E402
from trajstore.errors import ValidationError  # noqa: E402
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, ArrowBodyError, decode_arrow_events  # noqa: E402
from trajstore.schema import events as events_table  # noqa: E402
from helpers import serve_process  # noqa: E402

TOKEN = "fuzz-arrow-token"
HEADERS = {"Content-Type": ARROW_CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"}
CASES = int(os.environ.get("TRAJSTORE_FUZZ_ARROW_CASES", "600"))
CLIENTS = 8
# Resident memory the service may gain over the run after its first requests (a leak of even
# 1 KiB per body would pass 10 MiB in 10,000 bodies; the bodies are a few KiB each).
RSS_SLACK_MIB = 64


def _rss_kib(pid: int, key: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


# The store_url these fixtures connect first thing (a store's first connect migrates it): a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = ("serve",)


@pytest.fixture
def serve(store_url, tmp_path):
    with serve_process("--store", store_url, "--payload", str(tmp_path / "payload"), "serve", "--max-body-mb", "8",
                       env={**os.environ, "TRAJSTORE_TOKEN": TOKEN}, stop_timeout_s=60) as (proc, url):
        yield proc, url


def _key(event: dict) -> str:
    return repr(sorted((k, (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else repr(v))
                       for k, v in event.items()))


@pytest.mark.timeout(3600)
def test_mutated_arrow_bodies_are_stored_whole_or_refused(serve, store_url, tmp_path):
    import trajstore

    proc, url = serve
    cases = make_cases(CASES, seed=11)
    statuses: list[int | None] = [None] * len(cases)
    appended: list[int] = [0] * len(cases)
    rss = {"baseline": None, "max": 0}

    def post(shard: int) -> None:
        with httpx.Client(timeout=120) as client:
            for k in range(shard, len(cases), CLIENTS):
                body, name, _ = cases[k]
                try:
                    resp = client.post(f"{url}/v1/events", content=body, headers=HEADERS)
                except httpx.HTTPError as e:
                    raise AssertionError(f"case {k} ({name}): {type(e).__name__} {e}; serve rc {proc.poll()}")
                statuses[k] = resp.status_code
                if resp.status_code == 200:
                    appended[k] = resp.json()["num_appended"]
                else:
                    assert 400 <= resp.status_code < 500, f"case {k} ({name}): {resp.status_code} {resp.text[:300]}"
                    err = resp.json()["error"]
                    assert set(err) == {"index", "trajectory_id", "rule", "message"}, (name, err)
                    assert "\n" not in err["message"], (name, err)
                if shard == 0 and k % (CLIENTS * 25) == 0:
                    now = _rss_kib(proc.pid)
                    if rss["baseline"] is None and k >= min(400, len(cases) // 4):
                        rss["baseline"] = now
                    rss["max"] = max(rss["max"], now)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(post, range(CLIENTS)))
    assert proc.poll() is None, f"serve exited with {proc.returncode}"
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{url}/healthz").status_code == 200
        metrics = client.get(f"{url}/metrics").text
    assert 'status="5' not in metrics
    rss["max"] = max(rss["max"], _rss_kib(proc.pid))

    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    try:
        with store.log.read_engine.connect() as conn:
            stored = Counter(dict(conn.execute(
                select(events_table.c.trajectory_id, func.count()).group_by(events_table.c.trajectory_id)).all()))
        half = []
        accepted_tids: set = set()
        for k, (body, name, tids) in enumerate(cases):
            if statuses[k] == 200:
                # an event sent twice in one body (a batch repeated) is stored once
                unique = {_key(ev): ev for ev in decode_arrow_events(body)}
                sent = Counter(ev["trajectory_id"] for ev in unique.values())
                accepted_tids |= set(sent)
                half += [(k, name, tid, n, stored[tid]) for tid, n in sent.items() if stored[tid] != n]
        for k, (body, name, tids) in enumerate(cases):
            if statuses[k] != 200:
                half += [(k, name, tid, 0, stored[tid]) for tid in tids - accepted_tids if stored[tid]]
        assert not half, f"{len(half)} half records (case, mutation, trajectory, sent, stored): {half[:5]}"
        assert sum(stored.values()) == sum(appended)
        assert store.materialize().num_samples_after > 0
    finally:
        store.close()
    by_status = Counter(statuses)
    assert by_status[200] > len(cases) // 10 and sum(n for s, n in by_status.items() if s != 200) > len(cases) // 2
    grown = (rss["max"] - rss["baseline"]) / 1024 if rss["baseline"] else 0.0
    peak = _rss_kib(proc.pid, "VmHWM") / 1024
    print(f"\n{len(cases)} Arrow bodies: {dict(sorted(by_status.items()))}; service RSS grew {grown:.1f} MiB "
          f"after warm-up, peak {peak:.0f} MiB")
    assert grown < RSS_SLACK_MIB, f"service RSS grew {grown:.0f} MiB over {len(cases)} small bodies"


def test_every_mutation_kind_is_exercised_and_decodes_or_refuses_cleanly():
    """In process, no server: each mutation kind appears, and decoding either
    succeeds or raises the decoder's own errors (what the service maps to 4xx)."""
    seen: Counter = Counter()
    for body, name, _ in make_cases(2000, seed=3):
        seen[name] += 1
        try:
            decode_arrow_events(body)
        except (ArrowBodyError, ValidationError):
            pass
    expected = {"node_length", "node_null_count", "batch_length", "buffer_offset", "buffer_length", "offsets",
                "offsets_swapped", "validity", "data_bytes_event", "data_bytes_array", "schema_duplicate",
                "schema_rename", "schema_retype", "schema_dictionary", "compressed_zstd", "compressed_lz4",
                "marker", "stream_bytes", "stream_truncated", "stream_batch_twice", "split", "none"}
    assert expected <= set(seen), expected - set(seen)
