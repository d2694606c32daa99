"""How admitted events are laid out in the log, and how they are read back.

Writing: ``segment_table`` turns a batch's stored generations into one
payload segment (Arrow table), ``event_row`` / ``trajectory_row`` into the
SQL index records: an event row carries the outcome of the fold's step
(``sample_index``, ``is_merged``, ``prefix_len``, the route rows kept), a
trajectory row the fold's tail with admission's own state.

Reading: ``generations_from_log`` rebuilds, from index rows and segment
tables, generation commands the fold accepts: the full prompt is the previous
call's sequence (``prefix_len`` tokens of it) plus the stored tail, and the
routes are the stored rows starting at ``routes_start``. The fold gives the
same samples for these as for the commands that were sent, because the rows
admission dropped are exactly those the fold ignores (already-recorded
positions).
"""

from __future__ import annotations

import json
import time
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import pyarrow as pa

from trajstore._append.admission import Admitted, StoredGeneration, TrajectoryState, resolve_weight_versions
from trajstore.errors import CorruptStoreError, IndexInvariantError
from trajstore.events import (LOGPROB_PLACEHOLDER, Generation, GroupDropped, Reward, TrajectoryFinished, TrajectoryStarted,
                              VersionLabel)
from trajstore.fold import first_model_version
from trajstore.log.base import SAMPLES_KIND
from trajstore.schema import events as events_table
from trajstore.sample._codec import SAMPLE_LIST_COLUMNS
from trajstore.payload import SegmentRows
from trajstore.payload._columns import binary_column, list_column, routes_from_bytes

__all__ = ["last_calls", "segment_table", "event_row", "trajectory_row", "state_from_row", "generations_from_log",
           "version_spans", "weight_versions_json", "weight_versions_from_json"]


def segment_table(stored: Sequence[StoredGeneration]) -> pa.Table:
    cmds = [s.command for s in stored]
    return pa.table(
        {
            "trajectory_id": _string_column([c.trajectory_id for c in cmds]),
            "seq": pa.Array.from_buffers(pa.int32(), len(cmds),
                                         [None, pa.py_buffer(np.fromiter((c.seq for c in cmds), np.int32, len(cmds)))]),
            "prompt_tail": list_column([s.prompt_tail for s in stored], np.int32),
            "output_ids": list_column([c.output_ids for c in cmds], np.int32),
            "logprobs": list_column([c.logprobs for c in cmds], np.float32),
            "loss_mask": list_column([c.loss_mask for c in cmds], np.uint8),
            "token_rewards": list_column([c.token_rewards for c in cmds], np.float32),
            "routes": binary_column([s.routes for s in stored]),
            # null unless the call's tokens span several versions (model_version covers the rest):
            # always storing it costs 4 bytes per output token, as much as output_ids (+1016 bytes
            # for a 256-token call, 0.3% of a call with 48x8 routes); null costs ~0.
            "token_model_versions": list_column([_varying_versions(c) for c in cmds], np.int32),
        }
    )


def _string_column(values: Sequence[str]) -> pa.Array:
    """A string column built from its buffers. (``pa.array`` would import pandas
    on its first call, ~0.3 s: a service's first append paid it.)"""
    encoded = [v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, encoded), np.int32, len(encoded)), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets),
                                                             pa.py_buffer(b"".join(encoded))])


def _varying_versions(g: Generation) -> np.ndarray | None:
    tv = g.token_model_versions
    return None if tv is None or not len(tv) or tv[0] == tv[-1] else tv


def version_spans(g: Generation) -> list[dict[str, int]] | None:
    """Runs of equal versions of a call's output tokens, for SQL; None for a single version."""
    tv = _varying_versions(g)
    if tv is None:
        return None
    starts = np.concatenate([[0], np.flatnonzero(np.diff(tv)) + 1])
    counts = np.diff(np.append(starts, len(tv)))
    loss = counts if g.loss_mask is None else np.add.reduceat(g.loss_mask.astype(np.int64), starts)
    return [{"model_version": int(tv[i]), "num_tokens": int(n), "num_loss_tokens": int(l)}
            for i, n, l in zip(starts, counts, loss)]


def weight_versions_json(g: Generation) -> list[dict[str, Any]] | None:
    """The spans as the index stores them: what was sent, labels verbatim."""
    if g.weight_versions is None:
        return None
    return [{"version": label, "start": start, "end": end} for label, start, end in g.weight_versions]


def weight_versions_from_json(value: Any) -> tuple[tuple[str | int, int, int], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):  # driver SQL on SQLite returns the JSON text
        value = json.loads(value)
    return tuple((span["version"], int(span["start"]), int(span["end"])) for span in value)


_EVENT_COLUMNS = tuple(c.name for c in events_table.columns if c.name != "position")
_EVENT_ROW = dict.fromkeys(_EVENT_COLUMNS)
"""An event row with every column None: each row is a copy (executemany takes its column list from the first row)."""


def event_row(adm: Admitted, identity: str | None, content_hash: bytes, segment_row: int | None) -> dict[str, Any]:
    ev = adm.event
    # Every row carries every column: a copy of the all-None row, its columns set one by one
    # (a dict per row of 224 a round: no keyword dicts merged in)
    row = _EVENT_ROW.copy()
    row["trajectory_id"] = ev.trajectory_id
    row["type"] = ev.type
    row["event_id"] = ev.event_id
    row["identity"] = identity
    row["content_hash"] = content_hash
    row["created_at"] = time.time()
    if type(ev) is Generation or isinstance(ev, Generation):
        s = adm.stored
        assert s is not None
        routes, sent, logprobs = s.routes, ev.routed_experts, ev.logprobs
        row["seq"] = ev.seq
        row["model_version"] = ev.model_version
        row["prompt_len"] = len(ev.prompt_ids)
        row["prefix_len"] = s.prefix_len
        row["output_len"] = n_out = len(ev.output_ids)
        row["num_loss_tokens"] = int(ev.loss_mask.sum()) if ev.loss_mask is not None else n_out
        row["sample_index"] = s.sample_index
        row["is_merged"] = s.merged
        if routes is not None:
            row["routes_start"] = s.routes_start
            row["num_route_rows"] = len(routes)
            row["routes_dtype"] = routes.dtype.name
        if sent is not None:
            row["num_route_rows_sent"] = len(sent)
        row["reward"] = ev.reward
        row["has_token_rewards"] = ev.token_rewards is not None
        row["finish_reason"] = ev.finish_reason
        row["segment_row"] = segment_row
        row["min_model_version"] = first_model_version(ev)
        row["version_spans"] = version_spans(ev)
        if ev.metadata is not None:
            row["metadata"] = dict(ev.metadata)
        if ev.weight_versions is not None:
            row["weight_versions"] = weight_versions_json(ev)
        row["route_rows_resent"] = s.route_rows_resent
        row["route_rows_drifted"] = s.route_rows_drifted
        if logprobs is not None:
            row["num_placeholder_logprobs"] = int(np.count_nonzero(logprobs <= LOGPROB_PLACEHOLDER))
        # not a column: the log adds an unresolved_labels row per label
        row["unresolved_labels"] = s.unresolved
    elif isinstance(ev, GroupDropped):  # the log keeps what it said (ledger_groups keeps the drop)
        row["metadata"] = {"run": ev.run, "group_id": ev.group_id, "reason": ev.reason}
    elif isinstance(ev, VersionLabel):
        row["model_version"] = ev.model_version
        row["version_label"] = ev.label  # not a column: the log adds the version_labels row
    elif isinstance(ev, Reward):
        row["reward"] = ev.reward
    elif isinstance(ev, TrajectoryFinished):
        row["status"] = ev.status
    return row


def trajectory_row(state: TrajectoryState, started: TrajectoryStarted | None) -> dict[str, Any]:
    now = time.time()
    row: dict[str, Any] = {
        "trajectory_id": state.trajectory_id,
        "status": state.status,
        "revision": state.revision,
        "last_seq": state.last_seq,
        "reward_mode": state.reward_mode,
        "route_layers": state.route_layers,
        "route_topk": state.route_topk,
        "seq_len": state.seq_len,
        "seq_hash": state.seq_hash,
        "route_len": state.route_len,
        "reward": state.reward,
        "num_samples": state.num_samples,
        "updated_at": now,
    }
    if started is not None:
        row.update(
            group_id=started.group_id,
            num_experts=started.num_experts,
            metadata=dict(started.metadata),
            created_at=now,
        )
    return row


def state_from_row(row: Mapping[str, Any]) -> TrajectoryState:
    return TrajectoryState(
        trajectory_id=row["trajectory_id"],
        group_id=row["group_id"],
        num_experts=row["num_experts"],
        status=row["status"],
        revision=row["revision"],
        last_seq=row["last_seq"],
        reward_mode=row["reward_mode"],
        route_layers=row["route_layers"],
        route_topk=row["route_topk"],
        seq_len=row["seq_len"],
        seq_hash=bytes(row["seq_hash"]),
        route_len=row["route_len"],
        reward=row["reward"],
        num_samples=row["num_samples"],
    )


def generations_from_log(
    rows: Sequence[Mapping[str, Any]],
    tables: Mapping[str, SegmentRows],
    route_shape: tuple[int, int] | None,
    labels: Mapping[str, int] | None = None,
    held: Collection[int] | None = None,
) -> list[Generation]:
    """Rebuild one trajectory's generation commands from its index rows (seq order).

    ``held``: the positions of the calls whose ``weight_versions`` did not
    resolve when they were appended (``EventLog.held_generations``). Each gets
    its per-token versions here from its spans and ``labels``, which must map
    every label those spans name (the ones that were mapped at admission too:
    a call is held whole, whatever part of it did resolve); a label missing
    there is the store's own fault (``IndexInvariantError``), never a guess.
    Every other call keeps the versions admission decided. With ``labels``
    None only the tokens are wanted: held calls keep the ``model_version``
    they were sent with (the materializer folds a trajectory only once every
    label is mapped). ``held`` None (older callers): every call with spans and
    no stored per-token versions is resolved where ``labels`` allow.

    A row's payload is either its own row of a log segment (``segment_kind``
    NULL) or, once the materializer re-pointed it, slices of the sample row it
    was folded into (``segment_kind = 'samples'``, see ``_payload_of``); both
    give the same arrays, so re-folding gives byte-identical samples."""
    out: list[Generation] = []
    previous = _NO_IDS
    for row in rows:
        tail, output, logprobs, loss_mask, token_rewards, versions, raw = _payload_of(tables, row)
        prefix = int(row["prefix_len"])
        if prefix > len(previous):
            raise CorruptStoreError(
                f"trajectory {row['trajectory_id']!r} seq {row['seq']}: prefix_len {prefix} exceeds the sequence"
            )
        prompt = np.concatenate([previous[:prefix], tail]) if prefix else tail
        spans = row.get("weight_versions")
        g = Generation(
            trajectory_id=row["trajectory_id"],
            seq=row["seq"],
            prompt_ids=prompt,
            output_ids=output,
            model_version=row["model_version"],
            logprobs=logprobs,
            loss_mask=loss_mask,
            routed_experts=_routes(raw, row, route_shape),
            routed_experts_start=row["routes_start"] or 0,
            reward=row["reward"],
            token_rewards=token_rewards,
            finish_reason=row["finish_reason"],
            event_id=row["event_id"],
            token_model_versions=versions,
            metadata=row.get("metadata"),
            weight_versions=None if spans is None else weight_versions_from_json(spans),
        )
        if labels is not None and g.weight_versions is not None and g.token_model_versions is None:
            if held is None:
                g = resolve_weight_versions(g, labels)[0]
            elif row["position"] in held:
                g, missing = resolve_weight_versions(g, labels)
                if missing:
                    raise IndexInvariantError(
                        f"trajectory {row['trajectory_id']!r} seq {row['seq']}: folded while version label "
                        f"{missing[0]!r} of its weight_versions is not in the label map")
        out.append(g)
        previous = np.concatenate([prompt, output])
    return out


_NO_IDS = np.zeros(0, dtype=np.int32)
_NO_IDS.flags.writeable = False


def _payload_of(tables: Mapping[str, SegmentRows], row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A row's payload arrays: prompt tail, output ids, logprobs, loss mask, token rewards,
    token versions (None: not stored), routes (raw bytes, or rows sliced from a sample row)."""
    seg = tables[row["segment"]]
    i = seg.index[int(row["segment_row"])]  # each column is decoded once per segment, then indexed
    if row.get("segment_kind") == SAMPLES_KIND:
        cols = _sample_slices(seg, i, row)
        return (cols["prompt_tail"], cols["output_ids"], cols["logprobs"], cols["loss_mask"], cols["token_rewards"],
                cols["token_model_versions"], cols["routes"])
    # segments written before per-token versions existed have no such column
    if seg.has("token_model_versions"):
        tails, outputs, logprobs, masks, rewards, versions = seg.lists_of(_LOG_SPEC_VERSIONS)
        tv = versions[i]
    else:
        tails, outputs, logprobs, masks, rewards = seg.lists_of(_LOG_SPEC)
        tv = None
    return tails[i], outputs[i], logprobs[i], masks[i], rewards[i], tv, seg.binaries("routes")[i]


_LIST_DTYPES = {
    "prompt_tail": np.int32,
    "output_ids": np.int32,
    "logprobs": np.float32,
    "loss_mask": np.uint8,
    "token_rewards": np.float32,
}

# the sample columns an event's slices come from (a sample segment's own column types)
_SAMPLE_SLICE_DTYPES = {name: SAMPLE_LIST_COLUMNS[name] for name in (
    "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "logprobs_mask", "token_model_versions",
    "token_rewards")}


_LOG_SPEC = tuple(_LIST_DTYPES.items())
_LOG_SPEC_VERSIONS = _LOG_SPEC + (("token_model_versions", np.int32),)


def _sample_slices(seg: SegmentRows, i: int, row: Mapping[str, Any]) -> dict[str, Any]:
    """An event's payload as slices of the sample row (row ``i`` of ``seg``'s table) it was folded into.

    Every prompt of a sample starts at the sample's first token, so in
    ``prompt_ids ++ response_ids`` the event's prompt tail is ``[prefix_len,
    prompt_len)``, its output the next ``output_len`` tokens (response
    positions ``prompt_len - P`` on), its routes rows ``[routes_start,
    routes_start + num_route_rows)``. What the fold filled in for an event
    that sent nothing is told apart by SQL (``has_token_rewards``,
    ``version_spans``) and by the sample's ``logprobs_mask``."""
    a = {name: seg.lists(name, dt)[i] for name, dt in _SAMPLE_SLICE_DTYPES.items() if seg.has(name)}
    prompt, response = a["prompt_ids"], a["response_ids"]
    p = len(prompt)
    prefix, plen, olen = int(row["prefix_len"]), int(row["prompt_len"]), int(row["output_len"])
    if plen < p or plen + olen > p + len(response) or prefix > plen:
        raise CorruptStoreError(f"trajectory {row['trajectory_id']!r} seq {row['seq']}: its slices "
                                f"[{prefix}, {plen + olen}) do not fit sample row {row['segment_row']} "
                                f"of {row['segment']!r} ({p} + {len(response)} tokens)")
    out = slice(plen - p, plen - p + olen)
    if plen <= p:
        tail = prompt[prefix:plen]
    elif prefix >= p:
        tail = response[prefix - p : plen - p]
    else:
        tail = np.concatenate([prompt[prefix:], response[: plen - p]])
    lp_mask = a.get("logprobs_mask")
    logprobs = a["rollout_logprobs"][out]
    if lp_mask is None:  # segments from before logprobs_mask
        logprobs = logprobs if np.any(logprobs) else None
    elif lp_mask[out].any():
        # the placeholders the engine sent (stored as missing) come back as placeholders: a re-fold agrees
        logprobs = np.where(lp_mask[out], logprobs, np.float32(LOGPROB_PLACEHOLDER))
    else:
        logprobs = None  # sent none, or only placeholders: both fold to missing
    cols: dict[str, Any] = {
        "prompt_tail": tail,
        "output_ids": response[out],
        "logprobs": logprobs,
        "loss_mask": a["loss_mask"][out],
        "token_rewards": a["token_rewards"][out] if row["has_token_rewards"] else None,
        # per-token versions of a call that spanned several, or whose spans resolved only at its fold
        "token_model_versions": a["token_model_versions"][out]
        if row.get("version_spans") is not None or row.get("weight_versions") is not None else None,
        "routes": None,
    }
    if row["routes_dtype"] is not None:
        raw = seg.binaries("routed_experts")[i]
        dtype = seg.values("routes_dtype")[i]
        layers, topk = seg.values("route_layers")[i], seg.values("route_topk")[i]
        if raw is None or dtype is None:
            raise CorruptStoreError(f"trajectory {row['trajectory_id']!r} seq {row['seq']}: sample row "
                                    f"{row['segment_row']} of {row['segment']!r} has no routes")
        routes = routes_from_bytes(raw, dtype, layers, topk)
        start, n = int(row["routes_start"]), int(row["num_route_rows"])
        if start + n > len(routes):
            raise CorruptStoreError(f"trajectory {row['trajectory_id']!r} seq {row['seq']}: route rows "
                                    f"[{start}, {start + n}) beyond the sample's {len(routes)}")
        # the dtype the event was sent with (the sample's may be narrower; the values fit)
        cols["routes"] = routes[start : start + n].astype(np.dtype(row["routes_dtype"]).newbyteorder("<"), copy=False)
    return cols


def _routes(raw: Any, row: Mapping[str, Any], shape: tuple[int, int] | None) -> np.ndarray | None:
    if raw is None or row["routes_dtype"] is None:
        return None
    if isinstance(raw, np.ndarray) and raw.ndim == 3:  # already sliced from a sample row
        return raw
    if shape is None:
        raise CorruptStoreError(f"trajectory {row['trajectory_id']!r} has routes but no [layers, topk]")
    return routes_from_bytes(raw, row["routes_dtype"], *shape, rows=row["num_route_rows"])


def last_calls(store: Any, running: Sequence[tuple[str, int]]) -> dict[str, tuple[np.ndarray, Generation | None]]:
    """The last recorded call of each running ``(trajectory_id, last_seq)`` of ``store``
    (a ``Store``: the rollout ledger's tails), rebuilt from the log: its prompt and output as one int32 array, and
    the call. One read of their events, one read of the payload they name."""
    ids = [tid for tid, _ in running]
    by_tid = store.log.trajectory_events(ids)
    rows = {tid: [r for r in by_tid.get(tid, ()) if r["type"] == "generation"] for tid in ids}
    wanted = [r for tid in ids for r in rows[tid]]
    tables = store.payload.read_locators(wanted) if wanted else {}
    trajs = store.log.load_trajectories([tid for tid in ids if rows[tid]])
    out: dict[str, tuple[np.ndarray, Generation | None]] = {}
    for tid in ids:
        if not rows[tid]:
            continue
        traj = trajs[tid]
        shape = (traj["route_layers"], traj["route_topk"]) if traj["route_layers"] else None
        last = generations_from_log(rows[tid], tables, shape)[-1]
        tokens = np.concatenate([last.prompt_ids, last.output_ids]).astype(np.int32, copy=False)
        out[tid] = (tokens, last)
    return out
