"""The command line: ingest is atomic with one-line errors, materialize prints
the metrics, export is a Parquet dataset that pyarrow, DuckDB and Polars read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

import trajstore
from trajstore.cli import main
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.events._wire import encode_b64, encode_npy_b64
from tests.helpers import OLD_NAMES_CFG, snapshot

CFG = RolloutConfig(turns=3, prompt_tokens=12, output_tokens=6, observation_tokens=3, layers=3, topk=2,
                    num_experts=16, mismatch_prob=0.3, abort_prob=0.3)


def _to_json(ev: dict, i: int) -> dict:
    out = {}
    for k, v in ev.items():
        if isinstance(v, np.ndarray):
            v = (encode_b64(v) if i % 2 else encode_npy_b64(v)) if v.ndim == 3 else v.tolist()
        out[k] = v
    return out


def write_jsonl(path, n=10) -> list[dict]:
    events = [_to_json(e, i) for i in range(n) for e in trajectory_events(CFG, i)]
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return events


@pytest.fixture
def url(store_url, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJSTORE_PAYLOAD_DIR", str(tmp_path / "pgpayload"))
    return store_url


def test_ingest_materialize_export(url, tmp_path, capsys):
    events = write_jsonl(tmp_path / "ev.jsonl")
    assert main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")]) == 0
    assert f"appended {len(events)} events" in capsys.readouterr().out
    assert main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")]) == 0  # retry: no-op
    assert f"appended 0 events ({len(events)} already stored)" in capsys.readouterr().out
    assert main(["--store", url, "materialize"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["num_trajectories"] == 10 and metrics["num_samples_after"] >= 10
    assert metrics["merge_ratio"] == pytest.approx(metrics["num_samples_after"] / metrics["num_steps_before"])
    out = tmp_path / "export"
    assert main(["--store", url, "export", str(out)]) == 0
    table = pq.read_table(out)
    assert table.num_rows == metrics["num_samples_after"]
    assert set(trajstore.Sample.FIELDS) <= set(table.column_names)
    store = trajstore.connect(url)
    for row, s in enumerate(store.samples()):
        assert table.column("trajectory_id")[row].as_py() == s.trajectory_id
        np.testing.assert_array_equal(table.column("response_ids")[row].as_py(), s.response_ids)
        # plain nested lists of numbers, [P+R][layers][topk] (SPEC "Exported columns")
        np.testing.assert_array_equal(np.array(table.column("routed_experts")[row].as_py()), s.routed_experts)
        np.testing.assert_array_equal(table.column("logprobs_mask")[row].as_py(), s.logprobs_mask)
        assert table.column("finish_reason")[row].as_py() == s.finish_reason
        np.testing.assert_array_equal(table.column("routed_experts_mask")[row].as_py(), s.routed_experts_mask)


def test_export_reads_in_duckdb_and_polars(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    write_jsonl(tmp_path / "ev.jsonl", n=6)
    main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")])
    main(["--store", url, "materialize"])
    main(["--store", url, "export", str(tmp_path / "x")])
    capsys.readouterr()
    duckdb = pytest.importorskip("duckdb")
    polars = pytest.importorskip("polars")
    ((n, tokens),) = duckdb.sql(
        f"SELECT count(*), sum(len(prompt_ids) + len(response_ids)) FROM read_parquet('{tmp_path}/x/*.parquet')"
    ).fetchall()
    samples = list(trajstore.connect(url).samples())
    assert n == len(samples) and tokens == sum(s.num_tokens for s in samples)
    df = polars.read_parquet(f"{tmp_path}/x/*.parquet")
    assert df.height == len(samples)
    assert df["loss_mask"].list.sum().to_list() == [int(s.loss_mask.sum()) for s in samples]


def test_bad_event_exits_nonzero_and_stores_nothing(url, tmp_path, capsys):
    events = write_jsonl(tmp_path / "ev.jsonl", n=3)
    bad = dict(events[2], logprobs=[0.0])  # wrong length
    with open(tmp_path / "bad.jsonl", "w") as f:
        # a blank line first: the error names the file line (4), not the event index (2)
        f.writelines(["\n"] + [json.dumps(e) + "\n" for e in events[:2] + [bad] + events[3:]])
    store = trajstore.connect(url)
    before = snapshot(store)
    assert main(["--store", url, "ingest", str(tmp_path / "bad.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "line 4 of" in err and "logprobs" in err and "length_mismatch" in err
    assert snapshot(store) == before


def test_bad_json_line_named(tmp_path, capsys):
    p = tmp_path / "x.jsonl"
    p.write_text('{"type": "trajectory_started", "trajectory_id": "a"}\n{not json\n')
    assert main(["--store", f"sqlite:///{tmp_path}/s.db", "ingest", str(p)]) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "not JSON" in err
    assert trajstore.connect(f"sqlite:///{tmp_path}/s.db").info()["head_position"] == 0


def test_ingest_from_stdin_and_info(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    data = "".join(json.dumps(e) + "\n" for e in write_jsonl(tmp_path / "ev.jsonl", n=2))
    run = lambda *a, **kw: subprocess.run([sys.executable, "-m", "trajstore.cli", "--store", url, *a],  # noqa: E731
                                          capture_output=True, text=True, **kw)
    assert run("ingest", "-", input=data).returncode == 0
    info = json.loads(run("info").stdout)
    assert info["trajectories_by_status"] and sum(info["events_by_type"].values()) == data.count("\n")
    bad = run("--store", "mysql://x/y", "info")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "unsupported database" in bad.stderr
    assert "Traceback" not in bad.stderr
    debug = run("--debug", "--store", "mysql://x/y", "info")
    assert "Traceback" in debug.stderr


def test_gc_removes_orphans_only(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    write_jsonl(tmp_path / "ev.jsonl", n=2)
    main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")])
    store = trajstore.connect(url)
    orphan = store.payload.path("events-orphan.arrow")
    open(orphan, "wb").write(b"left by a crashed append")
    assert main(["--store", url, "gc", "--grace-s", "0"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert not os.path.exists(orphan)
    assert len(store.load_generations(trajectory_events(CFG, 0)[0]["trajectory_id"])) > 0


def test_demo_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trajstore.cli", "demo", "--trajectories", "24", "--workers", "2",
                           "--dir", str(tmp_path / "demo"), "--no-train"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "merge ratio" in proc.stdout and "samples (after)" in proc.stdout
    store = trajstore.connect(f"sqlite:///{tmp_path}/demo/trajstore.db")
    assert store.info()["trajectories_by_status"].keys() <= {"completed", "failed"}
    assert sum(store.info()["trajectories_by_status"].values()) == 24
    assert store.info()["samples"] >= 24


def test_public_api():
    assert sorted(trajstore.__all__) == sorted([
        "AppendResult", "ConflictError", "CorruptStoreError", "ReaderConfig", "ResumeStateError", "Sample", "SampleReader", "Store",
        "StoreUnavailable", "TrajstoreError", "ValidationError", "Writer", "connect"])
    for name in trajstore.__all__:
        assert getattr(trajstore, name) is not None


def test_core_does_not_import_edges():
    code = ("import sys, trajstore; s = trajstore.connect('sqlite:///:memory:'); "
            "bad = [m for m in ('torch', 'megatron', 'fastapi', 'ray', 'vllm') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    assert out.stdout.strip() == "[]", out.stderr


# ----------------------------------------------------------------------------
# The old flag `materialize --batch-size` still works, with a DeprecationWarning.

def test_cli_materialize_batch_size_still_works(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    with trajstore.connect(url) as store:
        for i in range(3):
            store.append(trajectory_events(OLD_NAMES_CFG, i))
    assert main(["--store", url, "materialize", "--batch-size", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["num_trajectories"] == 3
    assert "--batch-size is deprecated; use --max-trajectories" in out.err
    assert main(["--store", url, "materialize", "--max-trajectories", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["num_trajectories"] == 0
