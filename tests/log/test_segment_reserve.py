"""The reserve of empty log segment files (payload._reserve.Reserve): appends fill
files made ahead of them, and nothing a removed, stale or inherited reserve
file could do loses an acknowledged event or leaves a referenced file missing."""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
import pytest

import trajstore
import trajstore.payload._reserve as reserve_mod
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.errors import StoreUnavailable
from trajstore.payload._columns import list_column

CFG = RolloutConfig(turns=3, prompt_tokens=20, output_tokens=10, observation_tokens=4, layers=3, topk=2)


def _held(store, at_least: int = 1, timeout_s: float = 10.0) -> frozenset[str]:
    """The reserve's files once its background refill has made some."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = store.payload._reserve.held()
        if len(held) >= at_least and not store.payload._reserve._pending:
            return held
        assert time.monotonic() < deadline, "the reserve was never refilled"
        time.sleep(0.01)


def _segments_of(store, trajectory_id: str) -> set[str]:
    rows = store.log.trajectory_events([trajectory_id])[trajectory_id]
    return {r["segment"] for r in rows if r["segment"] is not None}


def _on_disk(store) -> set[str]:
    return {n for n in os.listdir(store.payload.root) if n.endswith(".arrow")}


def test_appends_fill_files_reserved_ahead_and_close_removes_the_rest(tmp_path):
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    first = trajectory_events(CFG, 0)
    store.append(first)  # the reserve starts empty: a new file, and a refill begins
    held = _held(store)
    assert all(os.path.getsize(os.path.join(store.payload.root, n)) == 0 for n in held)
    assert held <= _on_disk(store) and not held & {n for n, _ in store.payload.list_names()}
    second = trajectory_events(CFG, 1)
    store.append(second)
    (used,) = _segments_of(store, second[0]["trajectory_id"])
    assert used in held  # written into a reserved file
    assert os.path.getsize(os.path.join(store.payload.root, used)) > 0
    store.close()
    assert _on_disk(store) == store.log.referenced_segments()  # the unused reserve is gone

    again = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    clean = trajstore.connect(f"sqlite:///{tmp_path}/c.db", payload=str(tmp_path / "c"))
    clean.append(first)
    clean.append(second)
    assert again.materialize().num_trajectories == clean.materialize().num_trajectories == 2
    assert all(a.equals(b) for a, b in zip(again.samples(), clean.samples(), strict=True))


def test_reserved_files_another_gc_removed_are_skipped(tmp_path):
    """Another process's GC with a zero grace takes the reserve's files (they are
    unreferenced to it); appends then write new files and stay readable."""
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    store.append(trajectory_events(CFG, 0))
    held = _held(store)
    other = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    assert held <= set(other.collect_garbage(grace_s=0))
    assert not held & _on_disk(store)
    for i in range(1, 4):
        store.append(trajectory_events(CFG, i))
    for i in range(1, 4):
        tid = trajectory_events(CFG, i)[0]["trajectory_id"]
        assert all(os.path.exists(store.payload.path(n)) for n in _segments_of(store, tid)), i
    assert store.materialize().num_trajectories == 4


def test_a_reserved_file_removed_after_its_write_fails_the_sync(tmp_path):
    """The file an append wrote is gone before it was made durable: the append
    must fail rather than commit a row naming a missing file."""
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    store.append(trajectory_events(CFG, 0))
    held = _held(store)
    p = store.payload
    name = p.new_log_segment()
    assert name in held
    table = pa.table({"ids": list_column([pa.array([1, 2, 3], pa.int32()).to_numpy()], "int32")})
    p.write(name, table, rows_per_batch=1, durable=False)
    os.unlink(p.path(name))
    with pytest.raises(StoreUnavailable, match="cannot sync payload segment"):
        p.make_durable(name)


def test_a_reserved_file_recreated_by_its_write_is_synced_as_a_new_file(tmp_path):
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    store.append(trajectory_events(CFG, 0))
    _held(store)
    p = store.payload
    name = p.new_log_segment()
    os.unlink(p.path(name))  # removed between its take and its write: the write makes a new file
    table = pa.table({"ids": list_column([pa.array([1, 2, 3], pa.int32()).to_numpy()], "int32")})
    p.write(name, table, rows_per_batch=1, durable=False)
    assert p._reserve.sync_taken(name) is False  # not the inode whose entry was made durable
    p.make_durable(name)  # synced as a new file (and its directory)
    assert p.read_rows(name, [0]).lists("ids", "int32")[0].tolist() == [1, 2, 3]


def test_stale_reserved_files_are_deleted_not_used(tmp_path, monkeypatch):
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    store.append(trajectory_events(CFG, 0))
    held = _held(store)
    monkeypatch.setattr(reserve_mod, "_RESERVE_MAX_AGE_S", 0.0)
    second = trajectory_events(CFG, 1)
    store.append(second)
    (used,) = _segments_of(store, second[0]["trajectory_id"])
    assert used not in held and not held & _on_disk(store)


def test_a_forked_child_neither_takes_nor_deletes_its_parents_reserve(tmp_path):
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    store.append(trajectory_events(CFG, 0))
    held = _held(store)
    pid = os.fork()
    if pid == 0:  # the child: its own names, and closing leaves the parent's files alone
        code = 1
        try:
            name = store.payload.new_log_segment()
            store.payload.close()
            code = 0 if name not in held and not store.payload._reserve.held() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert held <= _on_disk(store) and held <= store.payload._reserve.held()


def test_a_store_never_closed_leaves_no_reserved_file_at_exit(tmp_path):
    import subprocess
    import sys

    script = f"""
import time, trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
cfg = RolloutConfig(turns=3, prompt_tokens=20, output_tokens=10, observation_tokens=4, layers=3, topk=2)
s = trajstore.connect("sqlite:///{tmp_path}/r.db", payload="{tmp_path}/p")
s.append(trajectory_events(cfg, 0))
deadline = time.monotonic() + 10
while not s.payload._reserve.held() and time.monotonic() < deadline:
    time.sleep(0.01)
assert s.payload._reserve.held()
s.append(trajectory_events(cfg, 1))
print(len(s.payload._reserve.held()))
"""  # and exits without close()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 1  # files were held when it exited
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    assert _on_disk(store) == store.log.referenced_segments() and len(_on_disk(store)) == 2


def test_close_waits_for_a_refill_in_flight_and_leaves_no_file(tmp_path, monkeypatch):
    store = trajstore.connect(f"sqlite:///{tmp_path}/r.db", payload=str(tmp_path / "p"))
    real_fsync_dir = reserve_mod.fsync_path
    started = []

    def slow_fsync_dir(path):  # the refill's directory fsync, slowed down so close() lands mid-refill
        if threading.current_thread().name.startswith("trajstore-reserve"):
            started.append(path)
            time.sleep(0.5)
        real_fsync_dir(path)

    monkeypatch.setattr(reserve_mod, "fsync_path", slow_fsync_dir)
    store.append(trajectory_events(CFG, 0))  # the reserve is empty: a refill begins
    deadline = time.monotonic() + 10
    while not started:
        assert time.monotonic() < deadline, "no refill started"
        time.sleep(0.005)
    assert store.payload._reserve._refilling
    store.close()
    assert _on_disk(store) == store.log.referenced_segments()  # at once, not after the refill ends
