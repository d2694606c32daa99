"""The storage seam: the two narrow interfaces every SQL backend implements.

* ``EventLog``    — the log index: append (positions, identities, trajectory
  tail state, the segment row), read events in order, the head, and which
  payload segments are referenced.
* ``SampleIndex`` — the sample index: the materializer's output rows, each
  materializer shard's checkpoint, and the read watermark derived from them.

Backends see records (plain dicts shaped like the ``trajstore.schema``
tables), never domain objects: admission, the fold and payload handling live
above this layer.

Contract, shared by every backend (and checked by
``tests/log/test_conformance.py`` on SQLite and PostgreSQL):

* **Ordering.** ``EventLog.commit_append`` gives the batch's events
  increasing positions, unique in the log. A tail bounded by
  ``safe_position()`` never skips an event that commits late: no event at a
  position at or below the bound can commit after it was read (backends that
  commit in position order return None, no bound; SQLite gives consecutive
  positions). ``finished_after``, the materializer's tail, applies the bound.
* **Atomicity.** ``commit_append`` stores all of a batch (events, trajectory
  rows, segment row) or nothing; ``SampleIndex.commit_samples`` stores the
  sample rows, their segment row, the folded events re-pointed to them, the
  log segments that left retired and the moved checkpoint, or nothing;
  ``EventLog.commit_compaction`` the compacted segment's row, the moved
  events and the retired old segments, or nothing.
* **Optimistic concurrency.** Each trajectory row carries a ``revision``
  counter; a batch computed from a stale revision raises ``StaleState`` and stores
  nothing (the caller re-reads and re-admits). So does a race on an event
  identity or a trajectory's creation, and a checkpoint that moved.
* **Idempotency** is the caller's (identities are looked up before admission);
  the unique identity key makes a lost race a ``StaleState``, never a duplicate.
* **Errors.** Every driver error is translated at one boundary
  (``trajstore.log._errors``), around the whole transaction
  (``trajstore.log._transaction``); nothing from the driver escapes:

  ==========================================  ==================================
  failure                                     raises
  ==========================================  ==================================
  another writer got there first              ``StaleState`` (retry from fresh state)
  database unreachable, connection lost       ``StoreUnavailable`` (nothing stored)
  connection lost during COMMIT, outcome      ``CommitUnknownError`` (a
  not found out                               ``StoreUnavailable``; retry)
  a value the database cannot store           ``ValidationError`` (rule ``storable_value``)
  any other constraint or SQL error           ``IndexInvariantError`` (a bug; no retry)
  ==========================================  ==================================

  When the connection is lost during COMMIT, ``commit_append`` looks on a
  fresh connection whether the batch landed and returns its positions if it
  did: an uncertain commit is never reported as "not stored".
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from trajstore.errors import ValidationError

__all__ = ["EventLog", "SampleIndex", "Shard", "StaleState", "ChecksFailed", "TrajectoryWrite", "shard_index_of", "SAMPLES_KIND",
           "Repoint", "RELEASED", "DATA_ERROR", "INTERNAL_ERROR"]

SAMPLES_KIND = "samples"
"""``events.segment_kind`` of an event whose payload locator was re-pointed to
the sample row it was folded into (NULL: its own row of a log segment)."""

RELEASED = "trajectory_released"
"""``events.type`` of the row the log adds when a version_label completes the
labels of a finished trajectory that was held back: the materializer folds
the trajectory there (docs/materializer.md, "Held back on a version label")."""


class StaleState(Exception):
    """A concurrent writer changed a trajectory (or took an identity, or moved a
    checkpoint) first. Internal: ``Store`` re-admits, the materializer re-reads."""


class ChecksFailed(Exception):
    """An append admitted without reading the store (``EventLog.commit_unread_steps``)
    failed a check its statements make: nothing was stored. Internal: ``Store``
    then reads and admits the batch the usual way, which finds the precise error,
    no-op or conflict."""


@dataclass(frozen=True)
class Repoint:
    """Move one event's payload locator: event ``position`` now reads its
    payload from row ``segment_row`` of ``segment`` (``segment_kind`` None: a
    log segment row of its own; ``SAMPLES_KIND``: the sample row it was folded
    into). ``old_segment`` / ``old_segment_row``: where it pointed when the
    move was computed (a compaction's guard; the log segment to retire)."""

    position: int
    segment: str
    segment_row: int
    segment_kind: str | None
    old_segment: str | None
    old_segment_row: int | None


@dataclass(frozen=True)
class TrajectoryWrite:
    """A trajectory row to insert (``expected_revision is None``) or update."""

    row: Mapping[str, Any]
    expected_revision: int | None


@dataclass(frozen=True, order=True)
class Shard:
    """One materializer shard, ``index`` of ``count``; spelled ``"index/count"``
    as the key of its checkpoint. A trajectory belongs to the shard
    ``crc32(trajectory_id) % count``."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise ValidationError(f"shard {self.index!r}/{self.count!r}: need 0 <= index < count", rule="shard")

    @classmethod
    def parse(cls, key: str) -> "Shard":
        """``Shard.parse("1/4") == Shard(1, 4)``."""
        index, sep, count = str(key).partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError:
            raise ValidationError(f"not a shard key: {key!r} (want 'index/count')", rule="shard") from None

    @classmethod
    def all(cls, count: int) -> list["Shard"]:
        return [cls(i, count) for i in range(count)]

    def owns(self, trajectory_id: str) -> bool:
        return shard_index_of(trajectory_id, self.count) == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_index_of(trajectory_id: str, count: int) -> int:
    """The index of the shard of ``count`` that folds ``trajectory_id``."""
    return zlib.crc32(trajectory_id.encode()) % count


DATA_ERROR = "data"
"""``unfoldable_trajectories.kind`` of a trajectory whose data breaks a rule (recorded for good)."""
INTERNAL_ERROR = "internal_error"
"""``unfoldable_trajectories.kind`` of a trajectory the fold failed on for a reason that is
no data rule: a bug in trajstore, folded again by the next run (docs/materializer.md)."""


class EventLog(ABC):
    """The log index: events in position order, identities, trajectory tail state, segments."""

    # -- appending ---------------------------------------------------------
    @abstractmethod
    def load_trajectories(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """Trajectory rows by id (missing ids are absent)."""

    @abstractmethod
    def lookup_identities(self, identities: Collection[str]) -> dict[str, bytes]:
        """Content hash of each stored identity (missing ones are absent)."""

    @abstractmethod
    def load_labels(self, labels: Collection[str]) -> dict[str, int]:
        """The label map's entries for ``labels`` (docs/reference.md "Versions"; missing ones are absent)."""

    @abstractmethod
    def pending_labels(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, tuple[int, int] | None]]:
        """For each of ``trajectory_ids`` with a generation whose labels did not resolve
        when it was appended: each such label -> ``(model_version, position)`` of the
        version_label that mapped it, or None while it is unmapped."""

    @abstractmethod
    def held_generations(self, trajectory_ids: Collection[str]) -> dict[str, set[int]]:
        """For each of ``trajectory_ids``: the positions of its generations whose
        ``weight_versions`` labels did not all resolve when they were appended (the
        calls the fold resolves; the others' versions were decided at admission)."""
    def lineage_keys(self, keys: Collection[tuple]) -> dict[tuple, str]:
        """For each lineage key (``trajstore.lineage._admission.lineage_key``) already recorded,
        the identity of the event that recorded it (docs/reference.md "Training lineage")."""
        raise NotImplementedError

    def lineage_state(self, keys: Collection[tuple], wanted: Mapping[str | None, Collection[tuple[str, int]]]
                      ) -> tuple[dict[tuple, str], dict[str | None, dict[tuple[str, int], dict[str, Any]]]]:
        """In one read: the identity recording each of the lineage ``keys`` already
        recorded (as ``lineage_keys``), and per projection (None: the default
        samples) the rows of the ``wanted`` ``(trajectory_id, sample_index)`` keys
        that exist (``trajectory_id``, ``sample_index``, ``prompt_len``,
        ``response_len``, ``min_model_version``, ``max_model_version``, ``segment``,
        ``segment_row``): what admitting lineage events reads."""
        raise NotImplementedError

    def standing_attempt(self, run: str, step: int, rank: int) -> int | None:
        """The highest attempt of a ``train_step`` recorded for ``(run, step, rank)`` (None: none)."""
        raise NotImplementedError

    def step_samples(self, *, run: str, step: int) -> list[dict[str, Any]]:
        """The samples step ``step`` of ``run`` consumed, every rank at its standing
        attempt, in (rank, order consumed): ``rank``, ``attempt``, ``trajectory_id``,
        ``sample_index``, ``projection``."""
        raise NotImplementedError

    def annotation_rows(self, *, run: str, step: int | None = None,
                        trajectory_id: str | None = None) -> list[dict[str, Any]]:
        """``lineage_annotations`` rows of ``run`` (of one step, of one trajectory's
        samples) in (step, trajectory_id, sample_index, attempt) order."""
        raise NotImplementedError

    def load_ledger(self, group_ids: Collection[str], prompts: Collection[tuple[str, str, int]],
                    check_plain: Collection[str] = ()
                    ) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str, int], str], set[str]]:
        """What admitting rollout ledger events reads (docs/reference.md "Rollout ledger"):
        the ``ledger_groups`` rows of ``group_ids``, the group holding each of
        ``prompts`` ``(run, prompt_id, epoch)``, and which of ``check_plain`` (not
        ledger groups) name trajectories started without the ledger's fields."""
        raise NotImplementedError

    def rollout_rows(self, run: str) -> tuple[list[tuple], list[tuple[str, str, str, int]]]:
        """In one read: ``run``'s ``ledger_groups`` rows oldest first (tuples of
        ``log._ledger.GROUP_COLUMNS``), and
        ``(group_id, trajectory_id, status, last_seq)`` of their trajectories in start order."""
        raise NotImplementedError

    def load_append_state(self, identities: Collection[str], trajectory_ids: Collection[str], *,
                          lineage: Any = None) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        """``lookup_identities`` and ``load_trajectories`` together (backends may
        answer both in one round trip: an append needs both before it admits).
        ``lineage``: a ``trajstore.lineage._admission.LineagePlan`` of the batch's lineage
        events, whose ``result`` is set to ``lineage_state(plan.keys, plan.wanted)``
        (backends read it in the same transaction)."""
        if lineage is not None:
            lineage.result = self.lineage_state(lineage.keys, lineage.wanted)
        return self.lookup_identities(identities), self.load_trajectories(trajectory_ids)

    @abstractmethod
    def commit_append(
        self,
        event_rows: Sequence[dict[str, Any]],
        trajectory_writes: Sequence[TrajectoryWrite],
        segment_row: Mapping[str, Any] | None,
        *,
        before_commit: Callable[[], None] | None = None,
        more_segments: Sequence[Mapping[str, Any]] = (),
    ) -> list[int]:
        """Atomically store a batch; return the events' positions.

        ``more_segments``: further segment rows of the batch (its annotations' arrays).
        ``before_commit()`` runs inside the transaction after its statements
        and before COMMIT (the append waits there for its payload's fsync); if
        it raises, nothing is stored and its error is raised.

        Raises ``StaleState`` (a trajectory's revision moved, or an identity or
        trajectory id was taken concurrently), ``StoreUnavailable`` (nothing was
        stored), ``CommitUnknownError`` (the outcome is unknown: the caller must
        keep the batch's payload), ``ValidationError`` or ``IndexInvariantError``
        (see the module doc)."""

    checks_steps = False
    """Does ``commit_unread_steps`` check steps itself (else the store always reads first)?"""

    def commit_unread_steps(self, event_rows: Sequence[dict[str, Any]]) -> list[int]:
        """Atomically store ``train_step`` events admitted without reading the store
        (their ``lineage`` facts from ``trajstore.lineage._admission.unread_step_facts``; no
        trajectory rows, no payload); return their positions. The checks admission
        would have read for are the statements': every sample must exist in the
        sample index of its projection, and no step key or identity may be
        recorded yet. When one fails nothing is stored and ``ChecksFailed`` is
        raised (the caller reads and admits, to learn why). Otherwise raises what
        ``commit_append`` raises; a connection lost once the statements were sent
        leaves the outcome unknown (the COMMIT may be among them): the positions
        when the events are found stored, else ``CommitUnknownError``."""
        raise ChecksFailed("this log does not check steps itself")

    # -- reading -----------------------------------------------------------
    @abstractmethod
    def head_position(self) -> int:
        """Position of the last committed event (0 when empty)."""

    @abstractmethod
    def read_events(self, *, after_position: int, limit: int, types: Collection[str] | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` committed events with position > ``after_position``, in order."""

    @abstractmethod
    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        """Number of committed events with position > ``after_position``."""

    @abstractmethod
    def trajectory_events(self, trajectory_ids: Collection[str]) -> dict[str, list[dict[str, Any]]]:
        """All events of the given trajectories, each list in position order."""

    @abstractmethod
    def counts(self) -> dict[str, Any]:
        """The log's part of ``trajstore info``: ``head_position``,
        ``trajectories_by_status``, ``events_by_type``, ``generations_by_model_version``,
        ``route_drift`` (route rows re-sent and drifted, over the log),
        ``unresolved_version_labels`` (each label still unmapped, with the trajectories
        waiting on it and how many of them are finished, i.e. held back)."""

    @abstractmethod
    def referenced_segments(self) -> set[str]:
        """Names of every payload segment an index row needs: named by an
        ``events`` or ``samples`` row, or a ``segments`` row not retired."""

    # -- one copy: garbage collection and compaction (docs/log.md "One copy") --
    @abstractmethod
    def retire_unreferenced(self, now: float) -> list[str]:
        """Mark retired (``retired_at = now``) every segment row no event or
        sample names any more (the re-pointing transactions retire what they
        empty; this catches the ones two concurrent transactions each left to
        the other). Returns the names."""

    @abstractmethod
    def segments_in_use(self, retired_before: float) -> set[str]:
        """``referenced_segments()`` plus the segments retired after
        ``retired_before`` (a reader that resolved their names before they were
        retired may still open them: the GC grace)."""

    @abstractmethod
    def forget_segments(self, names: Collection[str]) -> int:
        """Delete the ``segments`` rows of retired segments no index row names
        (after their files were deleted); returns how many."""

    def shrink_journal(self) -> None:
        """Give back the disk space the database's journal holds beyond its data
        (SQLite's WAL), never waiting for another connection; a no-op where there is
        nothing to give back."""

    @abstractmethod
    def compaction_candidates(self, *, max_bytes: int, limit_bytes: int) -> list[dict[str, Any]]:
        """Log segment rows not retired and smaller than ``max_bytes``, oldest
        first, until their sizes add up to ``limit_bytes``."""

    @abstractmethod
    def live_locators(self, segment_names: Collection[str]) -> list[dict[str, Any]]:
        """``position, trajectory_id, segment, segment_row`` of every event still
        reading its payload from one of these log segments, in position order."""

    @abstractmethod
    def commit_compaction(self, segment_row: Mapping[str, Any], moves: Sequence[Repoint]) -> None:
        """In one transaction: insert the compacted segment's row, re-point every
        moved event guarded by its current locator, and retire the old segments
        left empty. Raises ``StaleState`` (nothing stored) when any event moved
        meanwhile (the materializer re-pointed it)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""

    # -- the materializer's reads: only what it folds from ------------------
    def finished_after(self, after_position: int, limit: int) -> list[dict[str, Any]]:
        """The next ``limit`` ``trajectory_finished`` (and ``trajectory_released``)
        events after ``after_position`` (position order): ``position``,
        ``trajectory_id``, ``status`` and ``seq_len``, the trajectory's tokens
        (None when it has no row)."""
        rows = self.read_events(after_position=after_position, limit=limit,
                                types=["trajectory_finished", RELEASED])
        trajs = self.load_trajectories({r["trajectory_id"] for r in rows})
        return [{"position": r["position"], "trajectory_id": r["trajectory_id"], "status": r["status"],
                 "seq_len": trajs[r["trajectory_id"]]["seq_len"] if r["trajectory_id"] in trajs else None}
                for r in rows]

    def fold_inputs(self, trajectory_ids: Collection[str]
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        """The trajectory rows of ``trajectory_ids`` and their ``generation`` and
        ``reward`` event rows (position order, every id a key): the columns
        ``generations_from_log`` and the fold use (not ``metadata``)."""
        trajs = self.load_trajectories(trajectory_ids)
        events = {t: [r for r in rows if r["type"] in ("generation", "reward")]
                  for t, rows in self.trajectory_events(trajectory_ids).items()}
        return trajs, events

    def database_time(self) -> float:
        """The clock retirement times are stamped with (the database's, where it has one)."""
        import time

        return time.time()

    def safe_position(self, wait_s: float = 0.25) -> int | None:
        """The highest position below which no append can still commit; None
        when the backend commits in position order (no bound is needed)."""
        return None

    @abstractmethod
    def finished_ids_after(self, after_position: int) -> list[str]:
        """Ids of the trajectories finished (or released) after ``after_position``, in position order."""

    @abstractmethod
    def finished_status(self, trajectory_ids: Collection[str]) -> dict[str, str]:
        """The status of each trajectory's ``trajectory_finished`` event (absent: not finished)."""

    def idle_running(self, idle_since: float, limit: int) -> list[str]:
        """Ids of running trajectories whose last event was appended before ``idle_since``
        (unix seconds), oldest first, at most ``limit``."""
        raise NotImplementedError


class SampleIndex(ABC):
    """The sample index: materialized sample rows and the shards' checkpoints."""

    @abstractmethod
    def load_checkpoint(self, shard: Shard) -> dict[str, Any] | None:
        """The checkpoint row of ``shard`` (None before its first commit)."""

    @abstractmethod
    def checkpoints(self) -> dict[Shard, dict[str, Any]]:
        """Every stored checkpoint row by shard."""

    @abstractmethod
    def commit_samples(
        self,
        shard: Shard,
        sample_rows: Sequence[dict[str, Any]],
        segment_row: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any],
        expected_position: int,
        *,
        unfoldable_rows: Sequence[dict[str, Any]] = (),
        repoints: Sequence[Repoint] = (),
        aggregates: Mapping[str, Any] | None = None,
        trajectories: Sequence[str] = (),
        calls_of: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        """Insert sample rows (and ``unfoldable_trajectories`` rows) and move
        ``shard``'s checkpoint in one transaction; in the same transaction
        re-point the folded events (``repoints``) to their sample rows and
        retire the log segments that no event names any more.

        Raises ``StaleState`` when the stored checkpoint is not
        ``expected_position`` (another materializer of the same shard got there
        first); the other errors as in the module doc. ``aggregates``: the run view's counts of
        the samples' token columns; ``trajectories``: the finished trajectories the commit takes
        (folded, unfoldable or held back), counted into the run view's per-trajectory aggregates
        with its default samples; ``calls_of``: the generation event rows (``fold_inputs``) of
        those of them the caller read already, not read again for the counts."""

    @abstractmethod
    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        """Sample rows matching the filters, in (finished_position, sample_index) order,
        ``page_rows`` rows per list (one query each). ``where`` keys: ``status`` (one or several),
        ``min_model_version``, ``max_model_version``, ``group_id``,
        ``trajectory_ids``, ``max_finished_position``; None values are ignored."""

    def sample_facts(self, trajectory_ids: Collection[str]) -> list[dict[str, Any]]:
        """``trajectory_id``, ``sample_index``, ``prompt_len``, ``response_len``,
        ``min_model_version``, ``max_model_version``, ``segment``, ``segment_row`` of
        every sample of ``trajectory_ids`` (what training lineage checks against)."""
        rows = [r for page in self.iter_sample_rows(where={"trajectory_ids": list(trajectory_ids)}, after=None,
                                                    page_rows=4096) for r in page]
        return rows

    @abstractmethod
    def count_samples(self) -> int:
        """Number of sample rows (for ``trajstore info``)."""

    @abstractmethod
    def unfoldable_trajectories(self, *, limit: int = 20, kind: str = DATA_ERROR) -> dict[str, Any]:
        """Finished trajectories the materializer recorded as unfoldable with ``kind``
        (``DATA_ERROR``, or ``INTERNAL_ERROR``: a bug, retried):
        ``{"count", "by_error": {error class: n}, "recent": [the limit newest rows]}``."""

    def quarantined(self, error: str | None, *, kind: str = DATA_ERROR) -> list[dict[str, Any]]:
        """Rows of ``unfoldable_trajectories`` recorded with ``kind`` and ``error`` (the
        class name; None: any), oldest first: ``trajectory_id``, ``finished_position``, ``shard``."""
        raise NotImplementedError

    def commit_refold(self, error: str | None, trajectory_ids: Sequence[str], sample_rows: Sequence[dict[str, Any]],
                      segment_row: Mapping[str, Any] | None, unfoldable_rows: Sequence[dict[str, Any]],
                      repoints: Sequence[Repoint], *, kind: str = DATA_ERROR,
                      aggregates: Mapping[str, Any] | None = None) -> None:
        """In one transaction: take ``trajectory_ids`` out of quarantine (each must
        still be recorded with ``kind`` and ``error`` (None: any), else ``StaleState``
        and nothing changes), insert their sample rows and segment, record the ones
        that failed (``unfoldable_rows``), re-point the folded events. No
        checkpoint moves: the trajectories' finished events are behind it."""
        raise NotImplementedError

    # -- named projections (docs/projections.md); a backend without them refuses --
    def create_projection(self, row: Mapping[str, Any]) -> None:
        """Insert a ``projections`` row (name, policy, segment token, created_at)."""
        raise ValidationError("this store has no named projections", rule="projection")

    def projections(self) -> list[dict[str, Any]]:
        """Every projection's row with ``num_samples`` and ``num_unfoldable``."""
        return []

    def projection(self, name: str) -> "SampleIndex":
        """The sample index of projection ``name`` (its ``row`` attribute: the policy)."""
        raise ValidationError(f"no projection {name!r}", rule="projection")

    def drop_projection(self, name: str) -> dict[str, int]:
        """Delete projection ``name``'s rows and retire its sample segments."""
        raise ValidationError(f"no projection {name!r}", rule="projection")

    def shard_count(self) -> int | None:
        """How many shards the stored checkpoints were written by (None when
        there is none yet). Raises ``ValidationError`` when they disagree (the
        store was materialized with different shard counts)."""
        counts = {s.count for s in self.checkpoints()}
        if len(counts) > 1:
            raise ValidationError(f"materializer checkpoints of different shard counts {sorted(counts)}: "
                                  "materialize a store with one shard count", rule="shard")
        return counts.pop() if counts else None

    def watermark(self, num_shards: int | None = None) -> int:
        """Position up to which every shard has committed its samples (0 when
        some shard has not started): no sample at or below it can appear later.

        ``num_shards`` defaults to what the checkpoints say; when given it must
        agree with them (``ValidationError`` otherwise)."""
        stored = self.checkpoints()
        found = self.shard_count()
        if num_shards is not None and found is not None and found != num_shards:
            raise ValidationError(f"the store's materializer checkpoints are for {found} shard(s), "
                                  f"not num_shards={num_shards}", rule="reader_config")
        n = num_shards or found
        if n is None:
            return 0
        return min(int(stored[s]["position"]) if s in stored else 0 for s in Shard.all(n))
