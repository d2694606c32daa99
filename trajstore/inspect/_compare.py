"""Two runs on the same panels (``trajstore report --compare STORE_URL``), as W&B users expect.

Each store's page data is collected as usual (``_panels.collect``); ``merge`` lays the second
run's traces over the first's, panel by panel: every trace of a run in that run's colour (its
traces told apart by their names, which start with the run's label, dashes and bar opacity),
bars side by side rather than stacked across runs, stacked areas stacked within their run.
Time axes become minutes since each run's first bucket (two runs are rarely at the same wall
clock); a heatmap (the expert load) shows the first run only. The summary gets a column a run.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

__all__: list[str] = []

COLORS = ("#1f77b4", "#ff7f0e")
"""The first run's colour and the second's."""
_BAR_OPACITY = (0.75, 0.45, 0.3)


def store_labels(a: str, b: str) -> tuple[str, str]:
    """Short names of two store labels (``trajstore.inspect._report_page.store_label``): the
    shortest trailing parts of their paths (or database names) that differ."""
    pa, pb = a.rstrip("/").split("/"), b.rstrip("/").split("/")
    for n in range(1, max(len(pa), len(pb)) + 1):
        la, lb = "/".join(pa[-n:]), "/".join(pb[-n:])
        if la != lb:
            return la, lb
    return "A", "B"


def _rgba(color: str, alpha: float) -> str:
    return f"rgba({int(color[1:3], 16)},{int(color[3:5], 16)},{int(color[5:7], 16)},{alpha})"


def _minutes(layout: dict[str, Any], traces: list[dict[str, Any]]) -> None:
    """Date x axes as minutes since the axis' start (the run's first bucket), in place."""
    for key, axis in list(layout.items()):
        if not (key.startswith("xaxis") and isinstance(axis, dict) and axis.get("type") == "date"):
            continue
        origin = np.datetime64((axis.get("range") or [None])[0] or "NaT", "s")
        label = "x" + key[5:]
        for t in traces:
            if (t.get("xaxis") or "x") == label and t.get("x") is not None and len(t["x"]):
                xs = np.array(list(t["x"]), dtype="datetime64[s]")
                if np.isnat(origin):
                    origin = xs.min()
                t["x"] = ((xs - origin).astype(np.int64) / 60.0).tolist()
        title = ((axis.get("title") or {}).get("text") or "").replace("time (UTC; ", "").rstrip(")")
        layout[key] = {**{k: v for k, v in axis.items() if k not in ("range", "type", "title")}, "type": "linear",
                       "title": {"text": "minutes since the run's first bucket" + (f" ({title})" if title else "")}}


def _paint(traces: list[dict[str, Any]], run: int, label: str) -> list[dict[str, Any]]:
    """The run's traces in its colour, named for it."""
    color = COLORS[run]
    out = []
    bars = 0
    for t in traces:
        t = dict(t)
        if t.get("type") == "heatmap":
            if run:
                continue  # one colour scale: the first run's
            out.append(t)
            continue
        t["name"] = f"{label}: {t['name']}" if t.get("name") else label
        t["legendgroup"] = label + ("/" + str(t["legendgroup"]) if t.get("legendgroup") else "")
        marker = dict(t.get("marker") or {})
        if t.get("type") == "bar":
            marker["color"] = color
            marker["opacity"] = _BAR_OPACITY[bars % len(_BAR_OPACITY)]
            t.pop("opacity", None)
            bars += 1
            t["offsetgroup"] = label
        else:
            line = dict(t.get("line") or {})
            line["color"] = color
            t["line"] = line
            if "color" in marker:
                marker["color"] = color
            if t.get("fillcolor"):
                t["fillcolor"] = _rgba(color, 0.15)
            if t.get("stackgroup"):
                t["stackgroup"] = f"{t['stackgroup']}-{run}"
        if marker:
            t["marker"] = marker
        if run:
            t.pop("meta", None)  # trace-view links are the first store's
        out.append(t)
    return out


def _figure(a: dict[str, Any] | None, b: dict[str, Any] | None, labels: tuple[str, str]) -> dict[str, Any]:
    base = copy.deepcopy(a if a is not None else b)
    layout = base["layout"]
    runs = []
    for k, fig in enumerate((a, b)):
        if fig is None:
            continue
        traces = [dict(t) for t in fig["data"]]
        _minutes(copy.deepcopy(fig["layout"]), traces)
        runs.extend(_paint(traces, k, labels[k]))
    _minutes(layout, [])
    if layout.get("barmode") in ("stack", "relative"):  # one stack per run would mix: side by side
        layout["barmode"] = "group"
    base["data"] = runs
    return base


def merge(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str]) -> dict[str, Any]:
    """The page data of ``a`` with ``b``'s run laid over it (``collect``'s dicts; ``labels``: the runs' names)."""
    out = dict(a)
    out["compare"] = list(labels)
    out["empty"] = bool(a.get("empty") and b.get("empty"))
    rows_b = {row[0]: row[1] for row in b.get("summary", [])}
    keys = [row[0] for row in a.get("summary", [])] + [k for k in rows_b if k not in {r[0] for r in a.get("summary", [])}]
    rows_a = {row[0]: row[1] for row in a.get("summary", [])}
    out["summary"] = [[k, rows_a.get(k, "-"), rows_b.get(k, "-")] for k in keys]
    out["summary_header"] = ["", *labels]
    panels_b = {p["name"]: p for p in b.get("panels", [])}
    merged = []
    for p in a.get("panels", []) or [dict(q, figure=None, note=None) for q in b.get("panels", [])]:
        q = panels_b.get(p["name"])
        fa, fb = p.get("figure"), q.get("figure") if q else None
        entry = dict(p)
        if fa is None and fb is None:
            notes = [f"{label}: {note}" for label, note in zip(labels, (p.get("note"), q and q.get("note"))) if note]
            entry.update(figure=None, note="; ".join(notes) or p.get("note"))
        else:
            entry.update(figure=_figure(fa, fb, labels), note=None)
        merged.append(entry)
    out["panels"] = merged
    return out
