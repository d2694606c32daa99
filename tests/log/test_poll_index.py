"""The materializer's idle poll seeks an index instead of scanning every
unfinished event after its checkpoint: the plan of the exact query
it runs, on SQLite and PostgreSQL, with many unfinished events in the log."""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy import insert, update

import trajstore
from trajstore.materializer import Materializer
from trajstore.schema import events, log_head, metadata


def _seed(store, n: int) -> int:
    """A folded trajectory (a checkpoint), then n generation index rows of running trajectories."""
    tid = "done"
    store.append([
        {"type": "trajectory_started", "trajectory_id": tid},
        {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": [1, 2], "output_ids": [3],
         "logprobs": [-0.5], "model_version": 0},
        {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"},
    ])
    store.materialize()
    head = store.log.head_position()
    now = time.time()
    with store.log.write_engine.begin() as conn:
        conn.execute(insert(events), [
            {"position": head + 1 + p, "trajectory_id": f"run-{p % 100}", "type": "generation", "seq": p // 100,
             "identity": f"generation:run-{p % 100}:{p // 100}", "content_hash": b"\0" * 16, "created_at": now}
            for p in range(n)])
        conn.execute(update(log_head).where(log_head.c.id == 1).values(position=head + n))
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("ANALYZE events")
    return head


def _plan(store, after: int) -> str:
    """The plan of read_events as the materializer calls it."""
    q = (sa.select(events).where(events.c.position > after)
         .where(events.c.type.in_(["trajectory_finished"])).order_by(events.c.position).limit(256))
    engine = store.log.read_engine
    sql = str(q.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return "\n".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
        return "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + sql))


def test_idle_poll_seeks_the_type_position_index(store_url, tmp_path):
    with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as store:
        checkpoint = _seed(store, 20_000)
        m = Materializer(store)
        assert m.step() is None  # nothing finished after the checkpoint: the idle poll
        plan = _plan(store, checkpoint)
        assert "ix_events_type_position" in plan, plan
        assert "Seq Scan" not in plan and "SCAN events" not in plan, plan


def test_schema_and_migrations_agree_on_the_index(store_url, tmp_path):
    assert "ix_events_type_position" in {i.name for i in metadata.tables["events"].indexes}
    with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as store:
        found = sa.inspect(store.log.read_engine).get_indexes("events")
        assert {"name": "ix_events_type_position", "columns": ["type", "position"]} in [
            {"name": i["name"], "columns": i["column_names"]} for i in found]
