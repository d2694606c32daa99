"""Running trajectories nobody finishes (a dead harness, a writer that lost a conflict)
are finished as ``abandoned`` after an idle time the operator sets, and fold."""

from __future__ import annotations

import threading
import time

import pytest

import trajstore
from tests.helpers import finished, gen, started
from trajstore.cli import main
from trajstore.errors import ValidationError
from trajstore.materializer import Materializer


def test_idle_trajectories_are_abandoned_and_folded(store):
    store.append([started("dead"), gen("dead", 0, [1, 2], [3, 4])])
    store.append([started("done"), gen("done", 0, [1], [2]), finished("done")])
    time.sleep(0.3)
    store.append([started("live"), gen("live", 0, [5], [6])])
    m = Materializer(store)
    assert m.abandon_idle(0.2) == ["dead"]
    assert m.abandon_idle(0.2) == []  # once
    m.run()
    samples = {s.trajectory_id: s for s in store.samples()}
    assert sorted(samples) == ["dead", "done"] and samples["dead"].status == "abandoned"
    assert store.info()["trajectories_by_status"] == {"abandoned": 1, "completed": 1, "running": 1}
    # A late call for the abandoned trajectory is refused, never dropped silently.
    with pytest.raises(ValidationError, match="finished"):
        store.append([gen("dead", 1, [1, 2, 3, 4], [7])])
    with pytest.raises(ValidationError, match="finite number > 0"):
        m.abandon_idle(float("nan"))


def test_a_harness_finishing_meanwhile_wins(store):
    store.append([started("t"), gen("t", 0, [1], [2])])
    time.sleep(0.2)
    m = Materializer(store)
    ids = store.log.idle_running(time.time() - 0.1, 10)
    assert ids == ["t"]
    store.append([finished("t", status="completed")])  # between the read and the abandon
    assert m.abandon_idle(0.1) == []
    m.run()
    (s,) = store.samples()
    assert s.status == "completed"


def test_shards_abandon_only_their_own(store):
    ids = [f"t{i}" for i in range(8)]
    for tid in ids:
        store.append([started(tid), gen(tid, 0, [1], [2])])
    time.sleep(0.2)
    got = [Materializer(store, shard_index=k, num_shards=2).abandon_idle(0.1) for k in (0, 1)]
    assert sorted(got[0] + got[1]) == ids and not set(got[0]) & set(got[1]) and got[0] and got[1]


def test_follow_and_cli_abandon(store_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    with trajstore.connect(store_url, payload=payload) as store:
        store.append([started("a"), gen("a", 0, [1], [2])])
        time.sleep(0.2)
        assert main(["--store", store_url, "--payload", payload, "materialize", "--abandon-after-s", "0.1"]) == 0
        assert "finished 1 idle running trajectories as abandoned" in capsys.readouterr().err
        assert [s.status for s in store.samples()] == ["abandoned"]
        # The long-running worker: abandons and folds on its own.
        store.append([started("b"), gen("b", 0, [1], [2])])
        stop = threading.Event()
        m = Materializer(store)
        worker = threading.Thread(target=m.follow, args=(stop,),
                                  kwargs={"poll_s": 0.05, "gc_grace_s": None, "abandon_after_s": 0.5})
        worker.start()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(list(store.samples())) < 2:
                time.sleep(0.1)
        finally:
            stop.set()
            worker.join(30)
        assert sorted((s.trajectory_id, s.status) for s in store.samples()) == [("a", "abandoned"),
                                                                               ("b", "abandoned")]
