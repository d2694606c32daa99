"""The Store: the public entry point (``trajstore.connect``).

It wires the layers together and owns no rule of its own: opening a URL is the
backend's (``log._registry.backend_of``), the payload's location is
``payload._home``'s; an append is ``_append.pipeline``'s one pass (parse,
duplicates, admission, payload segment, index transaction) and its dry run
``_append.check``'s; the GC's full sweep and the log's compaction are
``_upkeep``'s; folding is ``materializer``'s, reading ``reader``'s and
``sample._codec``'s.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from trajstore._append import facts, pipeline
from trajstore._append.admission import TrajectoryState
from trajstore._append.check import AppendCheck
from trajstore._append.pipeline import ROUTES_CACHE_BYTES, AppendResult, RoutesCache as _RoutesCache
from trajstore.errors import ValidationError
from trajstore.events import Event, Generation
from trajstore.log.base import EventLog, SampleIndex
from trajstore.log._backend import safe_url as _safe
from trajstore.log._errors import driver_errors
from trajstore.log._registry import backend_of
from trajstore.log._open import open_sql
from trajstore.payload import PayloadStore
from trajstore.payload import _home as _payload_home
from trajstore.rollout import _ledger
from trajstore.sample import Sample

__all__ = ["Store", "AppendCheck", "AppendResult", "connect", "DEFAULT_URL", "resolve_url"]

log = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///trajstore-data/trajstore.db"


def resolve_url(url: str | None) -> str:
    """``url``, else ``$TRAJSTORE_URL``, else the embedded default."""
    return url or os.environ.get("TRAJSTORE_URL") or DEFAULT_URL


def connect(url: str | None = None, *, payload: str | None = None, log_compression: str | None = None,
            migrate: bool = True, create: bool = True) -> "Store":
    """Open (and on first use create) a store.

    ``url``: ``sqlite:///path.db`` (embedded) or ``postgresql+psycopg://...``;
    None means ``$TRAJSTORE_URL``, else ``sqlite:///trajstore-data/trajstore.db``.
    ``payload``: where the payload files live (the log's Arrow IPC segments,
    uncompressed unless ``log_compression``, and the sample segments): a
    local path or any pyarrow filesystem URI. The store records it when it is
    created and every later process finds it there: None means the recorded
    location; a location that disagrees with it raises PayloadLocationError
    before anything is read or written (docs/deploy.md). A new store without
    one gets ``<db file>.payload/`` for SQLite, ``$TRAJSTORE_PAYLOAD_DIR`` (else
    ``./trajstore-payload/<database>``, made absolute) for PostgreSQL.
    ``log_compression``: codec of the log's payload files (None, "lz4",
    "zstd"); see ``trajstore.payload.PayloadStore``. Readers need not agree.
    ``create=False``: only open an existing store; a missing SQLite file or a
    PostgreSQL database without trajstore's schema raises StoreUnavailable
    ("no store at ...") and nothing is created (what read-only tools use).
    """
    return Store(resolve_url(url), payload=payload, log_compression=log_compression, migrate=migrate,
                 create=create)


class Store:
    """The store: ``log`` (the log index), ``materialized`` (the sample index)
    and ``payload`` (the token columns' files) are the seams the materializer,
    the reader and the inspection tools use."""

    url: str
    log: EventLog
    materialized: SampleIndex
    payload: PayloadStore

    def __init__(self, url: str, *, payload: str | None = None, log_compression: str | None = None,
                 migrate: bool = True, create: bool = True) -> None:
        self.url = url
        backend = backend_of(url)
        backend.require_database(url, missing_ok=create)
        write_engine, read_engine = backend.make_engines(url)
        if not create:
            backend.require_schema(url, read_engine)
        if migrate:
            from trajstore.log._migrate import upgrade

            with driver_errors(f"cannot open store {_safe(url)}", mode="opening"):  # first contact: one line
                upgrade(write_engine)
        # the payload location the store recorded (refusing a disagreeing one) before any payload I/O
        location = _payload_home.resolve(url, write_engine, read_engine, payload,
                                         lambda: backend.default_payload_dir(url), record=migrate)
        self.log, self.materialized = open_sql(write_engine, read_engine)
        # its root was made with its marker when the location was recorded, never by a later open
        self.payload = PayloadStore(location, log_compression, create=_payload_home.ephemeral(location))
        self._routes = _RoutesCache(ROUTES_CACHE_BYTES)
        self._route_drift = True  # off only to measure what the drift figures cost (bench/)

    # -- appending ---------------------------------------------------------
    def append(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """Append wire-format events atomically and idempotently (docs/reference.md "Event wire format").

        Raises ValidationError (naming the event index, trajectory and rule) and
        stores nothing when any event is refused; StoreUnavailable (retriable:
        ContentionError when other writers kept winning the race for the same
        trajectories, CommitUnknownError when the commit's outcome is unknown)
        when the append may not have been stored. Retrying an append is safe. Its
        object-store requests share one deadline (``payload/_deadline.py``)."""
        with self.payload.deadline():
            return pipeline.append(self, events)


    def check(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """What ``append(events)`` would do now, without writing anything.

        Raises what ``append`` would (ValidationError naming the event index,
        trajectory and rule; ConflictError); otherwise returns the counts the
        append would report (``last_position`` None). Several batches checked
        as if appended one after the other: ``checker()``."""
        return self.checker().check(events)

    def checker(self) -> "AppendCheck":
        """A dry run over successive batches (see ``AppendCheck``)."""
        return AppendCheck(self)


    # -- reading the log ---------------------------------------------------
    def load_generations(self, trajectory_id: str) -> list[Generation]:
        """One trajectory's generation commands, rebuilt from the log."""
        rows = [r for r in self.log.trajectory_events([trajectory_id])[trajectory_id] if r["type"] == "generation"]
        if not rows:
            return []
        traj = self.log.load_trajectories([trajectory_id])[trajectory_id]
        tables = self.payload.read_locators(rows)
        shape = (traj["route_layers"], traj["route_topk"]) if traj["route_layers"] else None
        return facts.generations_from_log(rows, tables, shape)

    def trajectory_state(self, trajectory_id: str) -> TrajectoryState | None:
        """A trajectory's tail state (status, ``last_seq``, ...), None if unknown.

        Writers that number generations themselves (the proxy) resume from
        ``last_seq + 1``."""
        row = self.log.load_trajectories([trajectory_id]).get(trajectory_id)
        return None if row is None else facts.state_from_row(row)

    def rollout_state(self, run: str) -> "_ledger.RolloutPlan":
        """The resume plan of rollout run ``run`` (docs/reference.md "Rollout ledger"):
        ``dispatched``, ``whole``, ``open`` (oldest first, each running trajectory's
        tail) and ``dropped``, from one read of the ledger's index (never a scan of
        the log) and the last call of each running trajectory. An unknown run: an
        empty plan."""
        return _ledger.rollout_plan(run, *self.log.rollout_rows(run), lambda running: facts.last_calls(self, running))

    def info(self) -> dict[str, Any]:
        """Counts per status, event type and model version, and the number of samples."""
        return {**self.log.counts(), "samples": self.materialized.count_samples()}

    def collect_garbage(self, *, grace_s: float = 3600.0, margin_s: float | None = None,
                        lease_max_age_s: float | None = None) -> list[str]:
        """Delete payload files nothing needs any more; return their names: the
        full sweep, which lists the payload (``trajstore gc``; ``trajstore._upkeep.gc.sweep``
        says what it keeps, and the ``grace_s``, ``margin_s`` and ``lease_max_age_s``
        policy). The steady path, driven by the index's retired list without
        listing, is the materializer's GC worker."""
        from trajstore._upkeep.gc import sweep

        return sweep(self, grace_s=grace_s, margin_s=margin_s, lease_max_age_s=lease_max_age_s)

    def compact(self, *, target_bytes: int = 64 << 20, max_rounds: int | None = None) -> dict[str, int]:
        """Rewrite many small log segments into few (``trajstore._upkeep.compaction``):
        the live rows of the oldest log segments smaller than ``target_bytes / 2``
        go into one new segment of about ``target_bytes``, re-pointed in one
        transaction; the old ones are retired (``collect_garbage`` deletes them after
        its grace). Memory is bounded by one round (``target_bytes`` of payload).

        Returns ``{"rounds", "segments_retired", "events_moved", "segments_written"}``."""
        from trajstore._upkeep.compaction import compact

        return compact(self, target_bytes=target_bytes, max_rounds=max_rounds)


    # -- materialized samples ------------------------------------------------
    def materialize(
        self,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        max_trajectories: int = 256,
        max_batch_tokens: int = 262_144,
        max_steps: int | None = None,
        progress: Callable[[int], None] | None = None,
        projection: str | None = None,
    ):
        """Fold every finished trajectory not folded yet; return the metrics
        (``MaterializeStats``: num_steps_before, num_samples_after, merge_ratio, ...).

        ``shard_index``/``num_shards``: fold only this shard's trajectories;
        ``max_trajectories``: trajectories folded per step (one transaction),
        cut earlier at ``max_batch_tokens`` tokens; ``max_steps``: stop after
        that many steps (None: until nothing is pending); ``progress``: called
        with the number of trajectories each step folded; ``projection``: fold
        into that named projection instead of the default samples
        (docs/projections.md)."""
        from trajstore.materializer import Materializer

        return Materializer(self, shard_index=shard_index, num_shards=num_shards, max_trajectories=max_trajectories,
                            max_batch_tokens=max_batch_tokens, progress=progress,
                            projection=projection).run(max_steps=max_steps)

    # -- named projections (docs/projections.md) --------------------------------
    def create_projection(self, name: str, *, merge: str = "prefix", observation: str = "prompt",
                          routes: str = "first") -> dict[str, Any]:
        """Define projection ``name``: the log re-folded under ``FoldPolicy(merge,
        observation, routes)``. Materialize it with ``materialize(projection=name)``;
        read it with ``samples(projection=name)`` or ``SampleReader(..., projection=name)``."""
        import re
        import uuid

        from trajstore.fold import FoldPolicy

        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            raise ValidationError(f"projection name {name!r}: want 1-64 letters, digits, '_', '.', '-'",
                                  rule="projection")
        policy = FoldPolicy(merge, observation, routes)
        row = {"name": name, **policy.to_dict(), "token": uuid.uuid4().hex, "created_at": time.time()}
        self.materialized.create_projection(row)
        return row

    def projections(self) -> list[dict[str, Any]]:
        """Every named projection: its policy, ``num_samples``, ``num_unfoldable``."""
        return self.materialized.projections()

    def drop_projection(self, name: str) -> dict[str, int]:
        """Delete projection ``name`` and its samples; its sample segments are
        retired, and ``collect_garbage`` deletes them after its grace. Nothing
        else changes: the log, the default samples, other projections."""
        return self.materialized.drop_projection(name)

    def samples(
        self,
        *,
        status: str | Sequence[str] | None = None,
        min_model_version: int | None = None,
        max_model_version: int | None = None,
        group_id: str | None = None,
        trajectory_ids: Iterable[str] | None = None,
        page_rows: int = 256,
        batch_size: int | None = None,
        projection: str | None = None,
    ) -> Iterator[Sample]:
        """Materialized samples in their stable order (finished position, sample index).

        ``status``: one status or several; ``min_model_version`` keeps samples
        whose oldest token is at least that version, ``max_model_version``
        those whose newest token is at most that; ``group_id`` and
        ``trajectory_ids`` select by id; ``page_rows``: index rows per query
        (``batch_size`` is its old, deprecated name); ``projection``: the samples
        of that named projection (docs/projections.md). Memory stays bounded."""
        from trajstore._util.deprecated import renamed
        from trajstore.sample._codec import iter_samples

        page_rows = renamed("batch_size", "page_rows", batch_size, page_rows, 256)
        return iter_samples(self, status=status, min_model_version=min_model_version,
                            max_model_version=max_model_version, group_id=group_id,
                            trajectory_ids=trajectory_ids, page_rows=page_rows, projection=projection)

    def close(self) -> None:
        self.log.close()  # the sample index shares its engines
        self.payload.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({_safe(self.url)!r}, payload={self.payload.location!r})"



def __getattr__(name: str):
    # ``dialect_of`` (a store URL's backend) was public here; it is the backend registry's now
    if name == "dialect_of":
        warnings.warn("trajstore.store.dialect_of is deprecated; a store URL's backend is "
                      "trajstore.log._registry.backend_of (same use: make_engines, default_payload_dir)",
                      DeprecationWarning, stacklevel=2)
        return backend_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
