"""One trajectory, token by token: the report's trace view.

``trace_data(query, trajectory_id, payload=...)`` gathers, in the caller's
read-only snapshot, what the store has on one trajectory: its summary row, its
engine calls (``generation_events``), and its merged samples with their token
columns read from the sample segments, plus the newest standing
``trainer_logprobs`` annotation of each sample. Every per-token figure is a
numpy array; each colour channel is turned into a palette index per token
(``-1``: no value) with ``np.digitize``, and the page (``trace_page``) paints
the spans from those indexes with ``textContent`` and ``style``, never markup,
so whatever a token id, an id or a metadata value holds renders inertly.

Channels (docs/report.md "The trace view"):

- ``logprob``: the engine's rollout logprob of each generated token;
- ``trainer``: the trainer's recomputed logprob (``sample_annotation``);
- ``mismatch``: trainer − rollout logprob (the r of the k3 panels);
- ``version``: the model version that generated the token;
- ``drift``: route drift as admission measured it. The store keeps the first
  recording of each position's route (R3) and drops the rows a later merged
  call re-sends; admission compares them and records per call how many were
  re-sent (``route_rows_resent``) and how many differ in any entry
  (``route_rows_drifted``). Which rows moved is not kept, so per position the
  view shows the calls that re-sent its route row and the share of their
  re-sent rows that moved (0: re-sent and all equal).
- ``call``: which engine call generated (or, for observation tokens, read) it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any, Sequence

import numpy as np

from trajstore.errors import CorruptStoreError, StoreUnavailable, TrajstoreError
from trajstore.inspect._routes import routes_view

__all__ = ["MAX_TRACE_TOKENS", "load_tokenizer", "trace_data", "trace_page", "trace_file_name", "sql_string"]

MAX_TRACE_TOKENS = 200_000
"""Token spans the view draws per trajectory at most (the rest is counted, not drawn)."""

LOGPROB_EDGES = (-8.0, -4.0, -2.0, -1.0, -0.5, -0.2, -0.05)
LOGPROB_COLORS = ("#b2182b", "#d6604d", "#f4a582", "#fddbc7", "#f7f7f7", "#d1e5f0", "#92c5de", "#4393c3")
RATIO_EDGES = (-1.0, -0.3, -0.1, -0.03, 0.03, 0.1, 0.3, 1.0)
RATIO_COLORS = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")
DRIFT_EDGES = (1e-12, 0.01, 0.05, 0.2)
DRIFT_COLORS = ("#a1d99b", "#fee0d2", "#fc9272", "#ef3b2c", "#99000d")
CATEGORY_COLORS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
                   "#bc80bd", "#ccebc5", "#ffed6f", "#d9d9d9")


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal (quotes doubled): the page shows the SQL as it ran."""
    if not isinstance(value, str) or "\x00" in value:
        raise TrajstoreError(f"a trajectory id is a string without NUL characters, got {value!r}")
    return "'" + value.replace("'", "''") + "'"


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer that decodes the view's token ids: a Hugging Face ``tokenizer.json`` (or a
    directory holding one, a model's), loaded with the ``tokenizers`` package. None: show ids."""
    import os

    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TrajstoreError("--tokenizer needs the tokenizers package: pip install tokenizers") from None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TrajstoreError(f"--tokenizer {path}: no tokenizer.json at {file}")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception types: one line
        raise TrajstoreError(f"--tokenizer {path}: cannot load {file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def trace_file_name(trajectory_id: str) -> str:
    """The static trace page's file name: the id's safe characters and a digest (ids may hold anything)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", trajectory_id)[:80]
    return f"trace-{safe}-{hashlib.sha256(trajectory_id.encode()).hexdigest()[:10]}.html"


def trace_sql(trajectory_id: str) -> list[str]:
    t = sql_string(trajectory_id)
    return [
        "SELECT trajectory_id, group_id, status, num_generations, num_samples, num_generated_tokens, "
        "num_observed_tokens, reward, min_model_version, max_model_version, finish_reasons, first_event_at, "
        f"last_event_at, route_rows_resent, route_rows_drifted, route_drift_share FROM trajectory_summary "
        f"WHERE trajectory_id = {t}",
        "SELECT seq, sample_index, is_merged, prompt_len, prefix_len, output_len, model_version, min_model_version, "
        "finish_reason, routes_start, num_route_rows_sent, num_route_rows_stored, route_rows_resent, "
        "route_rows_drifted, reward, created_at, metadata "
        f"FROM generation_events WHERE trajectory_id = {t} ORDER BY seq",
        "SELECT sample_index, segment, segment_row, prompt_len, response_len, reward, finish_reason, "
        f"min_model_version, max_model_version FROM samples WHERE trajectory_id = {t} ORDER BY sample_index",
        # the newest standing annotation with trainer logprobs of each sample
        "SELECT a.sample_index, a.run, a.step, a.attempt, a.segment, a.segment_row FROM lineage_annotations a "
        f"WHERE a.trajectory_id = {t} AND a.has_trainer_logprobs AND a.segment IS NOT NULL "
        "AND a.attempt = (SELECT max(b.attempt) FROM lineage_annotations b WHERE b.run = a.run AND b.step = a.step "
        "AND b.trajectory_id = a.trajectory_id AND b.sample_index = a.sample_index) "
        "ORDER BY a.sample_index, a.step DESC, a.run",
        f"SELECT metadata FROM trajectories WHERE trajectory_id = {t}",
    ]


# -- reading payload rows without the store's PayloadStore (it writes on open) -----------

def _filesystem(payload: str) -> tuple[Any, str]:
    from urllib.parse import urlparse

    import pyarrow.fs as pafs

    parsed = urlparse(payload)
    if parsed.scheme and len(parsed.scheme) > 1 and parsed.scheme != "file":
        return pafs.FileSystem.from_uri(payload)
    return pafs.LocalFileSystem(), (parsed.path if parsed.scheme == "file" else payload)


def read_segment_rows(payload: str, segment: str, rows: Sequence[int]) -> tuple[Any, dict[int, int]]:
    """``(table, index)``: the record batches of ``segment`` holding ``rows``, and each
    wanted row's place in ``table``. Reads only; Arrow IPC (log and sample segments) or Parquet."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from trajstore.payload._errors import payload_errors
    from trajstore.payload._format import SegmentKind

    wanted = sorted({int(r) for r in rows})
    with payload_errors("cannot read payload segment", f"{payload.rstrip('/')}/{segment}",
                        missing="payload segment", corrupt="payload segment"):
        fs, root = _filesystem(payload)
        with fs.open_input_file(f"{root.rstrip('/')}/{segment}") as f:
            if SegmentKind.of(segment) is SegmentKind.SAMPLES_PARQUET:
                table = pq.read_table(f)
                return table, {w: w for w in wanted}
            reader = ipc.open_file(f)
            per = int((reader.schema.metadata or {}).get(b"trajstore.rows_per_batch", 0)) or None
            if per is None:
                return reader.read_all(), {w: w for w in wanted}
            numbers = sorted({w // per for w in wanted})
            batches = [reader.get_batch(b) for b in numbers]
            starts, at = {}, 0
            for b, batch in zip(numbers, batches):
                starts[b], at = at, at + batch.num_rows
            return pa.Table.from_batches(batches, schema=reader.schema), {w: starts[w // per] + w % per for w in wanted}


# -- per-token channels ---------------------------------------------------------------------

def _bins(values: np.ndarray, valid: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Palette index of each value (``np.digitize`` over ``edges``), -1 where not ``valid``."""
    out = np.digitize(values, np.asarray(edges, np.float64)).astype(np.int16)
    out[~valid] = -1
    return out


def _drift_per_position(calls: list[dict], sample_index: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per route row position of sample ``sample_index`` (``n`` positions): the calls that re-sent
    it with drift measured, their re-sent rows and how many of those moved (difference arrays,
    one ``cumsum``; a loop over calls, not tokens)."""
    calls_diff = np.zeros(n + 1, np.int64)
    rows_diff = np.zeros(n + 1, np.int64)
    moved_diff = np.zeros(n + 1, np.int64)
    for c in calls:
        resent, drifted, kept = c["route_rows_resent"], c["route_rows_drifted"], c["num_route_rows_stored"]
        if c["sample_index"] != sample_index or not resent or drifted is None or not kept:
            continue  # without kept rows the re-sent range's start is not recorded
        end = int(c["routes_start"])
        start = max(0, end - int(resent))
        end = min(end, n)
        if start >= end:
            continue
        for arr, v in ((calls_diff, 1), (rows_diff, int(resent)), (moved_diff, int(drifted))):
            arr[start] += v
            arr[end] -= v
    return np.cumsum(calls_diff)[:n], np.cumsum(rows_diff)[:n], np.cumsum(moved_diff)[:n]


def _sample_tokens(sample: Any, calls: list[dict], trainer: np.ndarray | None, tokenizer: Any = None
                   ) -> dict[str, Any]:
    """The per-token arrays and colour indexes of one sample, whole-array numpy."""
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    n = p + r
    ids = np.concatenate([np.asarray(sample.prompt_ids, np.int64), np.asarray(sample.response_ids, np.int64)])
    gen = np.zeros(n, bool)
    versions = np.full(n, -1, np.int64)
    versions[p:] = np.asarray(sample.token_model_versions, np.int64)
    gen[p:] = versions[p:] >= 0
    lp_ok = np.zeros(n, bool)
    lp_ok[p:] = np.asarray(sample.logprobs_mask, bool) & gen[p:]
    lp = np.zeros(n)
    lp[p:] = np.asarray(sample.rollout_logprobs, np.float64)
    loss = np.zeros(n, bool)
    loss[p:] = np.asarray(sample.loss_mask, bool)
    tlp = np.zeros(n)
    t_ok = np.zeros(n, bool)
    if trainer is not None and len(trainer) == r:
        tlp[p:] = np.asarray(trainer, np.float64)
        t_ok[p:] = gen[p:] & np.isfinite(tlp[p:])
    ratio = tlp - lp
    r_ok = t_ok & lp_ok
    # which call generated (or read) each token: the first call to cover a position keeps it
    call = np.full(n, -1, np.int64)
    for c in calls:  # a loop over calls: each writes its range with one slice
        if c["sample_index"] == sample.sample_index:
            lo = int(c["prefix_len"]) if c["is_merged"] else 0
            part = call[lo:min(n, int(c["prompt_len"]) + int(c["output_len"]))]
            part[part < 0] = int(c["seq"])
    resent_by, rows_resent, rows_moved = _drift_per_position(calls, sample.sample_index, n)
    d_ok = resent_by > 0
    share = np.where(d_ok, rows_moved / np.maximum(rows_resent, 1), 0.0)
    vmin = int(versions[gen].min()) if gen.any() else 0
    kind = np.where(gen, 2, np.where(np.arange(n) < p, 0, 1)).astype(np.int8)  # 0 prompt, 1 observed, 2 generated

    def rounded(a: np.ndarray, ok: np.ndarray, digits: int = 4) -> list:
        out = np.round(a, digits).astype(object)  # JSON has no NaN: null where there is no value
        out[~ok] = None
        return out.tolist()

    return {
        "sample_index": int(sample.sample_index), "prompt_len": p, "response_len": r,
        "num_tokens": n, "reward": sample.reward, "finish_reason": sample.finish_reason,
        "ids": ids.tolist(), "kind": kind.tolist(),
        # each token decoded alone, in one batch call (None without a tokenizer: the page shows ids)
        "text": None if tokenizer is None else tokenizer.decode_batch(ids.reshape(-1, 1).tolist(),
                                                                      skip_special_tokens=False), "loss": loss.astype(np.int8).tolist(),
        "logprob": rounded(lp, lp_ok), "trainer": rounded(tlp, t_ok), "mismatch": rounded(ratio, r_ok),
        "version": versions.tolist(), "call": call.tolist(),
        "drift": rounded(share, d_ok), "resent_by": resent_by.tolist(),
        "colors": {
            "logprob": _bins(lp, lp_ok, LOGPROB_EDGES).tolist(),
            "trainer": _bins(tlp, t_ok, LOGPROB_EDGES).tolist(),
            "mismatch": _bins(ratio, r_ok, RATIO_EDGES).tolist(),
            "version": np.where(gen, (versions - vmin) % len(CATEGORY_COLORS), -1).tolist(),
            "drift": _bins(share, d_ok, DRIFT_EDGES).tolist(),
            "call": np.where(call >= 0, call % len(CATEGORY_COLORS), -1).tolist(),
        },
        "has_trainer": bool(t_ok.any()), "has_drift": bool(d_ok.any()),
        "routes": routes_view(sample, n),
    }


def _legend(version_base: int | None) -> dict[str, Any]:
    def edges_labels(edges: Sequence[float], fmt: str) -> list[str]:
        out = [f"< {format(edges[0], fmt)}"]
        out += [f"{format(a, fmt)} .. {format(b, fmt)}" for a, b in zip(edges, edges[1:])]
        return out + [f">= {format(edges[-1], fmt)}"]

    return {
        "logprob": {"title": "rollout logprob (the engine's)", "colors": LOGPROB_COLORS,
                    "labels": edges_labels(LOGPROB_EDGES, "g")},
        "trainer": {"title": "trainer logprob (sample_annotation trainer_logprobs)", "colors": LOGPROB_COLORS,
                    "labels": edges_labels(LOGPROB_EDGES, "g")},
        "mismatch": {"title": "trainer - rollout logprob (r of k3 = exp(r) - 1 - r)", "colors": RATIO_COLORS,
                     "labels": edges_labels(RATIO_EDGES, "g")},
        "version": {"title": "model version of the generated token", "colors": CATEGORY_COLORS,
                    "labels": [f"version {version_base + i} (+{len(CATEGORY_COLORS)}k)" if version_base is not None
                               else str(i) for i in range(len(CATEGORY_COLORS))]},
        "drift": {"title": "route drift: share of re-sent route rows that moved, of the calls that re-sent this "
                           "position's row (which rows moved is not stored)",
                  "colors": DRIFT_COLORS, "labels": ["re-sent, none moved", "< 1 %", "1 .. 5 %", "5 .. 20 %", ">= 20 %"]},
        "call": {"title": "engine call (seq) that generated or read the token", "colors": CATEGORY_COLORS,
                 "labels": [f"seq = {i} (mod {len(CATEGORY_COLORS)})" for i in range(len(CATEGORY_COLORS))]},
    }


def _jsonable(v: Any, column: str = "") -> Any:
    """A cell as the page shows it: times (columns ending ``_at``, unix seconds) in ISO UTC."""
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace")
    if column.endswith("_at") and isinstance(v, (int, float)) and not isinstance(v, bool):
        import datetime as dt

        return dt.datetime.fromtimestamp(float(v), dt.timezone.utc).isoformat(timespec="milliseconds")
    return v


def trace_data(query: Any, trajectory_id: str, *, payload: str | None, tokenizer: Any = None,
               tokenizer_name: str | None = None) -> dict[str, Any]:
    """Everything the trace view draws for ``trajectory_id``, JSON-ready.

    ``{"trajectory_id", "found", "summary": [[name, value]], "sql", "calls":
    {"columns", "rows"}, "samples": [per-sample token arrays and colour
    indexes], "legend", "note", "generated_at"}``. A trajectory the store does
    not have is ``found: False``; one not materialized yet has its calls and
    a note instead of samples. ``tokenizer`` (``load_tokenizer``): decode the tokens, named
    ``tokenizer_name`` on the page; None: the page shows token ids."""
    sql = trace_sql(trajectory_id)
    summary, calls_r, samples_r, annotations_r, meta_r = (query(q) for q in sql)
    data: dict[str, Any] = {"trajectory_id": trajectory_id, "found": bool(summary.rows), "sql": sql,
                            "summary": [], "calls": {"columns": list(calls_r.columns), "rows": []},
                            "samples": [], "legend": _legend(None), "note": None, "generated_at": time.time(),
                            "tokenizer": tokenizer_name if tokenizer is not None else None}
    if not summary.rows:
        data["note"] = "the store has no trajectory with this id"
        return data
    row = dict(zip(summary.columns, summary.rows[0]))
    meta = meta_r.rows[0][0] if meta_r.rows else None
    data["summary"] = [[k, "-" if v is None else str(_jsonable(v, k))] for k, v in row.items()]
    if meta is not None:
        data["summary"].append(["metadata", meta if isinstance(meta, str) else json.dumps(meta, sort_keys=True)])
    calls = [dict(zip(calls_r.columns, r)) for r in calls_r.rows]
    data["calls"]["rows"] = [[_jsonable(v, k) if not isinstance(v, (dict, list)) else json.dumps(v)
                              for k, v in zip(calls_r.columns, r)] for r in calls_r.rows]
    if not samples_r.rows:
        data["note"] = ("no materialized samples yet (trajstore materialize folds finished trajectories): "
                        "the calls are listed, their tokens are drawn once the trajectory is folded")
        return data
    if payload is None:
        data["note"] = "the payload location is unknown (--payload): the token view needs the sample segments"
        return data
    import os

    if "://" not in payload and not os.path.isdir(payload):
        data["note"] = f"no payload at {payload} (pass --payload PATH_OR_URI)"
        return data
    from trajstore.sample._codec import samples_from_table

    try:
        by_segment: dict[str, list[tuple[int, int]]] = {}
        for sample_index, segment, segment_row, *_ in samples_r.rows:
            by_segment.setdefault(segment, []).append((int(sample_index), int(segment_row)))
        samples: dict[int, Any] = {}
        for segment, wanted in by_segment.items():
            table, index = read_segment_rows(payload, segment, [w for _, w in wanted])
            for (i, _), s in zip(wanted, samples_from_table(table, [index[w] for _, w in wanted])):
                samples[i] = s
        trainer: dict[int, np.ndarray] = {}
        for sample_index, run, step, attempt, segment, segment_row in annotations_r.rows:
            if int(sample_index) in trainer:
                continue  # rows come newest step first
            table, index = read_segment_rows(payload, segment, [int(segment_row)])
            cell = table.column("trainer_logprobs")[index[int(segment_row)]]
            if cell.is_valid:
                trainer[int(sample_index)] = np.asarray(cell.values.to_numpy(zero_copy_only=False), np.float64)
    except (StoreUnavailable, CorruptStoreError, ValueError, KeyError) as e:
        data["note"] = f"cannot read the sample segments under {payload}: {str(e).splitlines()[0]}"
        return data
    drawn = 0
    gen_versions = [int(s.min_model_version) for s in samples.values() if s.min_model_version >= 0]
    data["legend"] = _legend(min(gen_versions) if gen_versions else None)
    for i in sorted(samples):
        s = samples[i]
        if drawn + s.num_tokens > MAX_TRACE_TOKENS:
            data["note"] = f"drawn: the first {drawn} tokens (at most {MAX_TRACE_TOKENS}); the rest is not shown"
            break
        data["samples"].append(_sample_tokens(s, calls, trainer.get(i), tokenizer))
        drawn += s.num_tokens
    return data


# -- the page ------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:0;color:#1d1d1f;background:#f4f5f7}
header{background:#1f2937;color:#fff;padding:10px 24px;display:flex;flex-wrap:wrap;gap:4px 24px;align-items:baseline}
header h1{font-size:20px;margin:0}
header .meta{font-size:13px;color:#cbd5e1}
header a{color:#93c5fd}
#status.error{color:#fecaca;font-weight:bold}
main{max-width:1280px;margin:0 auto;padding:12px 24px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px;margin:12px 0}
.card h2{font-size:16px;margin:0 0 6px}
.note{padding:16px;color:#6b7280;background:#f9fafb;border-radius:6px}
table{border-collapse:collapse;font-size:12px}
#calls{overflow-x:auto}
td,th{padding:2px 10px 2px 0;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
#channels label{margin-right:14px;font-size:13px}
.legend span.sw{display:inline-block;width:14px;height:12px;margin:0 4px 0 10px;border:1px solid #ccc;vertical-align:middle}
.legend{font-size:12px;margin:6px 0}
.legend-title{font-weight:bold}
.tokens{font-family:ui-monospace,monospace;font-size:12px;line-height:1.9;word-break:break-all}
.tokens span.t{padding:1px 2px;margin:0 1px;border-radius:2px;border-bottom:2px solid transparent;white-space:pre-wrap}
.tokens span.id{color:#9ca3af}
.tokens span.k0{color:#6b7280}
.tokens span.k1{color:#6b21a8;font-style:italic}
.tokens span.call-start{border-left:2px solid #111}
.tokens span.loss{border-bottom-color:#111}
details{font-size:12px;margin-top:4px}
pre{background:#f6f8fa;padding:8px;white-space:pre-wrap;word-break:break-word;margin:4px 0;font-size:12px}
"""

_JS = r"""
(function () {
  "use strict";
  const cfg = JSON.parse(document.getElementById("trajstore-config").textContent);
  const $ = (id) => document.getElementById(id);
  let data = null, channel = "logprob";

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c) e.appendChild(c);
    return e;
  }
  const fmt = (v) => (v === null || v === undefined || Number.isNaN(v)) ? "-" : String(v);

  function table(columns, rows) {
    const t = el("table", {});
    t.appendChild(el("tr", {}, ...columns.map((c) => el("th", {text: c}))));
    for (const r of rows) t.appendChild(el("tr", {}, ...r.map((v) => el("td", {text: fmt(v)}))));
    return t;
  }

  function legend() {
    const l = data.legend[channel], box = $("legend");
    box.replaceChildren(el("span", {class: "legend-title", text: l.title}));
    l.colors.forEach((c, i) => {
      const sw = el("span", {class: "sw"});
      sw.style.background = c;
      box.appendChild(sw);
      box.appendChild(document.createTextNode(l.labels[i]));
    });
  }

  function paint() {
    const colors = data.legend[channel].colors;
    for (const sec of document.querySelectorAll("section.sample")) {
      const s = data.samples[Number(sec.dataset.i)], idx = s.colors[channel];
      const spans = sec.querySelectorAll("span.t");
      for (let j = 0; j < spans.length; j++) {
        spans[j].style.background = idx[j] >= 0 ? colors[idx[j]] : "";
      }
    }
    legend();
    document.body.dataset.channel = channel;
  }

  // -- which experts a token was routed to (decoded once per sample, on the first hover) --
  const ROUTE_LAYERS_SHOWN = 12;
  function routesOf(s) {
    if (s._routes !== undefined) return s._routes;
    const r = s.routes;
    if (!r || !r.b64) return (s._routes = null);
    const bytes = Uint8Array.from(atob(r.b64), (c) => c.charCodeAt(0));
    const values = r.dtype === "uint8" ? bytes : new Uint16Array(bytes.buffer, 0, bytes.length / 2);
    return (s._routes = {values: values, layers: r.shape[1], topk: r.shape[2]});
  }

  function routeText(s, j) {
    if (!s.routes) return "";
    if (s.routes.too_large) return "\nrouted experts: not shown (" + s.routes.too_large + " bytes of routes; export the sample)";
    if (s.routes.masked[j]) return "\nrouted experts: none captured for this position";
    const r = routesOf(s), parts = [];
    for (let l = 0; l < Math.min(r.layers, ROUTE_LAYERS_SHOWN); l++) {
      const at = (j * r.layers + l) * r.topk;
      parts.push("layer " + s.routes.layers[l] + ": " + Array.from(r.values.subarray(at, at + r.topk)).join(" "));
    }
    const more = r.layers > ROUTE_LAYERS_SHOWN ? "\n  ... " + (r.layers - ROUTE_LAYERS_SHOWN) + " more MoE layers" : "";
    return "\nrouted experts (MoE layers):\n  " + parts.join("\n  ") + more;
  }

  function tokenTitle(s, j) {
    const kind = ["prompt", "observed", "generated"][s.kind[j]];
    return "position " + j + " (" + kind + (s.loss[j] ? ", loss" : "") + "), token id " + s.ids[j] +
      "\ncall seq " + fmt(s.call[j] >= 0 ? s.call[j] : null) + ", version " + fmt(s.version[j] >= 0 ? s.version[j] : null) +
      "\nrollout logprob " + fmt(s.logprob[j]) + ", trainer logprob " + fmt(s.trainer[j]) +
      ", trainer - rollout " + fmt(s.mismatch[j]) +
      "\nroute row re-sent by " + s.resent_by[j] + " call(s)" +
      (s.resent_by[j] ? ", share of their re-sent rows that moved " + fmt(s.drift[j]) : "");
  }

  function render() {
    document.title = cfg.title;
    $("tokens-shown").textContent = data.tokenizer
      ? "Tokens are decoded one by one with the tokenizer " + data.tokenizer + " (an id in grey: it decodes to nothing)."
      : "Token ids are shown (the store holds ids, not text; --tokenizer decodes them).";
    $("tid").textContent = data.trajectory_id;
    const sum = $("summary");
    sum.replaceChildren(el("h2", {text: "Trajectory"}));
    if (!data.found) {
      sum.appendChild(el("div", {class: "note", text: data.note}));
    } else {
      const t = el("table", {});
      for (const [k, v] of data.summary) t.appendChild(el("tr", {}, el("td", {text: k}), el("td", {text: v})));
      sum.appendChild(t);
    }
    const calls = $("calls");
    calls.replaceChildren(el("h2", {text: "Engine calls (" + data.calls.rows.length + ")"}),
      table(data.calls.columns, data.calls.rows));
    const root = $("samples");
    root.replaceChildren();
    if (data.note && data.found) root.appendChild(el("div", {class: "card note", id: "trace-note", text: data.note}));
    data.samples.forEach((s, i) => {
      const sec = el("section", {class: "card sample", "data-i": String(i), "data-sample": String(s.sample_index)},
        el("h2", {text: "Sample " + s.sample_index + ": " + s.prompt_len + " prompt + " + s.response_len +
          " response tokens, reward " + fmt(s.reward) + ", finish " + fmt(s.finish_reason) +
          (s.has_trainer ? "" : " (no trainer logprobs)") + (s.has_drift ? "" : " (no re-sent routes)")}));
      const box = el("div", {class: "tokens"});
      const frag = document.createDocumentFragment();
      for (let j = 0; j < s.ids.length; j++) {
        const sp = document.createElement("span");
        sp.className = "t k" + s.kind[j] + (s.loss[j] ? " loss" : "") +
          (j > 0 && s.call[j] !== s.call[j - 1] && s.call[j] >= 0 ? " call-start" : "");
        const text = s.text ? s.text[j] : null;
        sp.textContent = text ? text : String(s.ids[j]);
        if (s.text && !text) sp.classList.add("id");
        sp.title = tokenTitle(s, j);
        sp.dataset.j = String(j);
        frag.appendChild(sp);
      }
      box.appendChild(frag);
      // a token's experts join its figures when the pointer first reaches it
      box.addEventListener("mouseover", (ev) => {
        const sp = ev.target;
        if (sp.classList && sp.classList.contains("t") && !sp.dataset.routes) {
          sp.dataset.routes = "1";
          sp.title += routeText(s, Number(sp.dataset.j));
        }
      });
      sec.appendChild(box);
      root.appendChild(sec);
    });
    const d = el("details", {}, el("summary", {text: "SQL"}));
    for (const q of data.sql) d.appendChild(el("pre", {text: q}));
    $("sql").replaceChildren(d);
    paint();
    $("status").textContent = (cfg.live ? "live; " : "static export; ") + "data of " +
      new Date(data.generated_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC";
    document.body.dataset.rendered = "1";
    document.body.dataset.samples = String(data.samples.length);
  }

  for (const input of document.querySelectorAll("#channels input")) {
    input.addEventListener("change", () => { channel = input.value; if (data) paint(); });
  }

  async function load() {
    try {
      const r = await fetch(cfg.api, {cache: "no-store", credentials: "same-origin"});
      const body = await r.json();
      if (!r.ok) throw new Error((body.error && body.error.message) || r.status);
      data = body;
      render();
    } catch (e) {
      $("status").className = "error";
      $("status").textContent = "cannot load the trace: " + e.message;
    }
  }
  if (cfg.live) load();
  else { data = JSON.parse($("trajstore-data").textContent); render(); }
})();
"""

CHANNELS = (("logprob", "rollout logprob"), ("trainer", "trainer logprob"), ("mismatch", "trainer - rollout"),
            ("version", "model version"), ("drift", "route drift"), ("call", "engine call"))


def trace_page(trajectory_id: str, store: str, *, live: bool, api: str | None = None, back: str | None = None,
               data_json: str | None = None) -> str:
    """The trace page: live (fetches ``api``) or static (``data_json`` embedded). ``back``: the report's URL."""
    import html

    from trajstore.inspect._report_page import _json_in_html

    e = html.escape
    title = f"trace {trajectory_id}"
    config = _json_in_html({"live": live, "api": api, "title": title})
    data = "" if data_json is None else (
        f"<script id='trajstore-data' type='application/json'>{data_json.replace('<', chr(92) + 'u003c')}</script>")
    radios = "".join(f"<label><input type='radio' name='channel' value='{v}'{' checked' if v == 'logprob' else ''}>"
                     f" {e(label)}</label>" for v, label in CHANNELS)
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'><link rel='icon' href='data:,'>"
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>trace <span id='tid'></span></h1><span class='meta'>store <code>{e(store)}</code></span>"
        + (f"<span class='meta'><a href='{e(back, quote=True)}'>the run report</a></span>" if back else "")
        + "<span class='meta' id='status'>loading…</span></header><main>"
        "<div id='summary' class='card'></div>"
        f"<div class='card'><h2>Token colours</h2><div id='channels'>{radios}</div><div id='legend' class='legend'></div>"
        "<p class='legend'>Grey ids: prompt; purple italic: observation tokens (read, not generated); underlined: loss "
        "tokens; a bar on the left: a new engine call. Hover a token for its figures. <span id='tokens-shown'>"
        "</span></p></div>"
        "<div id='samples'></div><div id='calls' class='card'></div><div id='sql' class='card'></div></main>"
        f"<script id='trajstore-config' type='application/json'>{config}</script>{data}"
        f"<script>{_JS}</script></body></html>\n")


# -- the live server's routes (trajstore report --serve) --------------------------------------

def live_routes(url: str | None, payload: str | None, store_label: str, tokenizer: str | None = None) -> list[Any]:
    """``GET /trace/{trajectory_id}`` (the page) and ``GET /api/trace?id=ID`` (its data), read-only,
    behind the report server's token like every other path."""
    from urllib.parse import quote

    from starlette.concurrency import run_in_threadpool
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    from trajstore.errors import StoreUnavailable, first_line
    from trajstore.ingest._http import error_body
    from trajstore.inspect.sql import read_only

    decoder = load_tokenizer(tokenizer)

    def compute(trajectory_id: str) -> bytes:
        with read_only(url) as query:
            data = trace_data(query, trajectory_id, payload=payload, tokenizer=decoder, tokenizer_name=tokenizer)
            return json.dumps(data, allow_nan=False, default=str).encode()

    async def get_page(request: Any) -> Any:
        trajectory_id = request.path_params["trajectory_id"]
        raw = request.scope.get("raw_path") or request.url.path.encode()
        # the page's relative way back to the server's root, however many '/' the id brought
        up = "../" * (raw.split(b"/trace/", 1)[-1].count(b"/") + 1)
        page = trace_page(trajectory_id, store_label, live=True, back=up,
                          api=f"{up}api/trace?id={quote(trajectory_id, safe='')}")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def get_data(request: Any) -> Any:
        trajectory_id = request.query_params.get("id")
        if not trajectory_id:
            return JSONResponse(error_body("api/trace needs ?id=TRAJECTORY_ID", rule="bad_request"), status_code=400)
        try:
            body = await run_in_threadpool(compute, trajectory_id)
        except StoreUnavailable as e:
            return JSONResponse(error_body(str(e), rule="store_unavailable"), status_code=503)
        except TrajstoreError as e:
            return JSONResponse(error_body(str(e), rule="store_error"), status_code=503)
        except Exception as e:  # noqa: BLE001 - a driver error: one line, the server goes on
            import logging

            logging.getLogger("trajstore.inspect.live").exception("trace data failed")
            return JSONResponse(error_body(f"{type(e).__name__}: {first_line(e)}", rule="internal"), status_code=500)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    return [Route("/trace/{trajectory_id:path}", get_page, methods=["GET", "HEAD"]),
            Route("/api/trace", get_data, methods=["GET", "HEAD"])]


def write_trace(url: str | None, trajectory_id: str, out_dir: str, *, payload: str | None = None,
                query: Any = None, back: str | None = None, tokenizer: str | None = None,
                decoder: Any = None) -> str:
    """Write the static trace page of ``trajectory_id`` into ``out_dir`` (data embedded, nothing
    loaded from anywhere); returns its path. ``query``: a read-only connection's, else one is opened.
    ``tokenizer``: a tokenizer.json (or its directory) to decode the tokens with (``decoder``: it, loaded)."""
    import os

    from trajstore.inspect import _report_page
    from trajstore.inspect.sql import read_only

    if query is None:
        with read_only(url) as q:
            return write_trace(url, trajectory_id, out_dir, payload=_report_page.payload_location(url, payload, q),
                               query=q, back=back, tokenizer=tokenizer, decoder=decoder)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TrajstoreError(f"report: {out_dir} is a file; the report writes a directory")
    if decoder is None:
        decoder = load_tokenizer(tokenizer)
    data = trace_data(query, trajectory_id, payload=payload, tokenizer=decoder, tokenizer_name=tokenizer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, trace_file_name(trajectory_id))
    text = trace_page(trajectory_id, _report_page.store_label(url), live=False, back=back,
                      data_json=json.dumps(data, allow_nan=False, default=str))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


MAX_STATIC_TRACES = 40
"""The static export writes the trace pages of at most this many trajectories its panels link to."""


def linked_ids(data: dict[str, Any], limit: int = MAX_STATIC_TRACES) -> list[str]:
    """The trajectory ids the page's panels link to (a trace's ``meta.trajectory_ids``), in panel order."""
    out: dict[str, None] = {}
    for panel in data.get("panels", ()):
        for trace in ((panel.get("figure") or {}).get("data") or ()):
            for tid in ((trace.get("meta") or {}).get("trajectory_ids") or ()):
                if isinstance(tid, str) and len(out) < limit:
                    out.setdefault(tid)
    return list(out)


def link_trajectories(trace: Any, ids: Sequence[str]) -> Any:
    """Make a plotly trace's points open the trace view of ``ids[i]`` (clicked, or listed under the panel)."""
    trace.meta = {"trajectory_ids": [str(i) for i in ids]}
    return trace
