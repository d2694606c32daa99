"""The storage seam's conformance suite: ``EventLog`` and ``SampleIndex`` driven
directly (no ``Store``), on every registered backend (the ``store_url`` fixture has
one case per entry of ``trajstore.log._registry.BACKENDS``: SQLite and a real
PostgreSQL), including which error each failure raises (the contract in
``trajstore/log/base.py``)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import text

import trajstore
from trajstore.errors import IndexInvariantError, StoreUnavailable, TrajstoreError, ValidationError
from trajstore.log.base import EventLog, SampleIndex, Shard, StaleState, TrajectoryWrite
from trajstore.log._open import open_sql
from trajstore.log._backend import Backend
from trajstore.log._dialect import SqlDialect
from trajstore.log._registry import BACKENDS, backend_of

from pg_cluster import free_loopback_port


def _engines(url: str):
    return backend_of(url).make_engines(url)


# What every backend must implement itself (the base class only declares them), and what only
# a backend that says it has the capability must (``single_writer`` needs no tail bound).
REQUIRED = ("make_engines", "default_payload_dir", "read_only", "join_sorted", "version_spans", "span_int",
            "positions", "head")
IF_CAPABLE = {"settled_head": lambda b: not b.single_writer, "make_reader_login": lambda b: b.reader_logins}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_implements_the_backend(name):
    backend = BACKENDS[name]
    assert issubclass(backend, Backend) and backend.name == name

    def own(member: str) -> bool:
        return any(member in k.__dict__ for k in backend.__mro__ if k not in (Backend, SqlDialect, object))

    needed = list(REQUIRED) + [m for m, capable in IF_CAPABLE.items() if capable(backend)]
    assert [m for m in needed if not own(m)] == []


# The store_url these fixtures connect first thing (a store's first connect migrates it): a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = ("seam",)


@pytest.fixture
def seam(store_url, tmp_path):
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()  # migrations
    log, index = open_sql(*_engines(store_url))
    yield log, index
    log.close()


def traj(tid: str, revision: int = 1, **kw) -> dict:
    row = {"trajectory_id": tid, "group_id": None, "num_experts": None, "metadata": {}, "status": "running",
           "revision": revision, "last_seq": -1, "reward_mode": None, "route_layers": None, "route_topk": None,
           "seq_len": 0, "seq_hash": b"\0" * 16, "route_len": 0, "reward": None, "started_position": 0,
           "finished_position": None, "created_at": 0.0, "updated_at": 0.0}
    row.update(kw)
    return row


def ev(tid: str, type_: str = "trajectory_started", identity: str | None = "auto", digest: bytes = b"\1" * 16,
       **kw) -> dict:
    if identity == "auto":
        identity = f"{type_}:{tid}:{kw.get('seq')}"
    return {"trajectory_id": tid, "type": type_, "identity": identity, "content_hash": digest, "created_at": 0.0, **kw}


def start(log: EventLog, tid: str) -> list[int]:
    return log.commit_append([ev(tid)], [TrajectoryWrite(traj(tid), None)], None)


def seg(name: str, kind: str = "events") -> dict:
    return {"name": name, "kind": kind, "num_rows": 1, "num_bytes": 1, "created_at": 0.0}


def state(log: EventLog) -> tuple:
    return (log.head_position(), log.count_events(after_position=0), sorted(log.referenced_segments()))


# -- EventLog: ordering, atomicity, reads -------------------------------------------------------------

def test_positions_are_consecutive_and_read_in_order(seam):
    log, _ = seam
    assert log.head_position() == 0 and log.read_events(after_position=0, limit=10) == []
    assert start(log, "a") == [1]
    rows = [ev("a", "generation", seq=s, segment="s1", segment_row=s) for s in range(3)]
    assert log.commit_append(rows, [TrajectoryWrite(traj("a", 2, last_seq=2), 1)], seg("s1")) == [2, 3, 4]
    assert start(log, "b") == [5]
    assert log.head_position() == 5
    assert [r["position"] for r in log.read_events(after_position=1, limit=3)] == [2, 3, 4]
    assert [r["position"] for r in log.read_events(after_position=0, limit=10, types=["trajectory_started"])] == [1, 5]
    assert log.count_events(after_position=2, types=["generation"]) == 2
    by_traj = log.trajectory_events(["a", "b", "none"])
    assert [r["position"] for r in by_traj["a"]] == [1, 2, 3, 4] and len(by_traj["b"]) == 1 and by_traj["none"] == []
    assert log.load_trajectories(["a", "x"])["a"]["revision"] == 2 and "x" not in log.load_trajectories(["x"])
    assert log.lookup_identities(["trajectory_started:a:None", "nope"]) == {"trajectory_started:a:None": b"\1" * 16}
    assert log.referenced_segments() == {"s1"}
    counts = log.counts()
    assert counts["head_position"] == 5 and counts["events_by_type"] == {"trajectory_started": 2, "generation": 3}
    assert counts["trajectories_by_status"] == {"running": 2}


def test_started_and_finished_positions_are_marked_on_the_trajectory(seam):
    log, _ = seam
    start(log, "a")
    log.commit_append([ev("a", "trajectory_finished", status="completed")],
                      [TrajectoryWrite(traj("a", 2, status="completed", started_position=1), 1)], None)
    row = log.load_trajectories(["a"])["a"]
    assert (row["started_position"], row["finished_position"], row["status"]) == (1, 2, "completed")


def test_empty_batch_stores_nothing(seam):
    log, _ = seam
    assert log.commit_append([], [], None) == [] and log.head_position() == 0


# -- EventLog: which error each failure raises ---------------------------------------------------------

def test_stale_revision_raises_stale_state_and_stores_nothing(seam):
    log, _ = seam
    start(log, "a")
    before = state(log)
    with pytest.raises(StaleState):
        log.commit_append([ev("a", "generation", seq=0, segment="s1", segment_row=0)],
                          [TrajectoryWrite(traj("a", 2), 7)], seg("s1"))
    assert state(log) == before  # no event, no segment row, head not moved


def test_identity_race_raises_stale_state(seam):
    log, _ = seam
    start(log, "a")
    with pytest.raises(StaleState):
        log.commit_append([ev("b", identity="trajectory_started:a:None")], [TrajectoryWrite(traj("b"), None)], None)
    assert log.load_trajectories(["b"]) == {}


def test_trajectory_creation_race_raises_stale_state(seam):
    log, _ = seam
    start(log, "a")
    with pytest.raises(StaleState):
        log.commit_append([ev("a", identity="other")], [TrajectoryWrite(traj("a"), None)], None)


def test_other_constraint_is_a_bug_not_a_race(seam):
    """A segment name stored twice is no race trajstore can lose: IndexInvariantError, not StaleState."""
    log, _ = seam
    start(log, "a")
    log.commit_append([ev("a", "reward", identity=None, reward=1.0)], [TrajectoryWrite(traj("a", 2), 1)], seg("s1"))
    before = state(log)
    with pytest.raises(IndexInvariantError) as info:
        log.commit_append([ev("a", "reward", identity=None, reward=2.0)], [TrajectoryWrite(traj("a", 3), 2)], seg("s1"))
    assert not isinstance(info.value, (StoreUnavailable, ValidationError)) and "\n" not in str(info.value)
    assert state(log) == before


def _unstorable(store_url: str) -> list[tuple[str, dict]]:
    cases = [("int beyond 64 bits", dict(model_version=2**64))]
    if store_url.startswith("postgresql"):
        cases += [("300-char id", dict(trajectory_id="x" * 300)),
                  ("NUL in a string", dict(finish_reason="a\x00b")),
                  ("int beyond 32 bits", dict(model_version=2**31))]
    return cases


def test_values_the_database_cannot_store_are_validation_errors(seam, store_url):
    log, _ = seam
    start(log, "a")
    before = state(log)
    for what, change in _unstorable(store_url):
        row = ev("a", "generation", seq=0, **{k: v for k, v in change.items() if k != "trajectory_id"})
        row["trajectory_id"] = change.get("trajectory_id", "a")
        with pytest.raises(ValidationError) as info:
            log.commit_append([row], [TrajectoryWrite(traj("a", 2), 1)], None)
        assert info.value.rule == "storable_value", what
        assert "\n" not in str(info.value), what
        assert state(log) == before, what
        assert log.load_trajectories(["a"])["a"]["revision"] == 1, what


def test_unreachable_database_is_store_unavailable(store_url, tmp_path):
    if store_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path}"  # a directory: cannot be opened as a database
    else:
        url = f"postgresql+psycopg://postgres@127.0.0.1:{free_loopback_port()}/gone"
    log, index = open_sql(*_engines(url))
    for call in (lambda: log.head_position(), lambda: start(log, "a"), lambda: index.load_checkpoint(Shard()),
                 lambda: list(index.iter_sample_rows(where={}, after=None, page_rows=10))):
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert "\n" not in str(info.value)
    log.close()


@pytest.mark.postgres
def test_backend_killed_mid_statement_is_store_unavailable_and_stores_nothing(fresh_pg_url, tmp_path):
    """The appender's backend is terminated while it waits for a lock (here on the
    trajectories table, after it took its positions; before COMMIT was sent):
    StoreUnavailable, nothing stored, the next call works."""
    trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")).close()
    log, _ = open_sql(*_engines(fresh_pg_url))
    start(log, "a")
    blocker = log.write_engine.connect()
    tx = blocker.begin()
    blocker.execute(text("LOCK TABLE trajectories IN SHARE MODE"))  # the append's INSERT waits for it
    out: dict = {}

    def append() -> None:
        try:
            out["positions"] = start(log, "b")
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=append)
    t.start()
    # autocommit: inside one transaction pg_stat_activity is a snapshot that never changes
    with log.read_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as admin:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pid = admin.execute(text("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                     "AND query LIKE 'INSERT INTO trajectories%'")).scalar()
            if pid:
                admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                break
            time.sleep(0.02)
    t.join(timeout=60)
    tx.rollback()
    blocker.close()
    assert isinstance(out.get("error"), StoreUnavailable), out
    assert type(out["error"]).__name__ == "StoreUnavailable"  # certain: not CommitUnknownError
    assert log.load_trajectories(["b"]) == {} and log.head_position() == 1
    assert start(log, "b")[0] > 1  # (the killed append's position is a hole: positions come from a sequence)
    assert log.head_position() > 1
    log.close()


# -- SampleIndex -----------------------------------------------------------------------------------------

def sample(tid: str, i: int, fp: int, **kw) -> dict:
    row = {"trajectory_id": tid, "sample_index": i, "finished_position": fp, "group_id": "g", "status": "completed",
           "is_last_step": True, "prompt_len": 1, "response_len": 1, "num_loss_tokens": 1, "num_merged_calls": 1,
           "reward": 1.0, "min_model_version": 0, "max_model_version": 0, "num_route_rows": None,
           "segment": "samples-x", "segment_row": i, "created_at": 0.0}
    row.update(kw)
    return row


def cp(position: int) -> dict:
    return {"position": position, "num_steps_before": 0, "num_samples_after": 0, "prefix_mismatch_count": 0}


def test_samples_commit_with_their_checkpoint_and_read_in_order(seam):
    log, index = seam
    s0, s1 = Shard(0, 2), Shard(1, 2)
    assert index.load_checkpoint(s0) is None and index.watermark() == 0 and index.shard_count() is None
    index.commit_samples(s0, [sample("b", 0, 9), sample("a", 1, 4), sample("a", 0, 4)], seg("samples-x", "samples"),
                         cp(10), 0)
    assert index.load_checkpoint(s0)["position"] == 10
    assert index.shard_count() == 2 and index.watermark() == 0  # shard 1 has not committed yet
    index.commit_samples(s1, [], None, cp(6), 0)
    assert set(index.checkpoints()) == {s0, s1}
    assert index.watermark() == 6 and index.watermark(2) == 6
    with pytest.raises(ValidationError, match="num_shards=3"):
        index.watermark(3)
    pages = list(index.iter_sample_rows(where={}, after=None, page_rows=2))
    assert [[(r["trajectory_id"], r["sample_index"]) for r in p] for p in pages] == [[("a", 0), ("a", 1)], [("b", 0)]]
    assert [r["trajectory_id"] for p in index.iter_sample_rows(where={"max_finished_position": 6}, after=(4, 0),
                                                                page_rows=10) for r in p] == ["a"]
    assert index.count_samples() == 3
    assert "samples-x" in log.referenced_segments()


def test_moved_checkpoint_raises_stale_state_and_stores_nothing(seam):
    _, index = seam
    shard = Shard()
    index.commit_samples(shard, [sample("a", 0, 3)], None, cp(3), 0)
    for expected in (0, 2):  # a first commit racing an existing one; a checkpoint that moved on
        with pytest.raises(StaleState):
            index.commit_samples(shard, [sample("b", 0, 5)], None, cp(5), expected)
    assert index.load_checkpoint(shard)["position"] == 3 and index.count_samples() == 1


def test_shard_key_has_one_spelling():
    assert str(Shard(1, 4)) == "1/4" and Shard.parse("1/4") == Shard(1, 4)
    assert sum(Shard(k, 3).owns("traj-7") for k in range(3)) == 1
    for bad in ("1", "a/b", "4/4", "-1/2"):
        with pytest.raises(ValidationError):
            Shard.parse(bad)


def test_errors_are_trajstore_errors_or_stale_state():
    assert issubclass(IndexInvariantError, TrajstoreError) and not issubclass(IndexInvariantError, StoreUnavailable)
    assert issubclass(EventLog, object) and issubclass(SampleIndex, object)
