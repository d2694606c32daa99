"""``trajstore partition``: the PostgreSQL event index partitioned by position. After the
conversion appends land in the new partitions, idempotent retries and conflicts behave as
before (identities in ``event_identities``, kept by a trigger), materialize folds the same
samples as an unpartitioned store, the views read every event, retention deletes identities
with their events, and the command is repeatable. SQLite refuses in one line."""

from __future__ import annotations

import pytest
from sqlalchemy import text

import trajstore
from trajstore.cli import main
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.errors import ConflictError

CFG = RolloutConfig(turns=3, prompt_tokens=40, output_tokens=20, observation_tokens=8, layers=2, topk=2,
                    num_experts=16, seed=5)


def _append(store, ids) -> None:
    for i in ids:
        evs = trajectory_events(CFG, i)
        for k in range(0, len(evs), 3):
            store.append(evs[k : k + 3])


def _scalar(store, sql: str):
    with store.log.read_engine.connect() as conn:
        return conn.execute(text(sql)).scalar_one()


def test_partitioned_event_index_keeps_appends_retries_folds_and_views(fresh_pg_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(fresh_pg_url, payload=payload)
    _append(store, range(6))
    store.materialize()
    views_before = _scalar(store, "SELECT count(*) FROM generation_events")

    assert main(["--store", fresh_pg_url, "partition", "--rows", "40", "--ahead", "2"]) == 0
    assert "now partitioned" in capsys.readouterr().out
    assert _scalar(store, "SELECT relkind FROM pg_class WHERE oid = 'events'::regclass") == "p"
    parts = {r for r in store.log.read_engine.connect().execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'events'::regclass")).scalars()}
    assert {"events_legacy", "events_default"} <= parts and len(parts) == 4
    assert _scalar(store, "SELECT count(*) FROM generation_events") == views_before
    assert _scalar(store, "SELECT count(*) FROM event_identities") == _scalar(
        store, "SELECT count(*) FROM events WHERE identity IS NOT NULL")

    # appends after the conversion, in the new partitions; identical retries are no-ops
    head = store.log.head_position()
    _append(store, range(6, 12))
    new_parts = sorted(p for p in parts if p.startswith("events_p"))
    assert _scalar(store, f"SELECT count(*) FROM {new_parts[0]}") > 0  # the new events are in the new partitions
    assert _scalar(store, f"SELECT count(*) FROM events_legacy WHERE position > {head}") == 0
    n = _scalar(store, "SELECT count(*) FROM events")
    _append(store, range(0, 12))  # every event again: idempotent retries, old partition and new
    assert _scalar(store, "SELECT count(*) FROM events") == n
    # event ids are identities too: a retry is dropped, another event with the same id is a conflict
    # (a batch that starts its trajectories skips the identity read on its first attempt: the
    # trigger's unique key makes it a lost race, the re-read finds the conflict)
    store.append([{"type": "trajectory_started", "trajectory_id": "x1", "event_id": "e-1"}])
    n = _scalar(store, "SELECT count(*) FROM events")
    store.append([{"type": "trajectory_started", "trajectory_id": "x1", "event_id": "e-1"}])
    with pytest.raises(ConflictError):
        store.append([{"type": "trajectory_started", "trajectory_id": "x2", "event_id": "e-1"}])
    assert _scalar(store, "SELECT count(*) FROM events") == n
    store.append([{"type": "trajectory_finished", "trajectory_id": "x1", "status": "aborted"}])

    store.materialize()
    clean = trajstore.connect(f"sqlite:///{tmp_path}/clean.db")
    _append(clean, range(12))
    clean.append([{"type": "trajectory_started", "trajectory_id": "x1", "event_id": "e-1"},
                  {"type": "trajectory_finished", "trajectory_id": "x1", "status": "aborted"}])
    clean.materialize()
    got, want = list(store.samples()), list(clean.samples())
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    assert all(a.equals(b) for a, b in zip(got, want))
    assert _scalar(store, "SELECT count(*) FROM generation_events") == _scalar(
        clean, "SELECT count(*) FROM generation_events")
    assert _scalar(store, "SELECT count(*) FROM trajectory_summary") == 13
    assert _scalar(store, "SELECT has_table_privilege('trajstore_reader', 'events', 'SELECT')")
    assert _scalar(store, "SELECT has_table_privilege('trajstore_reader', 'trajectory_summary', 'SELECT')")

    # retention deletes the identities with the events; a repeated command only adds partitions
    assert main(["--store", fresh_pg_url, "--payload", payload, "archive", str(tmp_path / "a"),
                 "--older-than-s", "0"]) == 0
    assert _scalar(store, "SELECT count(*) FROM events") == 0
    assert _scalar(store, "SELECT count(*) FROM event_identities") == 0
    capsys.readouterr()
    assert main(["--store", fresh_pg_url, "partition", "--rows", "40", "--ahead", "4", "--drop-empty"]) == 0
    out = capsys.readouterr().out
    assert "dropped" in out and "events_legacy" in out
    left = {r for r in store.log.read_engine.connect().execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'events'::regclass")).scalars()}
    assert "events_legacy" not in left and "events_default" in left
    assert "now partitioned" not in out and "created 0 partition" not in out and "created" in out
    _append(store, range(30, 33))
    store.materialize()
    assert len(list(store.samples())) > len(got)
    store.close()
    clean.close()


def test_sqlite_refuses_to_partition_in_one_line(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(url).close()
    assert main(["--store", url, "partition"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not partition the event index" in err
