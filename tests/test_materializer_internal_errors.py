"""An exception in the fold that is no data rule is a bug, not the trajectory's
fault: recorded and counted apart (``kind = 'internal_error'``), logged with its
traceback, and folded exactly once by the next run (or ``--refold-quarantined``)
once the code is fixed; on SQLite and PostgreSQL. The fault is injected in the
fold in-process, then removed (the "fix")."""

from __future__ import annotations

import json
import logging

import pytest
from sqlalchemy import text

import trajstore.materializer as materializer_module
from trajstore.cli import main
from trajstore.errors import ValidationError
from trajstore.materializer import Materializer
from tests.helpers import finished, gen, started

real_fold = materializer_module.fold


def good(store, tid: str) -> None:
    store.append([started(tid), gen(tid, 0, [1, 2], [3, 4], version=1), gen(tid, 1, [1, 2, 3, 4, 5], [6], version=2),
                  finished(tid)])


def broken(tids: set[str], error: BaseException):
    """The fold, failing on ``tids`` (a bug: an exception the fold never raises on purpose)."""
    def fold(gens, *, trajectory_id, **kw):
        if trajectory_id in tids:
            raise error
        return real_fold(gens, trajectory_id=trajectory_id, **kw)
    return fold


def rows(store) -> list[tuple]:
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT trajectory_id, kind, error, rule FROM unfoldable_trajectories ORDER BY finished_position"))]


def sample_ids(store) -> list[str]:
    return [s.trajectory_id for s in store.samples()]


@pytest.mark.parametrize("how", ["materialize", "refold_quarantined"])
def test_an_internal_error_is_recorded_apart_and_folds_once_the_bug_is_fixed(store, monkeypatch, caplog, how):
    good(store, "a")
    good(store, "bug")
    good(store, "c")
    monkeypatch.setattr(materializer_module, "fold", broken({"bug"}, TypeError("int() argument must be ... 'NoneType'")))
    with caplog.at_level(logging.ERROR, logger="trajstore.materializer"):
        stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable, stats.num_internal_errors) == (2, 0, 1)
    assert stats.to_dict()["num_internal_errors"] == 1
    assert sample_ids(store) == ["a", "c"]  # the others are unaffected
    assert rows(store) == [("bug", "internal_error", "TypeError", None)]
    (record,) = [r for r in caplog.records if "bug" in r.getMessage()]
    assert "internal error" in record.getMessage() and record.exc_info is not None  # the traceback
    # apart from data quarantine
    assert store.materialized.unfoldable_trajectories()["count"] == 0
    internal = store.materialized.unfoldable_trajectories(kind="internal_error")
    assert internal["count"] == 1 and internal["by_error"] == {"TypeError": 1}

    # while the bug is there, runs retry it and keep it recorded, once
    again = store.materialize()
    assert (again.num_trajectories, again.num_internal_errors) == (0, 1)
    assert rows(store) == [("bug", "internal_error", "TypeError", None)]

    monkeypatch.setattr(materializer_module, "fold", real_fold)  # the fix
    good(store, "later")
    if how == "materialize":
        fixed = store.materialize()
        assert (fixed.num_trajectories, fixed.num_internal_errors, fixed.num_unfoldable) == (2, 0, 0)
    else:
        fixed = Materializer(store).refold_quarantined()
        assert (fixed.num_trajectories, fixed.num_internal_errors) == (1, 0)
        assert store.materialize().num_trajectories == 1  # "later"
    assert rows(store) == []
    # exactly once, at its own place in the sample order (behind readers that passed it)
    assert sorted(sample_ids(store)) == ["a", "bug", "c", "later"]
    assert len(list(store.samples(trajectory_ids=["bug"]))) == 1
    (s,) = store.samples(trajectory_ids=["bug"])
    assert s.response_ids.tolist() == [3, 4, 5, 6] and s.token_model_versions.tolist() == [1, 1, -1, 2]
    assert (store.materialize().num_trajectories, Materializer(store).refold_quarantined().num_trajectories) == (0, 0)
    assert sorted(sample_ids(store)) == ["a", "bug", "c", "later"]


@pytest.mark.parametrize("error", [KeyError("route_layers"), IndexError("list index out of range"),
                                   ZeroDivisionError("division by zero"), AttributeError("x")])
def test_any_exception_that_is_no_data_rule_is_internal(store, monkeypatch, error):
    good(store, "bug")
    monkeypatch.setattr(materializer_module, "fold", broken({"bug"}, error))
    stats = store.materialize()
    assert (stats.num_unfoldable, stats.num_internal_errors) == (0, 1)
    assert rows(store) == [("bug", "internal_error", type(error).__name__, None)]


def test_a_data_rule_stays_data_and_is_not_retried(store, monkeypatch):
    good(store, "bad")
    monkeypatch.setattr(materializer_module, "fold",
                        broken({"bad"}, ValidationError("refused", trajectory_id="bad", rule="reward_mode")))
    stats = store.materialize()
    assert (stats.num_unfoldable, stats.num_internal_errors) == (1, 0)
    assert rows(store) == [("bad", "data", "ValidationError", "reward_mode")]
    monkeypatch.setattr(materializer_module, "fold", real_fold)
    assert store.materialize().num_trajectories == 0  # a fact about its data: recorded for good
    assert rows(store) == [("bad", "data", "ValidationError", "reward_mode")]


def test_info_and_sql_show_internal_errors_apart(store_url, tmp_path, monkeypatch, capsys):
    import trajstore

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    good(store, "bug")
    good(store, "ok")
    monkeypatch.setattr(materializer_module, "fold", broken({"bug"}, KeyError("x")))
    assert main(["--store", store_url, "--payload", payload, "materialize"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{"):])
    assert (metrics["num_trajectories"], metrics["num_unfoldable"], metrics["num_internal_errors"]) == (1, 0, 1)
    assert main(["--store", store_url, "--payload", payload, "info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["unfoldable_trajectories"]["count"] == 0
    assert info["internal_errors"]["count"] == 1 and info["internal_errors"]["by_error"] == {"KeyError": 1}
    assert [r["trajectory_id"] for r in info["internal_errors"]["recent"]] == ["bug"]
    monkeypatch.setattr(materializer_module, "fold", real_fold)
    assert main(["--store", store_url, "--payload", payload, "materialize", "--refold-quarantined"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["num_trajectories"] == 1
    assert rows(store) == [] and sorted(sample_ids(store)) == ["bug", "ok"]
    store.close()


def test_a_bug_recorded_before_migration_0012_folds_after_the_upgrade(store_url, tmp_path, monkeypatch):
    """A store that recorded a bug's exception as bad data (before ``kind``) gets it
    classified as an internal error by the migration, and folded by the next run."""
    from alembic import command
    from sqlalchemy import create_engine

    import trajstore
    from trajstore.log._migrate import alembic_config

    def migrate(engine, target, down=False):
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, target)

    faults = {"bug": TypeError("int() of None"), "bad": ValidationError("refused", rule="reward_mode")}

    def fold(gens, *, trajectory_id, **kw):
        if trajectory_id in faults:
            raise faults[trajectory_id]
        return real_fold(gens, trajectory_id=trajectory_id, **kw)

    payload = str(tmp_path / "payload")
    with trajstore.connect(store_url, payload=payload) as store:
        good(store, "bug")
        good(store, "bad")
        monkeypatch.setattr(materializer_module, "fold", fold)
        store.materialize()
    monkeypatch.setattr(materializer_module, "fold", real_fold)  # the fix
    engine = create_engine(store_url)
    try:
        migrate(engine, "0011", down=True)  # the store as it was: no kind, a bug recorded like data
        migrate(engine, "head")
    finally:
        engine.dispose()
    with trajstore.connect(store_url, payload=payload) as store:
        assert rows(store) == [("bug", "internal_error", "TypeError", None),
                               ("bad", "data", "ValidationError", "reward_mode")]
        assert store.materialize().num_trajectories == 1
        assert rows(store) == [("bad", "data", "ValidationError", "reward_mode")] and sample_ids(store) == ["bug"]
