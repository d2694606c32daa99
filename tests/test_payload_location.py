"""The store records where its payload lives; every process finds it there.

On both backends: a disagreeing location is refused in one line before
anything is read or written (the field failure: ``trajstore materialize``
started with the wrong ``--payload`` recorded every trajectory unfoldable and
moved its checkpoint past them); processes started from other directories,
``Writer(url)``, ``SampleReader(url)`` and ``workers/rollout.py`` find the
recorded location; a store without a record gets one; ``trajstore payload
move`` moves it; and a missing payload file quarantines a trajectory (never
consumes it) until ``--refold-quarantined`` folds it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import delete, select

import trajstore
from trajstore.cli import main
from trajstore.errors import PayloadLocationError, StoreUnavailable
from trajstore.schema import materializer_checkpoints, store_settings, unfoldable_trajectories
from tests.helpers import finished, gen, started

ROOT = Path(__file__).resolve().parents[1]


def trajectory(tid: str) -> list[dict]:
    return [started(tid), gen(tid, 0, [1, 2], [3, 4], version=1), gen(tid, 1, [1, 2, 3, 4, 5], [6], version=2),
            finished(tid)]


def fill(store, n: int, prefix: str = "t") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(n)]
    for tid in ids:
        store.append(trajectory(tid))  # one append each: one segment each
    return ids


def checkpoint(store) -> int | None:
    with store.log.read_engine.connect() as conn:
        return conn.execute(select(materializer_checkpoints.c.position)).scalar_one_or_none()


def unfoldable(store) -> list[tuple[str, str]]:
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(unfoldable_trajectories.c.trajectory_id,
                                                      unfoldable_trajectories.c.error)
                                               .order_by(unfoldable_trajectories.c.trajectory_id))]


def test_materialize_with_the_wrong_payload_is_refused_before_anything(store_url, tmp_path, capsys):
    """The field failure, replayed: 8 trajectories appended, then `trajstore materialize`
    with another --payload. Before: 8 of 8 recorded unfoldable and the checkpoint past
    them. Now: one line, exit 1, nothing read or written; the right run folds all 8."""
    payload = tmp_path / "payload"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 8)
    wrong = tmp_path / "elsewhere"
    assert main(["--store", store_url, "--payload", str(wrong), "materialize"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: payload location") and str(payload) in err
    assert "disagrees" in err
    assert not wrong.exists()  # nothing created there
    assert checkpoint(store) is None and unfoldable(store) == []  # nothing written to the index
    # and through the library: the same refusal
    with pytest.raises(PayloadLocationError, match="disagrees"):
        trajstore.connect(store_url, payload=str(wrong))
    # a matching location, spelled differently, is fine (--payload keeps working as documented)
    assert main(["--store", store_url, "--payload", f"file://{payload}/", "materialize"]) == 0
    capsys.readouterr()
    assert main(["--store", store_url, "materialize"]) == 0
    assert sorted(s.trajectory_id for s in store.samples()) == sorted(f"t{i}" for i in range(8))
    assert unfoldable(store) == []
    store.close()


def test_every_process_finds_the_recorded_location_from_any_directory(store_url, tmp_path, monkeypatch):
    """Created from one directory with a default (PostgreSQL: ./trajstore-payload/<db>,
    once relative to the current directory), used from another without any option."""
    monkeypatch.delenv("TRAJSTORE_PAYLOAD_DIR", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    store = trajstore.connect(store_url)  # the default location, recorded
    first = store.payload.location
    fill(store, 2, "a")
    store.close()
    monkeypatch.chdir(tmp_path / "b")
    # a Writer to the store URL (what workers/rollout.py uses)
    from trajstore.ingest.client import Writer

    with Writer(store_url) as w:
        w.extend(trajectory("b0"))
        w.flush()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRAJSTORE_PAYLOAD_DIR", None)
    subprocess.run([sys.executable, str(ROOT / "workers" / "rollout.py"), "--sink", store_url,
                    "--trajectories", "2", "--worker-id", "7", "--layers", "2", "--topk", "2",
                    "--prompt-tokens", "8", "--output-tokens", "4"], check=True, cwd=tmp_path / "b", env=env,
                   capture_output=True)
    assert main(["--store", store_url, "materialize"]) == 0
    s = trajstore.connect(store_url)
    assert s.payload.location == first and not (tmp_path / "b" / "trajstore-payload").exists()
    assert not list((tmp_path / "b").glob("*.payload"))
    reader = trajstore.SampleReader(store_url, rank=0, world_size=1, batch_size=1)
    ids = sorted(x.trajectory_id for batch in reader for x in batch)
    assert ids == sorted(["a0", "a1", "b0", "w7-t0", "w7-t1"])
    assert unfoldable(s) == []
    s.close()


def test_a_store_without_a_record_gets_one_or_says_how(store_url, tmp_path, capsys):
    """A store made before the record existed (its row deleted here): the first open
    records its location once the newest segment is found there; a location without
    it is refused with the command that fixes it."""
    payload = tmp_path / "payload"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 2)
    with store.log.write_engine.begin() as conn:
        conn.execute(delete(store_settings))
    store.close()
    with pytest.raises(PayloadLocationError, match="trajstore payload set"):
        trajstore.connect(store_url, payload=str(tmp_path / "wrong"))
    assert main(["--store", store_url, "payload", "show"]) == 1
    assert "no payload location recorded" in capsys.readouterr().out
    assert main(["--store", store_url, "payload", "set", str(tmp_path / "wrong")]) == 1
    assert "newest segment" in capsys.readouterr().err
    assert main(["--store", store_url, "payload", "set", str(payload)]) == 0
    capsys.readouterr()
    assert main(["--store", store_url, "payload", "show"]) == 0
    assert capsys.readouterr().out.strip() == str(payload)
    s = trajstore.connect(store_url)
    assert s.payload.location == str(payload) and s.materialize().num_trajectories == 2
    s.close()


def test_payload_move(store_url, tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    store = trajstore.connect(store_url, payload=str(old))
    fill(store, 3)
    store.materialize()
    fill(store, 1, "late")  # one unfolded trajectory: its log segment moves too
    store.close()
    assert main(["--store", store_url, "payload", "move", str(new), "--delete-old"]) == 0
    out = capsys.readouterr().out
    assert "moved the payload" in out
    assert not [p for p in old.iterdir() if p.stat().st_size]  # the old files are gone
    assert not (old / "trajstore-store.json").exists()  # and the old place is nobody's payload
    assert marker_of(new)["location"] in (str(new), "new")
    s = trajstore.connect(store_url)
    assert s.payload.location == str(new)
    assert s.materialize().num_trajectories == 1
    assert sorted(x.trajectory_id for x in s.samples()) == ["late0", "t0", "t1", "t2"]
    with pytest.raises(PayloadLocationError):
        trajstore.connect(store_url, payload=str(old))
    s.close()


def test_a_missing_payload_file_quarantines_never_consumes(store_url, tmp_path, capsys):
    payload = tmp_path / "payload"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 2, "ok")
    store.append(trajectory("lost"))
    fill(store, 1, "after")
    with store.log.read_engine.connect() as conn:
        from trajstore.schema import events
        (seg,) = set(conn.execute(select(events.c.segment).where(events.c.trajectory_id == "lost")
                                  .where(events.c.segment.is_not(None))).scalars())
    aside = tmp_path / "aside.arrow"
    shutil.move(store.payload.path(seg), aside)
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable) == (3, 1)
    assert unfoldable(store) == [("lost", "PayloadMissingError")]  # visible in SQL and in info
    assert main(["--store", store_url, "info"]) == 0
    info = json.loads(capsys.readouterr().out)["unfoldable_trajectories"]
    assert info["by_error"] == {"PayloadMissingError": 1}
    # still missing: a refold leaves it quarantined
    assert main(["--store", store_url, "materialize", "--refold-quarantined"]) == 0
    assert json.loads(capsys.readouterr().out)["num_trajectories"] == 0
    assert unfoldable(store) == [("lost", "PayloadMissingError")]
    # the file is back: the refold folds it, exactly once
    shutil.move(aside, store.payload.path(seg))
    assert main(["--store", store_url, "materialize", "--refold-quarantined"]) == 0
    assert json.loads(capsys.readouterr().out)["num_trajectories"] == 1
    assert unfoldable(store) == []
    got = sorted(s.trajectory_id for s in store.samples())
    assert got == ["after0", "lost", "ok0", "ok1"]
    lost = [s for s in store.samples() if s.trajectory_id == "lost"][0]
    assert list(lost.prompt_ids) + list(lost.response_ids) == [1, 2, 3, 4, 5, 6]
    assert main(["--store", store_url, "materialize", "--refold-quarantined"]) == 0
    assert json.loads(capsys.readouterr().out)["num_trajectories"] == 0
    assert store.materialize().num_trajectories == 0
    store.close()


def cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``trajstore ARGV`` as a user runs it: its own process, this tree first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "trajstore.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def test_materialize_exits_non_zero_naming_the_refold_when_it_quarantined(store_url, tmp_path):
    """One missing segment of an append that carried three trajectories: ``trajstore
    materialize`` folds the others, prints its metrics, and exits 1 with one line that
    counts the quarantined trajectories and names ``--refold-quarantined``."""
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    fill(store, 2, "ok")
    store.append([e for tid in ("lost0", "lost1", "lost2") for e in trajectory(tid)])  # one segment
    with store.log.read_engine.connect() as conn:
        from trajstore.schema import events
        (seg,) = set(conn.execute(select(events.c.segment).where(events.c.trajectory_id == "lost0")
                                  .where(events.c.segment.is_not(None))).scalars())
    aside, where = tmp_path / "aside.arrow", store.payload.path(seg)
    shutil.move(where, aside)
    store.close()
    done = cli("--store", store_url, "materialize", cwd=tmp_path)
    assert done.returncode == 1, done
    assert json.loads(done.stdout)["num_trajectories"] == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 trajectories quarantined: a payload file they need is missing")
    assert last.endswith("run: trajstore materialize --refold-quarantined")
    # nothing new is quarantined by the next run: success again
    again = cli("--store", store_url, "materialize", cwd=tmp_path)
    assert again.returncode == 0 and "quarantined" not in again.stderr, again
    # a refold while the file is still missing says so and leaves them quarantined
    refold = cli("--store", store_url, "materialize", "--refold-quarantined", cwd=tmp_path)
    assert refold.returncode == 0 and "3 trajectories still quarantined" in refold.stderr, refold
    shutil.move(aside, where)
    refold = cli("--store", store_url, "materialize", "--refold-quarantined", cwd=tmp_path)
    assert refold.returncode == 0 and "quarantined" not in refold.stderr, refold
    assert json.loads(refold.stdout)["num_trajectories"] == 3


def test_a_payload_location_holding_nothing_stops_the_materializer(store_url, tmp_path):
    """Every file gone (an unmounted disk, an emptied bucket): the location is wrong,
    not one file. Nothing is recorded, the checkpoint stays, the next run folds all."""
    payload = tmp_path / "payload"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 3)
    shutil.move(payload, tmp_path / "unmounted")
    payload.mkdir()
    with pytest.raises(StoreUnavailable, match="holds no file"):
        store.materialize()
    assert checkpoint(store) is None and unfoldable(store) == []
    shutil.rmtree(payload)
    shutil.move(tmp_path / "unmounted", payload)
    assert store.materialize().num_trajectories == 3
    store.close()


def test_refold_with_a_projection_is_refused_in_one_line(store_url, tmp_path, capsys):
    with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as store:
        store.create_projection("steps", merge="none")
    assert main(["--store", store_url, "materialize", "--refold-quarantined", "--projection", "steps"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--refold-quarantined folds the default samples; leave out --projection" in err


def marker_of(payload: Path) -> dict:
    return json.loads((payload / "trajstore-store.json").read_text())


def test_opening_a_store_never_creates_its_payload_root(store_url, tmp_path, monkeypatch):
    """A node without the shared mount: the recorded payload root is missing there
    (or is an empty directory, the bare mount point). Before, opening the store
    created the root and appends were acknowledged with their payload on the node's
    local disk, where no other process would look. Now the open is refused in one
    line naming the recorded location, and nothing is created."""
    monkeypatch.delenv("TRAJSTORE_PAYLOAD_DIR", raising=False)
    mount = tmp_path / "shared"
    payload = mount / "run1"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 2)
    store.close()
    marker = marker_of(payload)
    # the store's id, its recorded location (SQLite: relative to the database's directory), its index
    assert marker["location"] == (str(payload) if store_url.startswith("postgresql") else "shared/run1")
    assert len(marker["store_id"]) == 32 and marker["index"] == store_url
    (mount).rename(tmp_path / "unmounted")
    for opener in (lambda: trajstore.connect(store_url), lambda: trajstore.connect(store_url, migrate=False),
                   lambda: trajstore.connect(store_url, payload=str(payload))):
        with pytest.raises(PayloadLocationError) as err:
            opener()
        message = str(err.value)
        assert "\n" not in message and str(payload) in message and "does not exist" in message
        assert not payload.exists() and not mount.exists()
    assert main(["--store", store_url, "materialize"]) == 1  # the CLI says the same in one line
    # the bare mount point: an empty directory where the payload should be
    payload.mkdir(parents=True)
    with pytest.raises(PayloadLocationError, match="trajstore-store.json"):
        trajstore.connect(store_url)
    assert list(payload.iterdir()) == []
    shutil.rmtree(mount)
    (tmp_path / "unmounted").rename(mount)  # mounted again
    s = trajstore.connect(store_url)
    fill(s, 1, "back")
    assert s.materialize().num_trajectories == 3
    assert sorted(x.trajectory_id for x in s.samples()) == ["back0", "t0", "t1"]
    s.close()


def test_a_location_holding_another_stores_payload_is_refused(store_url, tmp_path):
    payload = tmp_path / "payload"
    first = trajstore.connect(f"sqlite:///{tmp_path}/first.db", payload=str(payload))
    fill(first, 1)
    first.close()
    with pytest.raises(PayloadLocationError, match="another store's payload"):
        trajstore.connect(store_url, payload=str(payload))  # GC of one would delete the other's files
    assert main(["--store", store_url, "payload", "show"]) == 1  # nothing recorded
    assert marker_of(payload)["index"].endswith("first.db")


def test_a_store_made_before_the_marker_gets_one(store_url, tmp_path, monkeypatch):
    """No marker and no store id (a store created before them): a process allowed to
    record marks the location when the newest segment is there; a read-only opener
    uses it without writing; with the payload missing it is refused."""
    monkeypatch.delenv("TRAJSTORE_PAYLOAD_DIR", raising=False)
    payload = tmp_path / "payload"
    store = trajstore.connect(store_url, payload=str(payload))
    fill(store, 2)
    with store.log.write_engine.begin() as conn:
        conn.execute(delete(store_settings).where(store_settings.c.name == "store_id"))
    store.close()
    (payload / "trajstore-store.json").unlink()
    reader = trajstore.connect(store_url, migrate=False)  # read-only: accepted, nothing written
    assert not (payload / "trajstore-store.json").exists()
    reader.close()
    s = trajstore.connect(store_url)
    ident = marker_of(payload)["store_id"]
    with s.log.read_engine.connect() as conn:
        assert conn.execute(select(store_settings.c.value).where(store_settings.c.name == "store_id")
                            ).scalar_one() == ident
    assert s.materialize().num_trajectories == 2
    s.close()
    # an old store whose payload is not where it was recorded: refused, nothing created
    (payload / "trajstore-store.json").unlink()
    payload.rename(tmp_path / "away")
    with pytest.raises(PayloadLocationError, match="does not exist"):
        trajstore.connect(store_url)
    assert not payload.exists()
    # `trajstore payload set` marks it (here after the files are back)
    (tmp_path / "away").rename(payload)
    assert main(["--store", store_url, "payload", "set", str(payload)]) == 0
    assert marker_of(payload)["store_id"] == ident
    trajstore.connect(store_url).close()


def test_a_new_store_with_no_configuration_is_marked(tmp_path, monkeypatch):
    """The embedded default (``<db>.payload`` beside the SQLite file) still needs nothing."""
    monkeypatch.chdir(tmp_path)
    store = trajstore.connect()
    fill(store, 1)
    store.close()
    payload = tmp_path / "trajstore-data" / "trajstore.db.payload"
    assert marker_of(payload)["location"] == "trajstore.db.payload"
    store = trajstore.connect()
    assert store.materialize().num_trajectories == 1
    store.close()
