"""Retention: folded trajectories' events leave the index for a Parquet archive.

``trajstore archive DIR`` (``archive_events``) keeps the event index of a
long run bounded (docs/deploy.md, "Index growth"). Batch by batch:

1. pick finished trajectories folded by every shard of the default fold and
   by every named projection (``log/_retention.py``); a projection whose
   checkpoint has not passed them is named and the command refuses
   (``--skip-lagging``: archive only what every projection folded);
2. rebuild their events as wire-format events (the payload is read where it
   lives: the sample rows the events were folded into) and write them, whole,
   to ``DIR/part-<digest>.parquet``: a temporary file, fsynced, renamed, the
   directory fsynced. The name is a digest of the archived positions, so a
   re-run of the same batch replaces the file with the same content;
3. only then, in one index transaction: mark the ``trajectories`` rows
   ``archived_at``, delete exactly the archived ``events`` rows, retire the log
   segments left without a row (``trajstore gc`` frees them).

A crash between 2 and 3 leaves the file and every row: the next run archives
the same trajectories again (same file, or a second copy: ``restore_archive``
drops repeated events as idempotent retries). A failed or uncertain step 3
deletes nothing it did not commit; the file stays. Samples, sample segments,
``trajectories`` rows and lineage stay in the store.

``restore_archive`` appends an archive's events to a store (normally a new
one) through ``Store.append``; folding them gives the same samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trajstore._append import facts
from trajstore.errors import ContentionError, TrajstoreError, ValidationError
from trajstore.events import decimal_label
from trajstore.log._retention import ARCHIVED_TYPES, SqlRetention
from trajstore.log.base import StaleState
from trajstore.payload._durable import fsync_path, replace_durably
from trajstore.payload._errors import payload_errors

__all__ = ["ARCHIVE_SCHEMA", "ArchiveBatch", "LaggingProjections", "archive_events", "archive_files", "restore_archive"]

log = logging.getLogger(__name__)

FORMAT = "trajstore-archive/1"
MAX_STALE_BATCHES = 5  # batches in a row whose drop lost a race before the command gives up

# A generation's arrays: raw little-endian bytes in a binary column each; the event's JSON
# names each one present as {"dtype", "shape"} under the same key.
ARRAY_FIELDS = ("prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards", "token_model_versions",
                "routed_experts")

ARCHIVE_SCHEMA = pa.schema([
    pa.field("position", pa.int64()),  # the event's position in the source store; null for version_label rows
    pa.field("trajectory_id", pa.string()),
    pa.field("type", pa.string()),
    pa.field("seq", pa.int32()),
    pa.field("event_id", pa.string()),
    pa.field("event", pa.string()),  # the wire-format event, JSON, without its arrays' bytes
    *[pa.field(name, pa.large_binary()) for name in ARRAY_FIELDS],
], metadata={b"format": FORMAT.encode()})


class LaggingProjections(TrajstoreError):
    """A named projection has not folded trajectories the default fold has: they stay."""


@dataclass(frozen=True)
class ArchiveBatch:
    """What one batch did (or, with ``dry_run``, would do)."""

    path: str | None
    trajectories: int
    events: int
    last_position: int


def _wire_generation(g: Any, arrays: dict[str, bytes]) -> dict[str, Any]:
    """The generation as a wire event; its arrays' bytes go to ``arrays``, their dtype and shape in the event."""
    ev: dict[str, Any] = {"type": "generation", "trajectory_id": g.trajectory_id, "seq": int(g.seq)}
    if g.model_version is not None:
        ev["model_version"] = int(g.model_version)
    for key in ARRAY_FIELDS:
        value = getattr(g, key)
        if value is not None:
            le = np.ascontiguousarray(value)
            le = le.astype(le.dtype.newbyteorder("<"), copy=False)
            ev[key] = {"dtype": le.dtype.name, "shape": list(le.shape)}
            arrays[key] = le.tobytes()
    if g.routed_experts is not None:
        ev["routed_experts_start"] = int(g.routed_experts_start)
    for key in ("reward", "finish_reason", "event_id"):
        value = getattr(g, key)
        if value is not None:
            ev[key] = value
    if g.metadata is not None:
        ev["metadata"] = dict(g.metadata)
    if g.weight_versions is not None:
        ev["weight_versions"] = [{"version": v, "start": int(s), "end": int(e)} for v, s, e in g.weight_versions]
    return ev


def _wire_events(store: Any, ids: Sequence[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
    """The archive rows of these trajectories (index order), the version labels they use, and the
    segments their rows named."""
    rows_by = store.log.trajectory_events(ids)
    trajs = store.log.load_trajectories(ids)
    gen_rows = [r for t in ids for r in rows_by[t] if r["type"] == "generation"]
    tables = store.payload.read_locators(gen_rows)
    out: list[dict[str, Any]] = []
    labels: set[str] = set()
    segments: set[str] = set()
    for t in ids:
        rows = [r for r in rows_by[t] if r["type"] in ARCHIVED_TYPES]
        traj = trajs[t]
        shape = (traj["route_layers"], traj["route_topk"]) if traj["route_layers"] else None
        gens = iter(facts.generations_from_log([r for r in rows if r["type"] == "generation"], tables, shape))
        for r in rows:
            if r["segment"] is not None:
                segments.add(r["segment"])
            kind = r["type"]
            arrays: dict[str, bytes] = {}
            if kind == "generation":
                ev = _wire_generation(next(gens), arrays)
                for span in ev.get("weight_versions", ()):
                    label = span["version"]
                    if isinstance(label, str) and label != "default" and decimal_label(label) is None:
                        labels.add(label)
            elif kind == "trajectory_started":
                ev = {"type": kind, "trajectory_id": t, "metadata": traj["metadata"] or {}}
                if traj["group_id"] is not None:
                    ev["group_id"] = traj["group_id"]
                if traj["num_experts"] is not None:
                    ev["num_experts"] = int(traj["num_experts"])
            elif kind == "reward":
                ev = {"type": kind, "trajectory_id": t, "reward": r["reward"]}
            elif kind == "trajectory_finished":
                ev = {"type": kind, "trajectory_id": t, "status": r["status"]}
            else:  # RELEASED: the store's own event, re-made by the store that maps the labels
                ev = None
            if ev is not None and kind != "generation" and r["event_id"] is not None:
                ev["event_id"] = r["event_id"]
            out.append({"position": int(r["position"]), "trajectory_id": t, "type": kind,
                        "seq": r["seq"], "event_id": r["event_id"],
                        "event": None if ev is None else json.dumps(ev, separators=(",", ":")), **arrays})
    return out, [{"label": lb} for lb in sorted(labels)], segments


def _label_rows(store: Any, labels: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    mapped = store.log.load_labels([r["label"] for r in labels])
    return [{"position": None, "trajectory_id": "", "type": "version_label", "seq": None, "event_id": None,
             "event": json.dumps({"type": "version_label", "label": lb, "model_version": int(v)},
                                 separators=(",", ":"))}
            for lb, v in sorted(mapped.items())]


def _write_part(out_dir: str, rows: list[dict[str, Any]], positions: Sequence[int]) -> str:
    digest = hashlib.sha256(np.asarray(sorted(positions), dtype="<i8").tobytes()).hexdigest()[:24]
    path = os.path.join(out_dir, f"part-{digest}.parquet")
    table = pa.Table.from_arrays([pa.array([r.get(f.name) for r in rows], type=f.type) for f in ARCHIVE_SCHEMA],
                                 schema=ARCHIVE_SCHEMA)

    def write(tmp: str) -> None:
        # unique values (events, arrays) gain nothing from dictionary encoding, which would cost most of the write
        pq.write_table(table, tmp, compression="zstd", use_dictionary=["trajectory_id", "type"])
        fsync_path(tmp)

    with payload_errors("cannot write archive file", path, corrupt="archive file"):
        replace_durably(path, out_dir, write)
        back = pq.read_table(path, columns=["position"]).column("position").drop_null().to_numpy()
    if sorted(back.tolist()) != sorted(positions):  # what the index loses must be in the file
        raise TrajstoreError(f"archive file {path} does not read back the {len(positions)} events written")
    return path


def archive_events(store: Any, out_dir: str, *, before_position: int | None = None,
                   older_than_s: float | None = 3600.0, skip_lagging: bool = False, dry_run: bool = False,
                   batch_trajectories: int = 100,
                   on_batch: Callable[[ArchiveBatch], None] | None = None) -> dict[str, Any]:
    """Archive the events of folded trajectories to ``out_dir`` and drop their index rows.

    Returns ``{"trajectories", "events", "files", "skipped_for": {projection: checkpoint}}``.
    Raises ``LaggingProjections`` naming every projection that has not folded
    trajectories the default fold has (nothing archived), unless ``skip_lagging``."""
    if batch_trajectories < 1:
        raise ValidationError(f"batch_trajectories must be >= 1, got {batch_trajectories}", rule="archive")
    retention = SqlRetention(store.log.db)
    default, projections = retention.horizons()
    updated_before = None if older_than_s is None else time.time() - older_than_s

    def pick(horizon: int, limit: int) -> list[tuple[str, int]]:
        return retention.candidates(horizon=horizon, before_position=before_position,
                                    updated_before=updated_before, limit=limit)

    lowest = min([default, *projections.values()])
    skipped: dict[str, int] = {}
    if lowest < default:
        # would the default fold's horizon take trajectories a projection still needs?
        beyond = [c for c in pick(default, 1 << 62) if c[1] > lowest]
        if beyond:
            need = max(c[1] for c in beyond)
            skipped = {n: h for n, h in sorted(projections.items()) if h < need}
            if not skip_lagging:
                names = ", ".join(f"{n!r} (checkpoint {h})" for n, h in skipped.items())
                raise LaggingProjections(
                    f"projection{'s' if len(skipped) > 1 else ''} {names} still need{'' if len(skipped) > 1 else 's'} "
                    f"the events of {len(beyond)} folded trajectories (up to position {need}): run trajstore "
                    "materialize --projection NAME first, or pass --skip-lagging to archive only what every "
                    "projection folded")
    horizon = lowest
    total = {"trajectories": 0, "events": 0, "files": [], "skipped_for": skipped}
    if not dry_run:
        with payload_errors("cannot make archive directory", out_dir):
            os.makedirs(out_dir, exist_ok=True)
            fsync_path(os.path.dirname(os.path.abspath(out_dir)))
    seen: set[str] = set()
    stale = 0
    while True:
        batch = [c for c in pick(horizon, batch_trajectories + len(seen) if dry_run else batch_trajectories)
                 if c[0] not in seen]
        if not batch:
            break
        ids = [t for t, _ in batch]
        rows, labels, segs = _wire_events(store, ids)
        positions = [r["position"] for r in rows]
        last = max(c[1] for c in batch)
        path = None
        if dry_run:
            seen.update(ids)
        else:
            path = _write_part(out_dir, _label_rows(store, labels) + rows, positions)
            try:
                retention.drop_archived(ids, positions, segs, time.time())
            except StaleState as e:
                # another run archived some of them first, or an event arrived after the file
                # was written: nothing was deleted; pick again (the file stays, restore drops repeats)
                stale += 1
                if stale > MAX_STALE_BATCHES:
                    raise ContentionError(f"archive: {stale} batches in a row lost a race with other writers "
                                          f"({e}); nothing of them was deleted, run it again") from None
                log.info("archive batch picked again: %s", e)
                continue
            stale = 0
            total["files"].append(path)
        total["trajectories"] += len(ids)
        total["events"] += len(rows)
        if on_batch is not None:
            on_batch(ArchiveBatch(path, len(ids), len(rows), last))
    return total


def _archive_file(path: str) -> pq.ParquetFile:
    with payload_errors("cannot read archive file", path, corrupt="archive file"):
        f = pq.ParquetFile(path)
    if (f.schema_arrow.metadata or {}).get(b"format") != FORMAT.encode():
        raise ValidationError(f"{path} is not a trajstore event archive (format {FORMAT})", rule="archive")
    return f


def _archive_rows(path: str) -> list[dict[str, Any]]:
    f = _archive_file(path)
    with payload_errors("cannot read archive file", path, corrupt="archive file"):
        return f.read().to_pylist()


def _event_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """The wire event of an archive row, its arrays as numpy (zero-copy views of the column bytes)."""
    ev = json.loads(row["event"])
    for key in ARRAY_FIELDS:
        spec = ev.get(key)
        if spec is not None:
            raw = row.get(key)
            if raw is None:
                raise ValidationError(f"archive row at position {row['position']}: {key} has no bytes", rule="archive")
            ev[key] = np.frombuffer(raw, dtype=np.dtype(spec["dtype"]).newbyteorder("<")).reshape(spec["shape"])
    return ev


def archive_files(archive_dir: str) -> list[str]:
    if not os.path.isdir(archive_dir):
        raise ValidationError(f"archive {archive_dir!r} is not a directory", rule="archive")
    return sorted(os.path.join(archive_dir, n) for n in os.listdir(archive_dir)
                  if n.startswith("part-") and n.endswith(".parquet"))


def restore_archive(store: Any, archive_dir: str, *, batch_events: int = 512,
                    on_batch: Callable[[int], None] | None = None) -> dict[str, int]:
    """Append the events of the archive in ``archive_dir`` to ``store``: the label
    map's entries first, then whole trajectories in the order they finished in the
    source store (their last positions), each one's events in their original order,
    so the folds come out in the same order. Events repeated across files (a run
    that crashed after writing its file) are idempotent retries, appended once.
    Memory: the archive's (trajectory, position) pairs and two files' rows.
    Returns ``{"events", "trajectories"}`` appended."""
    paths = archive_files(archive_dir)
    last: dict[str, tuple[int, str]] = {}  # trajectory -> (its last position, a file holding it)
    labels: dict[str, str] = {}
    for path in paths:
        f = _archive_file(path)
        with payload_errors("cannot read archive file", path, corrupt="archive file"):
            cols = f.read(columns=["position", "trajectory_id", "type", "event"]).to_pydict()
        for pos, tid, kind, ev in zip(cols["position"], cols["trajectory_id"], cols["type"], cols["event"]):
            if kind == "version_label":
                labels[json.loads(ev)["label"]] = ev
            elif tid not in last or pos > last[tid][0]:
                last[tid] = (pos, path)
    if labels:
        store.append([json.loads(e) for _, e in sorted(labels.items())])
    cache: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def events_of(tid: str, path: str) -> list[dict[str, Any]]:
        if path not in cache:
            if len(cache) >= 2:
                cache.pop(next(iter(cache)))
            by: dict[str, dict[int, dict[str, Any]]] = {}
            for r in _archive_rows(path):
                if r["type"] != "version_label" and r["event"] is not None:
                    by.setdefault(r["trajectory_id"], {})[int(r["position"])] = r
            cache[path] = {t: [rows[p] for p in sorted(rows)] for t, rows in by.items()}
        return [_event_of(r) for r in cache[path][tid]]

    batch: list[dict[str, Any]] = []
    done = 0
    for tid in sorted(last, key=lambda t: (last[t][0], t)):
        evs = events_of(tid, last[tid][1])
        if batch and len(batch) + len(evs) > batch_events:
            store.append(batch)
            done += len(batch)
            if on_batch is not None:
                on_batch(done)
            batch = []
        batch.extend(evs)
    if batch:
        store.append(batch)
        done += len(batch)
        if on_batch is not None:
            on_batch(done)
    return {"events": done, "trajectories": len(last)}
