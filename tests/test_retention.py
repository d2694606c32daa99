"""``trajstore archive`` / ``trajstore restore`` (docs/deploy.md, "Index growth") on SQLite and PostgreSQL:
folded trajectories' events leave the index for a Parquet archive, samples and trajectory rows stay,
the archive folds back to the same samples, a lagging projection is named, and a kill -9 between
writing the archive and dropping the rows loses nothing."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

import trajstore
from trajstore.cli import main
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.schema import events as events_table, segments as segments_table, trajectories as traj_table
from tests.helpers import kill_at_pause

CFG = RolloutConfig(turns=3, prompt_tokens=60, output_tokens=40, observation_tokens=12, layers=4, topk=2,
                    num_experts=64, mismatch_prob=0.25, abort_prob=0.1, fail_prob=0.05, seed=21)
N = 12

# The tests whose first step connects store_url (a store's first connect migrates it): theirs is a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = (
    "test_archive_drops_folded_events_keeps_samples_and_refolds_the_same",
    "test_a_lagging_projection_is_named_and_keeps_its_events",
    "test_before_position_bounds_what_leaves",
    "test_kill_9_between_the_archive_file_and_the_drop_loses_nothing",
    "test_two_archive_runs_racing_archive_each_trajectory_once",
    "test_labelled_weight_versions_refold_from_the_archive",
    "test_downgrade_below_0016_is_refused_while_trajectories_are_archived",
    "test_a_shard_without_a_checkpoint_yet_keeps_its_trajectories",
)


def _append(store, ids, *, finish: bool = True) -> None:
    for i in ids:
        evs = trajectory_events(CFG, i)
        if not finish:
            evs = evs[:-1]
        for k in range(0, len(evs), 2):  # several log segments per trajectory
            store.append(evs[k : k + 2])


def _tid(i: int) -> str:
    return trajectory_events(CFG, i)[0]["trajectory_id"]


def _index(store) -> dict:
    with store.log.read_engine.connect() as conn:
        ev = dict(conn.execute(select(events_table.c.trajectory_id, func.count())
                               .group_by(events_table.c.trajectory_id)).all())
        archived = set(conn.execute(select(traj_table.c.trajectory_id)
                                    .where(traj_table.c.archived_at.is_not(None))).scalars())
        n_traj = conn.execute(select(func.count()).select_from(traj_table)).scalar_one()
        live_logs = set(conn.execute(select(segments_table.c.name).where(
            segments_table.c.kind == "events", segments_table.c.retired_at.is_(None))).scalars())
    return {"events": ev, "archived": archived, "trajectories": n_traj, "live_log_segments": live_logs}


def _samples(store) -> list:
    return list(store.samples())


def _same_samples(a: list, b: list) -> None:
    assert [(s.trajectory_id, s.sample_index) for s in a] == [(s.trajectory_id, s.sample_index) for s in b]
    assert all(x.equals(y) for x, y in zip(a, b)), "samples differ"


def _refold(archive_dir, tmp_path, name: str = "refold") -> list:
    url = f"sqlite:///{tmp_path / name}.db"
    assert main(["--store", url, "restore", str(archive_dir)]) == 0
    again = trajstore.connect(url)
    again.materialize()
    out = _samples(again)
    again.close()
    return out


def test_archive_drops_folded_events_keeps_samples_and_refolds_the_same(store_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(N))
    _append(store, [N, N + 1], finish=False)  # running: never archived
    store.materialize()
    _append(store, [N + 2])  # finished, not folded yet: stays
    before = _samples(store)
    folded = {s.trajectory_id for s in before}
    idx0 = _index(store)

    with store.log.read_engine.connect() as conn:
        assert folded <= {r[0] for r in conn.exec_driver_sql("SELECT trajectory_id FROM agg_trajectory_stats").all()}
    out = tmp_path / "archive"
    # a dry run counts and changes nothing
    assert main(["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0",
                 "--dry-run"]) == 0
    assert f"would archive {N} trajectories" in capsys.readouterr().out
    assert _index(store) == idx0 and not out.exists()
    # too recent for the default --older-than-s: nothing
    assert main(["--store", store_url, "--payload", payload, "archive", str(out)]) == 0
    assert "archived 0 trajectories" in capsys.readouterr().out
    assert _index(store)["archived"] == set()

    assert main(["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0",
                 "--batch-trajectories", "5"]) == 0
    cap = capsys.readouterr()
    assert f"archived {N} trajectories" in cap.out and cap.err.count("archived 5 trajectories") == 2
    idx = _index(store)
    assert idx["archived"] == folded and len(folded) == N
    assert set(idx["events"]) == {_tid(N), _tid(N + 1), _tid(N + 2)}  # only unarchived trajectories keep rows
    assert idx["trajectories"] == idx0["trajectories"]  # trajectory rows stay, marked
    with store.log.read_engine.connect() as conn:  # the run view's per-trajectory rows are trimmed with them
        stats = {r[0] for r in conn.exec_driver_sql("SELECT trajectory_id FROM agg_trajectory_stats").all()}
    assert not stats & folded
    files = sorted(out.glob("part-*.parquet"))
    assert len(files) == 3 and not list(out.glob("*.tmp*"))
    assert sum(pq.read_metadata(f).num_rows for f in files) == sum(idx0["events"][t] for t in folded)
    # the samples still read (they live in sample segments), from a fresh process' view too
    _same_samples(_samples(store), before)
    batch = next(iter(trajstore.SampleReader(store_url, payload=payload, batch_size=len(before))))
    assert sorted((s.trajectory_id, s.sample_index) for s in batch) == sorted(
        (s.trajectory_id, s.sample_index) for s in before)
    assert all(len(s.response_ids) for s in batch)
    # log segments whose events are all archived are retired, and gc frees them
    store.collect_garbage(grace_s=0)
    on_disk = {n for n, _ in store.payload.list_names()}
    assert on_disk == store.log.referenced_segments()
    # re-running archives nothing more
    assert main(["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0"]) == 0
    assert "archived 0 trajectories" in capsys.readouterr().out
    # the archive folds back to the same samples
    _same_samples(_refold(out, tmp_path), before)
    # new events keep flowing in the archived store
    store.materialize()
    _append(store, [N + 3])
    store.materialize()
    assert len(_samples(store)) > len(before)
    store.close()


def test_a_lagging_projection_is_named_and_keeps_its_events(store_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(6))
    store.create_projection("stepwise", merge="none")
    store.materialize()  # the default fold only
    idx0 = _index(store)
    out = tmp_path / "archive"
    args = ["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'stepwise'" in err and "materialize --projection" in err
    assert _index(store) == idx0 and not list(out.glob("part-*"))
    # --skip-lagging archives what every projection folded (nothing) and names the projection
    assert main(args + ["--skip-lagging"]) == 0
    o = capsys.readouterr().out
    assert "projection 'stepwise'" in o and "archived 0 trajectories" in o
    assert _index(store) == idx0
    store.materialize(projection="stepwise")
    proj = list(store.samples(projection="stepwise"))
    assert main(args) == 0
    assert "archived 6 trajectories" in capsys.readouterr().out
    assert len(_index(store)["archived"]) == 6
    assert [s.trajectory_id for s in store.samples(projection="stepwise")] == [s.trajectory_id for s in proj]
    store.close()


def test_before_position_bounds_what_leaves(store_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(3))
    cut = store.log.head_position() + 1
    _append(store, range(3, 6))
    store.materialize()
    assert main(["--store", store_url, "--payload", payload, "archive", str(tmp_path / "a"), "--older-than-s", "0",
                 "--before-position", str(cut)]) == 0
    assert _index(store)["archived"] == {_tid(i) for i in range(3)}
    store.close()


def _kill_at(url: str, payload: str, out_dir: str, where: str, marker: str) -> None:
    kill_at_pause("tests.log.archive_procs", url, payload, out_dir, where, marker, marker=marker, what="archive",
                  point=where)


@pytest.mark.parametrize("where", ["after_file", "in_transaction"])
def test_kill_9_between_the_archive_file_and_the_drop_loses_nothing(store_url, tmp_path, where, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(N))
    store.materialize()
    before = _samples(store)
    idx0 = _index(store)
    out = tmp_path / "archive"
    _kill_at(store_url, payload, str(out), where, str(tmp_path / "paused"))
    # the file is whole and durable, and every index row is still there
    files = sorted(out.glob("part-*.parquet"))
    assert len(files) == 1 and not list(out.glob("*.tmp*"))
    assert pq.read_metadata(files[0]).num_rows == sum(idx0["events"].values())
    assert _index(store) == idx0
    store.collect_garbage(grace_s=0)
    _same_samples(_samples(store), before)
    # the archive written so far already folds back
    _same_samples(_refold(out, tmp_path, "partial"), before)
    # re-running completes it: the same batch, the same file
    assert main(["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0"]) == 0
    assert f"archived {N} trajectories" in capsys.readouterr().out
    assert [f.name for f in sorted(out.glob("part-*.parquet"))] == [f.name for f in files]
    assert _index(store)["events"] == {} and len(_index(store)["archived"]) == N
    _same_samples(_samples(store), before)
    _same_samples(_refold(out, tmp_path), before)
    store.close()


def test_two_archive_runs_racing_archive_each_trajectory_once(store_url, tmp_path, monkeypatch):
    """A second run archives the same batch between the first run's file and its drop: the first
    run's transaction stores nothing (its rows were archived), it picks again and finds nothing."""
    from trajstore._upkeep import retention as _retention
    from trajstore.log._retention import SqlRetention

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(6))
    store.materialize()
    before = _samples(store)
    drop = SqlRetention.drop_archived
    raced = {"n": 0}

    def racing_drop(self, *a, **kw):
        if raced["n"] == 0:
            raced["n"] += 1
            other = trajstore.connect(store_url, payload=payload)
            assert _retention.archive_events(other, str(tmp_path / "b"), older_than_s=0)["trajectories"] == 6
            other.close()
        return drop(self, *a, **kw)

    monkeypatch.setattr(SqlRetention, "drop_archived", racing_drop)
    done = _retention.archive_events(store, str(tmp_path / "a"), older_than_s=0)
    assert raced["n"] == 1 and done["trajectories"] == 0 and done["files"] == []
    idx = _index(store)
    assert idx["events"] == {} and len(idx["archived"]) == 6
    # both directories hold the same events; either folds back to the same samples
    _same_samples(_refold(tmp_path / "a", tmp_path, "ra"), before)
    _same_samples(_refold(tmp_path / "b", tmp_path, "rb"), before)
    store.close()


def test_labelled_weight_versions_refold_from_the_archive(store_url, tmp_path):
    """Calls whose weight_versions name labels (one mapped before, one after the call): the archive
    carries the label map's entries, so a new store resolves them and folds the same samples."""
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    store.append([{"type": "version_label", "label": "w-a", "model_version": 4}])
    store.append([
        {"type": "trajectory_started", "trajectory_id": "L"},
        {"type": "generation", "trajectory_id": "L", "seq": 0, "prompt_ids": [1, 2], "output_ids": [3, 4, 5],
         "logprobs": [-0.1, -0.2, -0.3],
         "weight_versions": [{"version": "w-a", "start": 0, "end": 2}, {"version": "w-b", "start": 2, "end": 3}]},
        {"type": "trajectory_finished", "trajectory_id": "L", "status": "completed"},
    ])
    store.append([{"type": "version_label", "label": "w-b", "model_version": 5}])  # releases L
    store.materialize()
    before = _samples(store)
    assert len(before) == 1 and before[0].max_model_version == 5
    from trajstore._upkeep.retention import archive_events

    done = archive_events(store, str(tmp_path / "a"), older_than_s=0)
    # the label rows come first in the file
    rows = pq.read_table(next((tmp_path / "a").glob("part-*.parquet"))).to_pylist()
    assert [r["type"] for r in rows[:2]] == ["version_label", "version_label"]
    assert done["trajectories"] == 1
    _same_samples(_refold(tmp_path / "a", tmp_path), before)
    store.close()


def test_downgrade_below_0016_is_refused_while_trajectories_are_archived(store_url, tmp_path):
    from alembic import command
    from sqlalchemy import create_engine

    from trajstore.log._migrate import alembic_config
    from trajstore._upkeep.retention import archive_events

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(2))
    store.materialize()
    assert archive_events(store, str(tmp_path / "a"), older_than_s=0)["trajectories"] == 2
    store.close()
    engine = create_engine(store_url)
    with pytest.raises(Exception, match="trajectories have their events archived"):
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0015")
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).where(traj_table.c.archived_at.is_not(None))).scalar_one() == 2
    engine.dispose()


def test_a_shard_without_a_checkpoint_yet_keeps_its_trajectories(store_url, tmp_path, capsys):
    """Two materializer shards, one of which has not committed anything yet: its
    trajectories are not folded, so archive keeps every trajectory (the missing
    shard counts as position 0, as the readers' watermark counts it); once it has
    folded, archive takes them all and every one has its samples. Same for a
    projection folded by one shard of two."""
    from trajstore._upkeep.retention import LaggingProjections
    from trajstore.log._retention import SqlRetention

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(N))
    store.materialize(shard_index=0, num_shards=2)  # shard 1/2 has no checkpoint row
    assert 0 < len({s.trajectory_id for s in _samples(store)}) < N
    out = tmp_path / "archive"
    args = ["--store", store_url, "--payload", payload, "archive", str(out), "--older-than-s", "0"]
    assert main(args) == 0
    assert "archived 0 trajectories" in capsys.readouterr().out
    assert _index(store)["archived"] == set()
    store.materialize(shard_index=1, num_shards=2)
    store.create_projection("p", merge="none")
    store.materialize(projection="p", shard_index=1, num_shards=2)  # its shard 0/2 has not started
    assert SqlRetention(store.log.db).horizons()[1] == {"p": 0}
    with pytest.raises(LaggingProjections, match="'p' \\(checkpoint 0\\)"):
        main([*args, "--debug"])
    store.materialize(projection="p", shard_index=0, num_shards=2)
    assert main(args) == 0
    assert f"archived {N} trajectories" in capsys.readouterr().out
    assert _index(store)["archived"] == {_tid(i) for i in range(N)} == {s.trajectory_id for s in _samples(store)}
    store.close()


def test_an_unreadable_archive_file_is_a_one_line_error_naming_it(tmp_path):
    # A part file that is not Parquet (a truncated copy, a stray file) stops the
    # restore with a trajstore error naming the file, never pyarrow's exception.
    from trajstore._upkeep.retention import restore_archive
    from trajstore.errors import CorruptStoreError

    archive = tmp_path / "archive"
    archive.mkdir()
    bad = archive / "part-0.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    store = trajstore.connect(f"sqlite:///{tmp_path / 'to.db'}")
    with pytest.raises(CorruptStoreError) as e:
        restore_archive(store, str(archive))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    store.close()


def test_an_archive_into_a_full_disk_is_a_one_line_error_and_drops_nothing(tmp_path, monkeypatch):
    # The archive's file is written before any index row is dropped: a write that
    # fails (here a real ENOSPC: the archive's temporary file written through a link
    # to /dev/full; pyarrow removes a file it failed to write, so never the device
    # itself) is a trajstore error naming the file, and every event stays in the index.
    import os

    from trajstore.errors import StoreUnavailable

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    url = f"sqlite:///{tmp_path / 'full.db'}"
    store = trajstore.connect(url)
    _append(store, range(3))
    store.materialize()
    before = _index(store)
    out = tmp_path / "archive"
    out.mkdir()
    import trajstore._upkeep.retention as retention

    real = retention.replace_durably

    full = tmp_path / "full"
    os.symlink("/dev/full", full)

    def onto_a_full_disk(path, directory, write):
        return real(path, directory, lambda tmp: write(str(full)))

    monkeypatch.setattr(retention, "replace_durably", onto_a_full_disk)
    with pytest.raises(StoreUnavailable) as e:
        retention.archive_events(store, str(out), older_than_s=None)
    assert "disk full" in str(e.value) and "\n" not in str(e.value)
    assert _index(store) == before
    store.close()


def _agg_rows(store) -> dict[str, list[tuple]]:
    from trajstore.log._retention import BUCKETED

    with store.log.read_engine.connect() as conn:
        out = {t.name: sorted(tuple(r) for r in conn.execute(select(t.c.width_s, t.c.bucket_start)))
               for t in BUCKETED}
        out["agg_groups"] = sorted(conn.exec_driver_sql("SELECT group_id FROM agg_groups").all())
    return out


def _aggregate_panels(store) -> dict[str, object]:
    """The page's panels drawn from the run aggregates alone (their SQL reads no other table)."""
    import re

    from tests.helpers import reader_url_for
    from trajstore.inspect._panels import collect
    from trajstore.inspect.sql import read_only

    with read_only(reader_url_for(store.url)) as query:
        data = collect(query)
    out = {}
    for p in data["panels"]:
        named = {m.lower() for q in p["sql"] for m in re.findall(r"\b(?:FROM|JOIN)\s+([A-Za-z_]+)", q, re.I)}
        if named and all(n.startswith("agg_") and n != "agg_trajectory_stats" for n in named):
            out[p["name"]] = p["figure"] if p["figure"] is not None else p["note"]
    return out


def test_archive_trims_the_aggregate_rows_of_retired_data_and_the_page_is_unchanged(store_url, tmp_path,
                                                                                  monkeypatch):
    import types

    from trajstore._append import facts
    from trajstore._upkeep.gc import compact_run_aggregates
    from trajstore.log._retention import FINE_BUCKETS_KEPT_S

    clock = [1_700_000_000.0]  # a run in the past: archive takes trajectories last updated before now
    monkeypatch.setattr(facts, "time", types.SimpleNamespace(time=lambda: clock[0]))
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    cfg = RolloutConfig(turns=2, prompt_tokens=20, output_tokens=12, observation_tokens=4, layers=2, topk=2,
                        num_experts=8, seed=5, group_size=2, abort_prob=0.0, fail_prob=0.0)
    for i in range(16):  # two hours of run, a trajectory every 8 minutes, groups of two
        store.append(trajectory_events(cfg, i))
        clock[0] += 480.0
    store.materialize()
    compact_run_aggregates(store)
    before_rows, before_page = _agg_rows(store), _aggregate_panels(store)
    assert len(before_page) >= 4 and before_rows["agg_groups"] == [(f"group-5-{k:05d}",) for k in range(8)]
    old = {t: [(w, b) for w, b in rows if w == 1 and b < max(b for w, b in rows if w == 1) - FINE_BUCKETS_KEPT_S]
           for t, rows in before_rows.items() if t != "agg_groups"}  # behind each table's newest second
    assert all(old.values())  # every bucketed table has 1-second rows older than the kept hour
    # archive the first 10 trajectories (groups 0 to 4); groups 5 to 7 stay
    with store.log.read_engine.connect() as conn:
        cut = conn.exec_driver_sql("SELECT finished_position FROM trajectories ORDER BY finished_position "
                                   "LIMIT 1 OFFSET 10").scalar_one()
    assert main(["--store", store_url, "--payload", str(tmp_path / "payload"), "archive", str(tmp_path / "archive"),
                 "--older-than-s", "0", "--before-position", str(cut)]) == 0
    after_rows, after_page = _agg_rows(store), _aggregate_panels(store)
    assert after_rows["agg_groups"] == [(f"group-5-{k:05d}",) for k in range(5, 8)]  # the retired groups' rows are gone
    for t, rows in after_rows.items():
        if t == "agg_groups":
            continue
        gone = set(before_rows[t]) - set(rows)
        first = min(b for w, b in before_rows[t] if w == 1)
        assert gone == {k for k in old[t] if not (t == "agg_trajectories" and k[1] == first)}, t
        assert gone and set(rows) <= set(before_rows[t]), t  # only 1-second rows of the retired hour left
    assert after_page == before_page  # every figure the aggregates draw: unchanged
    store.close()
