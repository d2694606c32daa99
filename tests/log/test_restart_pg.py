"""A PostgreSQL restart between two commands of one store: the caller's next
command, made once and without a retry, works as soon as the server accepts
connections again, however soon after the store's last command the server
went down, and with every pooled connection broken alike.

The pool checks a connection at checkout without a round trip: its socket is
polled, and one whose server spoke while it sat in the pool (the termination
notice, the end of the stream) is pinged and replaced (``log.postgres``);
the idle ping (``PING_IDLE_S``) is set out of reach here, so that a restart
taking any time at all falls where only that check can see it. What the
checks cannot see (a peer that never closed the socket) costs a read one more
try on a new connection, never a write: the append's first write round trip
on a lost connection is a certain failure (``StoreUnavailable``, nothing
stored)."""

from __future__ import annotations

import threading

import pytest

import trajstore
from trajstore.errors import StoreUnavailable
from trajstore.log import postgres

from helpers import gen, started

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def no_idle_ping(monkeypatch):
    monkeypatch.setattr(postgres, "PING_IDLE_S", 3600.0)


def _call(tid: str, turn: int) -> dict:
    return gen(tid, turn, [1, 2] + [3] * (3 * turn), [4, 5, 6], logprobs=[-0.5] * 3, event_id=f"{tid}-{turn}")


def _restart(cluster, mode: str) -> None:
    cluster.restart(mode)  # pg_ctl stop -m MODE -w, then start -w: every backend is gone
    cluster.wait_ready()


def _calls_stored(store, tids) -> dict[str, list[str]]:
    rows = store.log.trajectory_events(list(tids))
    return {t: [r["event_id"] for r in rows.get(t, []) if r["type"] == "generation"] for t in tids}


@pytest.mark.parametrize("batch", ["new", "continuing"])
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_direct_append_right_after_a_restart_works(fault_cluster, tmp_path, no_idle_ping, mode, batch):
    """``new`` starts its trajectory: its first round trip is the pipelined write (no read);
    ``continuing`` reads the trajectory first."""
    url = fault_cluster.create_database()
    with trajstore.connect(url, payload=str(tmp_path / "p")) as store:
        store.append([started("a"), _call("a", 0)])
        _restart(fault_cluster, mode)
        if batch == "new":
            result = store.append([started("b"), _call("b", 0)])
        else:
            result = store.append([_call("a", 1)])
        assert result.last_position is not None
        assert _calls_stored(store, ["a", "b"]) == {"a": ["a-0"] + (["a-1"] if batch == "continuing" else []),
                                                     "b": ["b-0"] if batch == "new" else []}


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_every_pooled_connection_broken_by_a_restart_is_replaced(fault_cluster, tmp_path, no_idle_ping, mode):
    """Four connections in the pool, all broken by the restart: four appends at once, each
    on a pooled connection of its own, then more one after another; none fails."""
    url = fault_cluster.create_database()
    tids = [f"t{i}" for i in range(4)]
    with trajstore.connect(url, payload=str(tmp_path / "p")) as store:
        store.append([started(t) for t in tids])
        engine = store.log.db.write_engine
        held = [engine.raw_connection() for _ in range(4)]
        for conn in held:
            conn.close()
        assert engine.pool.checkedin() >= 4
        _restart(fault_cluster, mode)
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(tids))

        def append(tid: str) -> None:
            try:
                barrier.wait(30)
                store.append([_call(tid, 0)])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=append, args=(t,)) for t in tids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        for turn in (1, 2):
            for tid in tids:
                store.append([_call(tid, turn)])
        assert _calls_stored(store, tids) == {t: [f"{t}-0", f"{t}-1", f"{t}-2"] for t in tids}


def test_a_read_on_a_lost_connection_the_checkout_missed_runs_again_a_write_does_not(
        fault_cluster, tmp_path, no_idle_ping, monkeypatch):
    """The checkout's socket check is blinded (as for a peer gone without closing the
    socket): the append's read on the lost connection runs again on a new one and the
    append works; an append whose first round trip is its write fails once with
    StoreUnavailable, stores nothing, and the next attempt works."""
    url = fault_cluster.create_database()
    with trajstore.connect(url, payload=str(tmp_path / "p")) as store:
        store.append([started("a"), _call("a", 0)])
        monkeypatch.setattr(postgres, "_server_spoke", lambda dbapi_connection: False)
        _restart(fault_cluster, "fast")
        store.append([_call("a", 1)])  # read first: retried on a new connection
        assert _calls_stored(store, ["a"]) == {"a": ["a-0", "a-1"]}

        store.append([started("b")])
        engine = store.log.db.write_engine
        held = [engine.raw_connection() for _ in range(engine.pool.checkedin() + 1)]
        for conn in held:
            conn.close()  # every pooled connection used just now, none idle
        _restart(fault_cluster, "fast")
        with pytest.raises(StoreUnavailable):
            store.append([started("c"), _call("c", 0)])  # no read: the pipelined write is the first
        assert store.log.load_trajectories(["c"]) == {}
        store.append([started("c"), _call("c", 0)])
        assert _calls_stored(store, ["c"]) == {"c": ["c-0"]}
