"""A Writer's output while its PostgreSQL server restarts: trajstore's own
one-line reports, not psycopg's ``error ignored terminating
<psycopg.Pipeline [BAD]>`` line between them (a real server, restarted with
``pg_ctl -m immediate`` under a writing process)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent


@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_a_writer_through_postgres_restarts_prints_only_trajstore_lines(fault_cluster, tmp_path):
    url = fault_cluster.create_database()
    code = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from fuzz_events import CONFIG
from trajstore.demo._simulate import trajectory_events
from trajstore.ingest.client import Writer
import trajstore
store = trajstore.connect({url!r}, payload={str(tmp_path / 'pay')!r})
with Writer(store, max_batch_events=8) as w:
    for i in range(10**6):
        w.extend([dict(e, trajectory_id=f"r-{{i}}") for e in trajectory_events(CONFIG, i % 64)])
        if i == 0:
            w.flush()
            print("writing", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # restarts begin once the writer has connected and stored a batch (a slow
        # start under load must not meet a restart inside connect())
        assert proc.stdout.readline().strip() == "writing", proc.communicate()[1][-2000:]
        for _ in range(14):
            fault_cluster.restart("immediate")
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=120)
    lines = err.splitlines()
    assert any(line.startswith("trajstore writer: cannot send") for line in lines), err[-2000:]
    assert not [line for line in lines if "<psycopg." in line or "error ignored" in line], err[-3000:]
