"""The load generator (bench/bench_load.py) at a tiny load: its report adds up.

Runs the bench as users do (a subprocess: PostgreSQL or SQLite, moto_server,
``trajstore serve``, the materializer, two client processes) with 2 clients x
5 calls/s x 5 s and checks its JSON report against the index it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_bench_load_report_is_consistent(tmp_path: Path, backend: str) -> None:
    if not (Path(sys.executable).parent / "moto_server").exists():
        pytest.fail("moto_server not found: install the dev extra (moto[server])")
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_load.py"), "--backend", backend,
                           "--clients", "2", "--rate", "5", "--seconds", "5", "--turns", "3", "--concurrency", "4",
                           "--sample-s", "2",
                           "--drain-s", "20", "--quiet", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["calls_offered"] == 50
    assert r["calls_failed"] == 0, r["errors"]
    assert r["calls_acknowledged"] + r["calls_missed"] == 50 and r["calls_acknowledged"] >= 10
    assert r["drained"]  # the materializer folded everything finished before the report
    # every acknowledged call is a generation event in the index (plus the warm-up call)
    assert r["index"]["generation_events"] == r["calls_acknowledged"] + r["warmup_calls"]
    # the service acknowledged each call, and each trajectory the run's end cut short (its finish alone)
    assert r["service_metrics"]["requests_200"] == r["calls_acknowledged"] + r["trajectories_cut_short"]
    assert r["service_metrics"]["duplicate_events"] == 0
    assert r["batches"] >= 1 and r["service_metrics"]["committed_requests"] == r["service_metrics"]["requests_200"]
    assert r["objects_made"].get("events", 0) + r["objects_made"].get("events+multipart", 0) >= 1
    assert r["objects_made_total"] >= 1
    assert r["s3_requests"].get("PutObject", 0) >= 1
    assert r["tokens_acknowledged"] > 0
    assert any(s["bytes"] > 0 for s in r["bytes_at_rest"])
    assert r["bytes_at_rest"][-1]["tokens"] == r["tokens_acknowledged"]
    assert r["server_cpu_s"]["service"] > 0 and r["client_cpu_s"] > 0
    proj = r["projection"]
    assert proj["calls_per_s"] == 3300 and "formula" in proj
    # what bench/summary.py writes into docs/benchmarks.md: the command, its load, the rows of this run
    assert r["command"].startswith("bench/bench_load.py --backend") and r["loadavg"] == r["loadavg_start"]
    assert [row["what"].split(":")[0] for row in r["summary"]] == ["load generator", "the fold's S3 reads, same load generator"]
    assert f"achieved {r['achieved_calls_per_s']:.1f} calls/s" in r["summary"][0]["figure"]
    assert f"{proj['trajstore_cores']:.1f} trajstore cores" in r["summary"][0]["figure"]
    assert proj["service_cores"] == pytest.approx(r["server_cpu_s"]["service"] / r["calls_acknowledged"] * 3300)
    if backend == "postgres":
        assert r["pg_service"]["round_trips"] > 0 and r["pg_service"]["commits"] >= r["batches"]
        assert r["round_trips_per_batch"] == pytest.approx(r["pg_service"]["round_trips"] / r["batches"])
        assert r["round_trips_per_batch"] >= 1
    else:
        assert "round_trips_per_batch" not in r
