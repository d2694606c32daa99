"""The live page reruns only the SQL of panels whose tables the writes since its last computation
change (trajstore.inspect._sources). Checked on both backends with real writes, one kind at a
time: the change query names exactly that kind, every panel the map says it cannot change reads
the same rows as before, and the page computed with the memo equals one computed from scratch."""

from __future__ import annotations

import pytest

from tests.helpers import reader_url_for
from tests.inspect.test_report import fill, run_events, run_store, train  # noqa: F401
from trajstore.inspect._figures import _clock
from trajstore.inspect._panels import PANELS, collect
from trajstore.inspect._sources import SIGNALS_SQL, kinds_of, moved, tokens
from trajstore.inspect.sql import read_only


def _token(store) -> dict:
    with read_only(reader_url_for(store.url)) as query:
        return tokens(query(SIGNALS_SQL).rows[0])


def _rows(store) -> dict:
    """Each panel's SQL and its rows, read from scratch."""
    with read_only(reader_url_for(store.url)) as query:
        clock = _clock(query, 0.0, store.payload.location)
        return {p.name: (sql, [query(q).rows for q in sql]) for p in PANELS for sql in [list(p.queries(clock))]}


def _collect(store, memo=None, kinds=None) -> dict:
    with read_only(reader_url_for(store.url)) as query:
        return collect(query, stuck_after_s=0.0, payload=store.payload.location, memo=memo, moved=kinds)


def _page(data) -> list:
    return [(p["name"], p["figure"], p["note"]) for p in data["panels"]] + [data["summary"]]


def test_each_write_moves_only_the_panels_of_its_kind(run_store):
    """Appended (not folded), then folded, then a training step: after each, the change query names
    that kind, the panels of other kinds read what they read, and the live page's memo gives the
    page computed from scratch (rows of the other kinds kept: the same panel objects)."""
    store, _ = run_store
    memo: dict = {}  # as the live page keeps it
    token, before = _token(store), _rows(store)
    page = _collect(store, memo)
    for write in ("rollout", "fold", "lineage"):
        if write == "rollout":
            for events in run_events(100, 3):
                store.append(events)
        elif write == "fold":
            store.materialize()
        else:
            train(store, 50, steps=1)
        now = _token(store)
        kinds = moved(token, now)
        assert kinds is not None and write in kinds and kinds <= {write, "compaction"}, (write, kinds)
        after = _rows(store)
        untouched = [name for name, (sql, _) in before.items() if after[name][0] == sql and not kinds_of(sql) & kinds]
        assert len(untouched) >= 5, (write, untouched)  # the check below is about something
        for name in untouched:
            assert after[name][1] == before[name][1], (write, name)
        assert any(after[name] != before[name] for name in before), write  # the write moved something
        # the live page's computation (only the moved kinds' SQL rerun) is the page from scratch
        got = _collect(store, memo, kinds)
        assert _page(got) == _page(_collect(store)), write
        kept = {p["name"] for p, q in zip(page["panels"], got["panels"]) if p is q}
        assert kept and kept.isdisjoint(name for name, (sql, _) in after.items() if kinds_of(sql) & kinds
                                        and after[name] != before[name]), (write, kept)
        token, before, page = now, after, got
    assert {"logprobs", "versions", "staleness", "merge_ratio"} <= kept, kept  # a training step moves none of them
