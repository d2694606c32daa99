"""Round trips of the append on a real PostgreSQL, counted from libpq's trace
(tests/pg_roundtrips.py): a coalesced group of calls continuing many
trajectories costs at most three (its state read; BEGIN and every write, the
positions taken by the events' INSERT; its COMMIT: 13 before), with no ping of a connection in use, and a lost revision
race inside the pipelined transaction still stores nothing and re-admits."""

from __future__ import annotations

import time

from helpers import finished, gen, started
from pg_roundtrips import RoundTrips

import trajstore
from trajstore.ingest._group_commit import GroupCommitter
from trajstore.log import postgres


def _calls(tids, turn):
    return [gen(t, turn, [1, 2] + [3] * (3 * turn), [4, 5, 6], logprobs=[-0.5] * 3, event_id=f"{t}-{turn}")
            for t in tids]


def test_a_coalesced_group_continuing_many_trajectories_costs_three_round_trips(fresh_pg_url, tmp_path):
    tids = [f"r{i}" for i in range(32)]
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.append([started(t) for t in tids])
        store.append(_calls(tids, 0))
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_calls(tids, 1))  # a new traced connection: its first statements are prepared
            per_group = []
            for turn in (2, 3, 4):
                trips.reset()
                committer = GroupCommitter(store, linger_s=0.5)
                futures = [committer.submit([ev]) for ev in _calls(tids, turn)]
                assert {f.result(30)[0] for f in futures} == {32}
                committer.close()
                per_group.append(trips.counts())
        finally:
            trips.close()
    for counts in per_group:
        assert counts["commits"] == 1, per_group
        assert counts["round_trips"] <= 3, per_group
        assert counts["pings"] == 0, per_group


def test_a_group_finishing_many_trajectories_costs_three_round_trips_too(fresh_pg_url, tmp_path):
    """The check for labels left unresolved by earlier calls goes out with the positions."""
    tids = [f"f{i}" for i in range(16)]
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.append([started(t) for t in tids] + _calls(tids, 0))
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_calls(tids, 1))  # a traced connection, its statements prepared
            trips.reset()
            store.append([finished(t) for t in tids])
            counts = trips.counts()
        finally:
            trips.close()
        assert {store.trajectory_state(t).status for t in tids} == {"completed"}
    assert counts["commits"] == 1 and counts["round_trips"] <= 3, counts


def test_a_connection_idle_past_the_ping_threshold_is_pinged_once(fresh_pg_url, tmp_path, monkeypatch):
    monkeypatch.setattr(postgres, "PING_IDLE_S", 0.2)
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.append([started("idle")])
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_calls(["idle"], 0))
            trips.reset()
            store.append(_calls(["idle"], 1))
            busy = trips.counts()
            time.sleep(0.4)
            trips.reset()
            store.append(_calls(["idle"], 2))
            idle = trips.counts()
        finally:
            trips.close()
    assert busy["pings"] == 0 and idle["pings"] == 1, (busy, idle)


def test_a_revision_race_inside_the_pipelined_write_stores_nothing_and_re_admits(fresh_pg_url, tmp_path):
    """Two stores append the next call of one trajectory: the one whose read went stale loses
    the race in the server-side guard, stores nothing, re-reads and finds its seq taken."""
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as a, \
            trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as b:
        a.append([started("race"), *_calls(["race"], 0)])
        loaded = a.log.load_append_state  # a reads the state, then b moves the trajectory first

        def stale_read(identities, tids, **kw):
            out = loaded(identities, tids, **kw)
            b.append(_calls(["race"], 1))
            return out

        a.log.load_append_state = stale_read
        other = _calls(["race"], 1)
        other[0]["output_ids"] = [7, 7, 7]
        other[0]["event_id"] = "other-1"
        try:
            a.append(other)
        except trajstore.ValidationError as e:
            assert e.rule in ("seq_taken", "conflict"), e
        else:
            raise AssertionError("the stale append was stored")
        finally:
            a.log.load_append_state = loaded
        rows = a.log.trajectory_events(["race"])["race"]
        assert [r["event_id"] for r in rows if r["type"] == "generation"] == ["race-0", "race-1"]
        assert a.trajectory_state("race").revision == b.trajectory_state("race").revision


def test_the_three_round_trip_append_on_a_partitioned_event_index(fresh_pg_url, tmp_path, capsys):
    """After ``trajstore partition`` (events partitioned by position, identities kept in
    ``event_identities`` by a trigger): a group continuing many trajectories still costs
    three round trips, lands in the new partitions, and counts its run aggregates."""
    from sqlalchemy import text

    from trajstore.cli import main

    tids = [f"p{i}" for i in range(16)]
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.append([started(t) for t in tids] + _calls(tids, 0))
        assert main(["--store", fresh_pg_url, "partition", "--rows", "40", "--ahead", "2"]) == 0
        capsys.readouterr()
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_calls(tids, 1))  # a traced connection, its statements prepared
            trips.reset()
            result = store.append(_calls(tids, 2))
            counts = trips.counts()
        finally:
            trips.close()
        with store.log.read_engine.connect() as conn:
            where = conn.execute(text(
                "SELECT DISTINCT tableoid::regclass::text FROM events WHERE position > :p"),
                {"p": result.last_position - len(tids)}).scalars().all()
            identities = conn.execute(text("SELECT count(*) FROM event_identities")).scalar_one()
            with_identity = conn.execute(text("SELECT count(*) FROM events WHERE identity IS NOT NULL")).scalar_one()
            counted = conn.execute(text("SELECT sum(calls) FROM agg_output_lengths")).scalar_one()
        assert store.trajectory_state("p3").revision > 0
    assert counts["commits"] == 1 and counts["round_trips"] <= 3, counts
    assert where and "events_legacy" not in where, where
    assert identities == with_identity
    assert counted == 3 * len(tids)
