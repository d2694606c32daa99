"""The rollout ledger (docs/reference.md "Rollout ledger"), on both backends: the wire
fields, every refusal, the resume plan at each state of a group, idempotent retries,
and a running trajectory continued by a new process folding to one sample."""

from __future__ import annotations

import numpy as np
import pytest

import trajstore
from trajstore.errors import ValidationError

RUN = "grpo-a"


def started(tid: str, gid: str, prompt: str = "p1", epoch: int = 0, size: int = 2, run: str = RUN, **kw) -> dict:
    return {"type": "trajectory_started", "trajectory_id": tid, "group_id": gid, "run": run, "prompt_id": prompt,
            "epoch": epoch, "group_size": size, **kw}


def call(tid: str, seq: int, prompt: list[int], output: list[int], version: int = 1, **kw) -> dict:
    return {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt, "output_ids": output,
            "model_version": version, **kw}


def finished(tid: str, status: str = "completed") -> dict:
    return {"type": "trajectory_finished", "trajectory_id": tid, "status": status}


def dropped(gid: str, run: str = RUN, reason: str | None = "stale") -> dict:
    ev = {"type": "group_dropped", "run": run, "group_id": gid}
    if reason is not None:
        ev["reason"] = reason
    return ev


def refused(store, events, rule: str, index: int = 0) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        store.append(events)
    assert info.value.rule == rule, info.value
    assert info.value.index == index
    return info.value


def test_an_unknown_run_has_an_empty_plan(store):
    plan = store.rollout_state(RUN)
    assert plan.dispatched == frozenset() and plan.whole == () and plan.open == () and plan.dropped == ()


def test_the_plan_at_each_state_of_a_group(store):
    store.append([started("a", "g1"), started("b", "g1"), started("c", "g1"),
                  started("x", "g2", prompt="p2"), started("y", "g2", prompt="p2")])
    store.append([call("a", 0, [1, 2], [3, 4], version=3, finish_reason="length"),
                  call("a", 1, [1, 2, 3, 4, 9], [5], version=4, finish_reason="stop"),
                  finished("b"), finished("c", "aborted")])
    plan = store.rollout_state(RUN)
    assert plan.dispatched == {("p1", 0), ("p2", 0)}
    assert plan.whole == () and [g.group_id for g in plan.open] == ["g1", "g2"]  # oldest first
    g1 = plan.open[0]
    assert (g1.prompt_id, g1.epoch, g1.group_size) == ("p1", 0, 2)
    assert g1.finished == ("b",) and g1.failed == ("c",) and g1.missing == 0
    (tail,) = g1.running
    assert tail.trajectory_id == "a" and tail.next_seq == 2
    assert tail.tokens.dtype == np.int32 and tail.tokens.tolist() == [1, 2, 3, 4, 9, 5]
    assert tail.last_version == 4 and tail.last_finish_reason == "stop"
    g2 = plan.open[1]
    assert [t.trajectory_id for t in g2.running] == ["x", "y"] and g2.missing == 0
    assert all(t.next_seq == 0 and t.tokens.size == 0 and t.last_version is None for t in g2.running)

    # a replacement for the aborted one finishing makes g1 whole; g2 dropped
    store.append([finished("a", "truncated"), dropped("g2")])
    plan = store.rollout_state(RUN)
    assert [g.group_id for g in plan.whole] == ["g1"] and plan.open == ()
    assert plan.whole[0].finished == ("a", "b") and plan.whole[0].missing == 0
    assert [g.group_id for g in plan.dropped] == ["g2"] and plan.dropped[0].reason == "stale"
    assert [t.trajectory_id for t in plan.dropped[0].running] == ["x", "y"]
    assert plan.dispatched == {("p1", 0), ("p2", 0)}  # a dropped group's prompt stays dispatched
    assert store.rollout_state("another-run").dispatched == frozenset()


def test_missing_counts_the_episodes_still_to_start(store):
    store.append([started("a", "g", size=4), started("b", "g", size=4)])
    store.append([finished("a", "failed")])
    (g,) = store.rollout_state(RUN).open
    assert g.failed == ("a",) and len(g.running) == 1 and g.missing == 3


def test_more_than_group_size_started_the_first_to_finish_whole_it(store):
    store.append([started(t, "g", size=2) for t in "abc"])
    store.append([finished("c"), finished("a")])
    plan = store.rollout_state(RUN)
    (g,) = plan.whole
    assert g.finished == ("a", "c") and [t.trajectory_id for t in g.running] == ["b"]


def test_refusals(store):
    store.append([started("a", "g1"), {"type": "trajectory_started", "trajectory_id": "v4", "group_id": "plain"}])
    refused(store, [started("b", "g1", size=3)], "group_mismatch")
    refused(store, [started("b", "g1", epoch=1)], "group_mismatch")
    refused(store, [started("b", "g1", run="other")], "group_mismatch")
    refused(store, [{"type": "trajectory_started", "trajectory_id": "b", "group_id": "g1"}], "group_mismatch")
    refused(store, [started("b", "plain")], "group_mismatch")  # a group already outside the ledger
    e = refused(store, [started("b", "g2")], "prompt_redispatched")
    assert "'g1'" in str(e)  # names the first group
    refused(store, [dropped("nope")], "unknown_group")
    refused(store, [dropped("plain")], "unknown_group")
    refused(store, [dropped("g1", run="other")], "group_mismatch")
    store.append([dropped("g1")])
    refused(store, [started("b", "g1")], "group_dropped")
    refused(store, [{"type": "group_dropped", "run": RUN, "group_id": "g1", "event_id": "again"}], "group_dropped")
    # within one batch: the batch's own earlier events count
    refused(store, [started("c", "g3", prompt="p3"), started("d", "g3", prompt="p3", size=5)], "group_mismatch", 1)
    refused(store, [started("c", "g3", prompt="p3"), started("d", "g4", prompt="p3")], "prompt_redispatched", 1)
    refused(store, [started("c", "g3", prompt="p3"), dropped("g3"), started("d", "g3", prompt="p3")],
            "group_dropped", 2)
    # nothing of a refused batch was stored
    assert store.trajectory_state("c") is None and "p3" not in {p for p, _ in store.rollout_state(RUN).dispatched}
    # another epoch answers the prompt again
    store.append([started("b", "g5", epoch=1)])
    assert store.rollout_state(RUN).dispatched == {("p1", 0), ("p1", 1)}


@pytest.mark.parametrize("event, rule", [
    ({"run": RUN}, "missing_field"),
    ({"run": RUN, "prompt_id": "p", "epoch": 0}, "missing_field"),
    ({"run": RUN, "prompt_id": "p", "epoch": -1, "group_size": 2}, "epoch"),
    ({"run": RUN, "prompt_id": "p", "epoch": 1 << 31, "group_size": 2}, "int32_range"),
    ({"run": RUN, "prompt_id": "p", "epoch": 0, "group_size": 0}, "group_size"),
    ({"run": RUN, "prompt_id": "p", "epoch": 0, "group_size": 65536}, "group_size"),
    ({"run": "", "prompt_id": "p", "epoch": 0, "group_size": 2}, "run"),
    ({"run": RUN, "prompt_id": "x" * 256, "epoch": 0, "group_size": 2}, "prompt_id"),
    ({"run": RUN, "prompt_id": "p\x00", "epoch": 0, "group_size": 2}, "prompt_id"),
    ({"run": RUN, "prompt_id": "p", "epoch": 0.5, "group_size": 2}, "epoch"),
])
def test_the_fields_are_checked_all_or_none(event, rule):
    from trajstore.events import parse_event

    with pytest.raises(ValidationError) as info:
        parse_event({"type": "trajectory_started", "trajectory_id": "t", "group_id": "g", **event})
    assert info.value.rule == rule
    with pytest.raises(ValidationError) as info:  # and a ledger trajectory names its group
        parse_event({"type": "trajectory_started", "trajectory_id": "t", "run": RUN, "prompt_id": "p", "epoch": 0,
                     "group_size": 2})
    assert info.value.rule == "missing_field"
    with pytest.raises(ValidationError) as info:
        parse_event({"type": "group_dropped", "run": RUN})
    assert info.value.rule == "missing_field"
    with pytest.raises(ValidationError) as info:
        parse_event({"type": "group_dropped", "run": RUN, "group_id": "g", "status": "x"})
    assert info.value.rule == "unknown_field"


def test_retries_are_idempotent(store):
    batch = [started("a", "g"), started("b", "g"), call("a", 0, [1], [2])]
    store.append(batch)
    assert store.append(batch).num_duplicates == 3
    store.append([finished("b")])
    assert store.append([finished("b")]).num_duplicates == 1
    store.append([dropped("g")])
    assert store.append([dropped("g")]).num_duplicates == 1
    with pytest.raises(ValidationError) as info:  # its identity is (type, run, group_id)
        store.append([dropped("g", reason="other")])
    assert info.value.rule == "conflict"
    (g,) = store.rollout_state(RUN).dropped
    assert g.finished == ("b",) and [t.trajectory_id for t in g.running] == ["a"]
    rows = _group_rows(store)
    assert rows == [("g", 2, 1, 0, True)]  # counted once each


def test_v4_events_stay_valid(store):
    store.append([{"type": "trajectory_started", "trajectory_id": "a", "group_id": "g"}, call("a", 0, [1], [2]),
                  finished("a")])
    assert store.rollout_state(RUN).dispatched == frozenset() and _group_rows(store) == []


def test_the_check_dry_run_applies_the_rules_across_batches(store):
    checker = store.checker()
    checker.check([started("a", "g")])
    with pytest.raises(ValidationError) as info:
        checker.check([started("b", "g2")])
    assert info.value.rule == "prompt_redispatched"
    assert store.rollout_state(RUN).dispatched == frozenset()  # nothing written


def test_a_running_trajectory_continues_in_a_new_process_as_one_sample(store_url, tmp_path):
    """The driver dies after a call; a new Store reads the plan and sends the next call,
    whose prompt starts with the tail: one sample, each token's version kept."""
    payload = str(tmp_path / "payload")
    first = trajstore.connect(store_url, payload=payload)
    first.append([started("a", "g", size=1), call("a", 0, [1, 2, 3], [4, 5], version=7)])
    first.close()  # the driver is gone

    again = trajstore.connect(store_url, payload=payload)
    (g,) = again.rollout_state(RUN).open
    (tail,) = g.running
    assert tail.next_seq == 1 and tail.last_version == 7
    prompt = np.concatenate([tail.tokens, [6]]).tolist()
    again.append([call("a", tail.next_seq, prompt, [8, 9], version=9), finished("a")])
    again.materialize()
    (sample,) = list(again.samples())
    assert sample.prompt_ids.tolist() == [1, 2, 3]
    assert sample.response_ids.tolist() == [4, 5, 6, 8, 9]
    assert sample.token_model_versions.tolist() == [7, 7, -1, 9, 9]
    assert [g.group_id for g in again.rollout_state(RUN).whole] == ["g"]
    again.close()


def _group_rows(store) -> list[tuple]:
    from sqlalchemy import select

    from trajstore.schema import ledger_groups as t

    with store.log.db.reading("test") as conn:
        return [(r.group_id, r.num_started, r.num_finished, r.num_failed, r.dropped_position is not None)
                for r in conn.execute(select(t).order_by(t.c.group_id))]


def test_the_plan_through_a_writer_and_the_ingest_service(store):
    """The same plan from ``Store.rollout_state``, a Writer on the store, and a Writer on a real
    ingest service over loopback (bearer auth like the other endpoints)."""
    pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
    import http.client
    from urllib.parse import urlsplit

    from openai_upstream import serve_in_thread
    from trajstore.ingest.client import Writer
    from trajstore.ingest.service import make_app

    with serve_in_thread(make_app(store, token="tok")) as url:
        with Writer(url, token="tok") as writer:
            traj = writer.trajectory("a", group_id="g", run=RUN, prompt_id="p/1", epoch=3, group_size=2)
            traj.generation([1, 2], [3, 4], model_version=5, finish_reason="length")
            writer.trajectory("b", group_id="g", run=RUN, prompt_id="p/1", epoch=3, group_size=2).finish("failed")
            over_http = writer.rollout_state(RUN)  # flushes first
        with Writer(store) as writer:
            in_process = writer.rollout_state(RUN)
        direct = store.rollout_state(RUN)
        for plan in (over_http, in_process):
            assert plan.dispatched == direct.dispatched == {("p/1", 3)}
            (g,) = plan.open
            assert (g.group_id, g.failed, g.missing) == ("g", ("b",), 1)
            (t,) = g.running
            assert (t.trajectory_id, t.next_seq, t.last_version, t.last_finish_reason) == ("a", 1, 5, "length")
            assert t.tokens.dtype == np.int32 and t.tokens.tolist() == [1, 2, 3, 4]
        with Writer(url, token="tok") as writer:
            assert writer.rollout_state("unknown-run").open == ()
            with pytest.raises(ValidationError) as info:
                writer.rollout_state("x" * 300)
            assert info.value.rule == "run"
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port)
        conn.request("GET", "/v1/rollout_state?run=" + RUN)  # no token
        assert conn.getresponse().status == 401
        conn.close()


# -- docs/sql.md: the rollout_groups view and its recipes ---------------------------------------

def _recipes() -> list[str]:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "sql.md").read_text()
    start = doc.index("\n## Rollout ledger\n")
    section = doc[start:doc.index("\n## ", start + 5)]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def test_the_view_and_the_sql_md_recipes_answer_on_both_backends(store, store_url):
    import time

    from helpers import reader_url_for
    from trajstore.inspect.sql import run_query

    store.append([started("a", "g1", size=1), started("b", "g2", prompt="p2"), started("c", "g2", prompt="p2"),
                  started("d", "g3", prompt="p3"), started("e", "g4", prompt="p1", epoch=1, size=1),
                  {"type": "trajectory_started", "trajectory_id": "v4", "group_id": "plain"}])
    store.append([finished("a"), finished("b", "failed"), dropped("g3"), finished("d", "aborted")])
    url = reader_url_for(store_url)
    rows = run_query(url, "SELECT group_id, num_started, num_finished, num_failed, num_running, whole, dropped, "
                          "last_event_at FROM rollout_groups ORDER BY group_id").rows
    assert [(r[0], r[1], r[2], r[3], r[4], bool(r[5]), bool(r[6])) for r in rows] == [
        ("g1", 1, 1, 0, 0, True, False), ("g2", 2, 0, 1, 1, False, False), ("g3", 1, 0, 1, 0, False, True),
        ("g4", 1, 0, 0, 1, False, False)]
    assert all(abs(r[7] - time.time()) < 300 for r in rows)
    progress, stuck = _recipes()
    by_epoch = run_query(url, progress).rows
    assert [tuple(int(x) for x in r) for r in by_epoch] == [(0, 3, 1, 1, 1, 1), (1, 1, 0, 0, 1, 1)]
    if store_url.startswith("postgresql"):
        stuck = stuck.replace("strftime('%s', 'now')", "extract(epoch FROM now())")
    assert run_query(url, stuck).rows == []  # nothing idle for ten minutes yet
    # oldest first: g4 changed last in the first append, g2 in the second
    assert [r[1] for r in run_query(url, stuck.replace("- 600", "+ 600")).rows] == ["g4", "g2"]


# -- readers: whole as the ledger counts, dropped never handed out ---------------------------------

def test_readers_count_whole_as_the_ledger_and_never_hand_out_a_dropped_group(store):
    from trajstore import SampleReader

    def episode(tid, gid, status, prompt="p1", size=2, token=1):
        return [started(tid, gid, prompt=prompt, size=size), call(tid, 0, [token], [token + 1]), finished(tid, status)]

    # g1 (size 2): a completed, b aborted (does not count), c completed -> whole with three trajectories;
    # d finishes after g1 was whole: not part of it. g2 dropped after one completed. g3 open.
    store.append(episode("a", "g1", "completed") + episode("b", "g1", "aborted"))
    store.append(episode("x", "g2", "completed", prompt="p2") + [dropped("g2")])
    store.append(episode("c", "g1", "completed") + episode("o", "g3", "completed", prompt="p3"))
    store.append([started("d", "g1", size=2), finished("d", "truncated")])
    store.materialize()

    reader = SampleReader(store, batch_size=8, keep_groups=True, group_size=5, drop_last=False)
    handed = [s.trajectory_id for batch in reader for s in batch]
    reader.close()
    assert sorted(handed) == ["a", "b", "c"]  # the ledger's group_size 2, not the reader's 5
    reader = SampleReader(store, batch_size=8, drop_last=False)
    handed = [s.trajectory_id for batch in reader for s in batch]
    reader.close()
    assert "x" not in handed and sorted(handed) == ["a", "b", "c", "o"]
