"""A dry run of appends: ``Store.checker()`` / ``Store.check`` (``trajstore ingest`` checks a whole file first).

The same steps as ``pipeline.append`` (parse, the duplicate rule, admission, the
ledger's and lineage's rules) against state kept from batch to batch instead of
written: nothing reaches the payload or the index.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any, Iterable, Mapping

import numpy as np

from trajstore._append import facts
from trajstore._append.admission import TrajectoryState, admit_batch
from trajstore._append.digests import Digests as _Digests
from trajstore._append.pipeline import AppendResult, AppendTarget, current_sequence, labels_named, parse_all, sample_source
from trajstore._append.retries import split_retries as _split_retries
from trajstore.errors import ValidationError
from trajstore.events import Event, Generation, TrajectoryFinished, VersionLabel
from trajstore.lineage import _admission as _lineage
from trajstore.rollout import _ledger

__all__ = ["AppendCheck"]


class AppendCheck:
    """Admission without writing, batch after batch, as if each were appended
    after the ones before (``Store.checker()``): how ``trajstore ingest``
    validates a whole file before storing any of it.

    Keeps only each touched trajectory's small tail state, the last token
    sequence of running ones, and a 16-byte digest per event identity seen;
    no token arrays of past batches. Events already stored (or seen in an
    earlier batch) with the same content count as duplicates, as ``append``
    would skip them. After an error the checker is spent (its state has
    taken the batch's events before the refused one)."""

    def __init__(self, store: AppendTarget) -> None:
        self.store = store
        self._states: dict[str, TrajectoryState | None] = {}
        self._sequences: dict[str, np.ndarray] = {}  # running trajectories' last sequence (rare path only)
        self._seen: dict[str, bytes] = {}  # identity -> content digest
        self._labels: dict[str, int] = {}  # the label map, as far as the batches named it
        self._lineage: dict[tuple, str] = {}  # lineage keys the batches recorded -> identity
        self._ledger: list = []  # the batches' ledger events so far (admitted with each next batch's)

    def check(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """The next batch; raises as ``Store.append`` would (indices within this batch)."""
        parsed = parse_all(events)
        log = self.store.log
        named = labels_named([ev for ev, _ in parsed])
        self._labels.update(log.load_labels(named - self._labels.keys()))
        stored = log.lookup_identities({ident for _, ident in parsed if ident and ident not in self._seen})
        unknown = {ev.trajectory_id for ev, _ in parsed if ev.trajectory_id not in self._states}
        if unknown:
            rows = log.load_trajectories(unknown)
            self._states.update({tid: facts.state_from_row(rows[tid]) if tid in rows else None for tid in unknown})
        digests = _Digests([ev for ev, _ in parsed])
        # a retry of a stored event, or a repeat: append skips it
        fresh, duplicates, first = _split_retries(parsed, ChainMap(self._seen, stored), digests.get, self._labels.get)
        self._seen.update((ident, digests.get(i)) for ident, i in first.items())
        try:
            admitted = admit_batch([parsed[i][0] for i in fresh], self._states, self._sequence, self._labels)
        except ValidationError as e:
            raise e.at(fresh[e.index] if e.index is not None else 0) from None
        _ledger.changes_of(log, [(i, adm) for i, adm in zip(fresh, admitted) if not adm.noop], self._ledger)
        lineage = [(i, adm.event, parsed[i][1]) for i, adm in zip(fresh, admitted) if _lineage.is_lineage(adm.event)]
        if lineage:
            _lineage.admit_lineage(lineage, sample_source(self.store), self._lineage)  # type: ignore[arg-type]
            self._lineage.update((_lineage.lineage_key(ev), ident) for _, ev, ident in lineage)  # type: ignore
        for i, adm in zip(fresh, admitted):
            ev = adm.event
            if adm.noop:
                duplicates.append(i)
            if isinstance(ev, VersionLabel):
                self._labels.setdefault(ev.label, ev.model_version)
                continue
            if adm.state is None:  # a lineage event: store-wide
                continue
            self._states[ev.trajectory_id] = adm.state
            if isinstance(ev, Generation):
                self._sequences[ev.trajectory_id] = np.concatenate([ev.prompt_ids, ev.output_ids])
            elif isinstance(ev, TrajectoryFinished):
                self._sequences.pop(ev.trajectory_id, None)
        duplicates.sort()
        return AppendResult(len(parsed) - len(duplicates), len(duplicates), None, tuple(duplicates))

    def _sequence(self, trajectory_id: str) -> np.ndarray:
        if trajectory_id in self._sequences:
            return self._sequences[trajectory_id]
        return current_sequence(self.store, trajectory_id)

