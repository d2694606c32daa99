"""A materializer commit on PostgreSQL sends its rows as arrays (trajstore/log/_pg_arrays.py):
its statements do not grow with the rows it writes (an executemany sent one per row: a
32-trajectory step's commit was ~230), and the values stored are the ones given."""

from __future__ import annotations

from helpers import finished, gen, reward, routes, started
from pg_roundtrips import RoundTrips
from sqlalchemy import Column, Float, Integer, String, select, text

import trajstore
from trajstore.log._pg_arrays import columns_of
from trajstore.materializer import Materializer
from trajstore.schema import (agg_expert_load_delta, agg_rewards_delta, agg_tasks_delta, agg_trajectory_shapes_delta,
                              events, samples)


def _trajectories(prefix: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        t = f"{prefix}{i}"
        prompt, prev = [1, 2, 3], []
        out.append(started(t, group_id=f"g{i // 2}", num_experts=8))
        for turn in range(3):
            out_ids = [10 + turn] * 4
            out.append(gen(t, turn, prompt, out_ids, version=turn % 2, logprobs=[-0.5] * 4,
                           routed_experts=routes(len(prompt) + 4 - 1, 2, 2)))
            prev = prompt + out_ids
            prompt = prev + [7, 8]
        out.append(reward(t, 1 if i % 2 else 0.25))  # an int reward among floats
        out.append(finished(t))
    return out


def _commit_statements(store, trips: RoundTrips, m: Materializer) -> int:
    trips.reset()
    stats = m.run(max_steps=1, compact=False)
    assert stats.num_trajectories > 0
    return trips.counts()["statements"]


def test_a_commit_sends_as_many_statements_for_4_trajectories_as_for_24(fresh_pg_url, tmp_path):
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        m = Materializer(store, max_trajectories=64)
        store.append(_trajectories("w", 2))
        m.run(compact=False)  # statements prepared, the checkpoint row there
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_trajectories("a", 4))
            few = _commit_statements(store, trips, m)
            store.append(_trajectories("b", 24))
            many = _commit_statements(store, trips, m)
        finally:
            trips.close()
        with store.log.db.reading("test") as conn:
            moved = conn.execute(select(events.c.segment_kind).where(events.c.type == "generation")).scalars().all()
            rows = conn.execute(select(samples.c.trajectory_id)).scalars().all()
    assert len(rows) == 30 and set(moved) == {"samples"}  # every call re-pointed at its sample row
    # one statement per kind of row (the re-pointing, the samples, the counts...), not one per row
    assert many - few <= 2, (few, many)  # one statement per row made it 66 and 177
    assert many < 72, many  # fewer than the 72 events re-pointed alone


def test_counts_given_as_ints_and_floats_are_stored_as_given(fresh_pg_url, tmp_path):
    rewards = [(1, 10, 1, 1, 1, 1), (1, 11, 2, 0.75, 0.25, 0.5), (60, 0, 3, 2, -1, 1.5)]
    shapes = [(1, 1, 0, 1, 0), (2, 1, 1, 1, 0)]
    r, sh = agg_rewards_delta.c, agg_trajectory_shapes_delta.c
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.log.db.transaction("inserting counts", lambda conn, d: d.insert_tuples(conn, [
            (agg_rewards_delta, ("width_s", "bucket_start", "rewarded", "reward_sum", "reward_min", "reward_max"),
             rewards),
            (agg_trajectory_shapes_delta, ("num_generations", "num_samples", "num_prefix_mismatches", "trajectories",
                                           "placeholder_logprobs"), shapes)]))
        with store.log.db.reading("test") as conn:
            got = conn.execute(select(r.width_s, r.bucket_start, r.rewarded, r.reward_sum, r.reward_min, r.reward_max)
                               .order_by(r.width_s, r.bucket_start)).all()
            got_shapes = conn.execute(select(sh.num_generations, sh.trajectories).order_by(sh.num_generations)).all()
    assert [tuple(x) for x in got] == [(1, 10, 1, 1.0, 1.0, 1.0), (1, 11, 2, 0.75, 0.25, 0.5),
                                       (60, 0, 3, 2.0, -1.0, 1.5)]
    assert [tuple(x) for x in got_shapes] == [(1, 1), (2, 1)]


def test_a_column_of_mixed_python_types():
    f, i, s = Column("f", Float), Column("i", Integer), Column("s", String)
    assert columns_of([(1, 1, "a"), (2.5, 2, None), (None, None, "b")], [f, i, s]) == [
        [1.0, 2.5, None], [1, 2, None], ["a", None, "b"]]
    assert columns_of([(None,), (None,)], [i]) == [[None, None]]
    assert columns_of([(1,), (True,)], [i]) is None  # psycopg would refuse the array: rows one by one
    assert columns_of([("a",), (1,)], [s]) is None
    assert columns_of([(1.5,), (True,)], [f]) is None


def _compactions(store, max_trajectories: int):
    """Deltas of 4, then of 24 more trajectories, folded and committed (``max_trajectories`` a
    commit) after a first compaction (statements prepared, the totals' first rows there): for
    each, a function that compacts them and returns what it folded and the ``RoundTrips`` counts
    of the compaction alone."""
    from trajstore._upkeep.gc import compact_run_aggregates

    m = Materializer(store, max_trajectories=max_trajectories)
    store.append(_trajectories("w", 2))
    m.run(compact=False)
    compact_run_aggregates(store)
    trips = RoundTrips(store.log.db.write_engine)

    def compact() -> tuple[int, dict[str, int]]:
        trips.reset()
        folded = compact_run_aggregates(store)
        return folded, trips.counts()

    try:
        for prefix, n in (("a", 4), ("b", 24)):
            store.append(_trajectories(prefix, n))
            m.run(compact=False)
            yield compact
    finally:
        trips.close()


def test_a_compaction_sends_as_many_statements_for_4_trajectories_as_for_24(fresh_pg_url, tmp_path):
    """Its upserts into the totals go one statement of arrays per table (``add_counts``), not one per key."""
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        counted = [compact()[1]["statements"] for compact in _compactions(store, 64)]
        with store.log.db.reading("test") as conn:
            groups = conn.execute(text("SELECT count(*) FROM agg_groups")).scalar_one()
    assert groups == 12  # g0..g11: every group's total row
    # which tables have rows to fold moves the count by a statement or two; one statement per
    # key (group, bucket) made it 65 and 88
    assert counted[1] - counted[0] <= 3, counted


def _bind(text: str) -> tuple[str, list[int], list[str | None]]:
    """A traced Bind message (libpq's regress-mode trace): the statement's name, the format
    codes, the parameter values (each a byte length then the value quoted, a non-printable
    byte as ``\\xNN``; -1 for NULL)."""
    import re

    pos = 0

    def word() -> str:
        nonlocal pos
        while text[pos] == " ":
            pos += 1
        end = text.find(" ", pos)
        end = len(text) if end < 0 else end
        out, pos = text[pos:end], end
        return out

    word()  # the portal ("")
    statement = word().strip('"')
    codes = [int(word()) for _ in range(int(word()))]
    values: list[str | None] = []
    for _ in range(int(word())):
        length = int(word())
        if length < 0:
            values.append(None)
            continue
        pos += 2  # the space and the opening quote
        # a byte is one character or an escape ``\\xNN``, but a backslash of the value is not
        # escaped (``\\x00`` may be 4 bytes): the ends after ``length`` bytes, either way
        ends = {pos}
        for _ in range(length):
            ends = {e + 1 for e in ends} | {e + 4 for e in ends if re.match(r"\\x[0-9a-f]{2}", text[e:e + 4])}
        end = min(e for e in ends if text[e:e + 1] == "'" and text[e + 1:e + 2] in ("", " "))
        values.append(text[pos:end])
        pos = end + 1  # past the closing quote
    return statement, codes, values


def _array_formats(trace_dir: str) -> list[tuple[str, list[int]]]:
    """The statement and format codes (0 text, 1 binary) of the array parameters (``CAST($n AS
    ...[])``) of every Bind of an ``unnest`` statement in libpq's traces; an array of NULLs only
    left out (psycopg sends one as text, whatever the format asked: it has no element type)."""
    import ctypes
    import os
    import re

    ctypes.CDLL(None).fflush(None)
    out = []
    for name in sorted(os.listdir(trace_dir)):
        texts: dict[str, str] = {}
        with open(os.path.join(trace_dir, name), encoding="latin-1") as f:  # a character a byte
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 4 or parts[0] != "F":
                    continue
                if parts[2] == "Parse":
                    m = re.match(r' "([^"]*)" "(.*)" \d+', parts[3])
                    if m:
                        texts[m.group(1)] = m.group(2)
                elif parts[2] == "Bind":
                    statement, codes, values = _bind(parts[3])
                    sql = texts.get(statement, "")
                    if "unnest(" not in sql:
                        continue
                    arrays = [int(n) for n in re.findall(r"CAST\(\$(\d+) AS [^)]*\[\]\)", sql)]
                    out.append((sql[:200], [codes[0] if len(codes) == 1 else (codes[n - 1] if codes else 0)
                                            for n in arrays
                                            if not re.fullmatch(r"\{NULL(,NULL)*\}", values[n - 1] or "")]))
    return out


def test_a_commit_sends_its_arrays_in_binary_and_stores_the_values_given(fresh_pg_url, tmp_path):
    """Arrays as text made the server parse every element (``array_in``: most of a commit's
    statement CPU after the index upkeep); in binary it copies them. Odd values (quotes,
    braces, backslashes, the word NULL, zero bytes, the extremes of int64) arrive unchanged."""
    odd = ['a"b', "{c,d}", "back\\slash", "", "NULL", "é ü"]
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        m = Materializer(store, max_trajectories=64)
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_trajectories("a", 6))
            m.run(max_steps=1, compact=False)
            store.log.db.transaction("inserting odd values", lambda conn, d: d.insert_tuples(conn, [
                (agg_rewards_delta, ("width_s", "bucket_start", "rewarded", "reward_sum", "reward_min", "reward_max"),
                 [(1, -2**63, 2**63 - 1, 0.5, -1e300, 1e300), (60, 2**62, 0, 1.0, 0.0, float(1 << 53))]),
                (agg_tasks_delta, ("task", "trajectories", "rewarded", "reward_sum", "generated_tokens", "calls",
                                   "failed"), [(s, i, 0, 0.0, 0, 0, 0) for i, s in enumerate(odd)])]))
            store.log.db.transaction("inserting bytes", lambda conn, d: d.insert_rows(conn, agg_expert_load_delta, [
                {"model_version": v, "layers": 2, "experts": 3, "counts": bytes([0, 1, 0, 255]) * (v + 1)}
                for v in range(3)]))
            formats = _array_formats(trips.dir)
        finally:
            trips.close()
        with store.log.db.reading("test") as conn:
            moved = conn.execute(select(events.c.segment_kind).where(events.c.type == "generation")).scalars().all()
            rewards = conn.execute(text("SELECT bucket_start, rewarded, reward_min, reward_max FROM agg_rewards_delta "
                                        "WHERE width_s IN (1, 60) AND bucket_start IN (-9223372036854775808, "
                                        "4611686018427387904) ORDER BY bucket_start")).all()
            tasks = conn.execute(text("SELECT task FROM agg_tasks_delta WHERE trajectories < 6 ORDER BY trajectories")
                                 ).scalars().all()
            loads = conn.execute(text("SELECT counts FROM agg_expert_load_delta WHERE layers = 2 AND experts = 3 "
                                      "ORDER BY model_version")).scalars().all()
    assert set(moved) == {"samples"} and len(moved) == 18
    assert [tuple(r) for r in rewards] == [(-2**63, 2**63 - 1, -1e300, 1e300), (2**62, 0, 0.0, float(1 << 53))]
    assert tasks == odd
    assert [bytes(x) for x in loads] == [bytes([0, 1, 0, 255]) * (v + 1) for v in range(3)]
    # the re-pointing, the samples, the counts, the odd values: every array went in binary
    assert len(formats) >= 4 and all(f and set(f) == {1} for _, f in formats), [x for x in formats if set(x[1]) != {1}]


def test_a_compaction_folds_the_deltas_on_the_server_and_changes_no_sum(fresh_pg_url, tmp_path):
    """Each table's deltas are taken, summed per key and added to the totals in one statement:
    the client receives fewer rows than the compaction folds (taking them with ``DELETE ...
    RETURNING`` sent every delta row to the client and back as arrays), and every key's sum,
    min and max reads the same after it (``agg_group_variance`` is what the compaction settles,
    not a sum of deltas)."""
    from trajstore._upkeep.gc import compact_run_aggregates
    from trajstore.log._aggregate_counts import totals_sql
    from trajstore.log._aggregates import TABLES

    def read(store) -> dict:
        with store.log.db.reading("test") as conn:
            return {name: [tuple(r) for r in conn.execute(text(totals_sql(name))).all()]
                    for name in sorted(TABLES) if name != "agg_group_variance"}

    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        for compact in _compactions(store, 8):  # several commits: several delta rows of a key
            before = read(store)
            folded, got = compact()
            assert folded > 0 and got["rows"] < folded, (folded, got)
            assert read(store) == before
            assert compact_run_aggregates(store) == 0
