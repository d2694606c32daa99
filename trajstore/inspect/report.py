"""``trajstore report``: the run on one page of plotly panels, live or exported.

``trajstore report OUT_DIR`` writes the static page (``index.html`` with its
data embedded, and ``plotly.min.js`` beside it: it opens offline, from the
file system); ``trajstore report --serve`` serves the same page live, redrawn
from the store every few seconds (``trajstore.inspect._live``).

Everything comes from the inspection views (docs/sql.md) through the read-only
connection ``trajstore sql`` uses, in one snapshot per refresh; each panel
shows the SQL it was drawn from (``trajstore.inspect._panels``), and the
panels are drawn with plotly, whose bundled plotly.js the page loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from trajstore._util.config import add_flags, config_from_args, option
from trajstore.errors import TrajstoreError
from trajstore.ingest._http import server_options
from trajstore.inspect._live import DEFAULT_PORT, DEFAULT_REFRESH_S
from trajstore.inspect._panels import DEFAULT_STUCK_AFTER_S

__all__ = ["render_report", "add_cli_arguments", "run_from_args"]


def render_report(url: str | None, out_dir: str, *, title: str | None = None,
                  stuck_after_s: float | None = None, payload: str | None = None,
                  progress: Callable[[int], None] | None = None, tokenizer: str | None = None,
                  compare: str | None = None) -> dict[str, Any]:
    """Write the static page into ``out_dir``: ``index.html`` (data embedded), ``plotly.min.js``,
    and the trace view (``trace-*.html``) of each trajectory the panels link to (at most 40).

    Returns ``{"index", "files", "traces", "empty", "panels", "plotted", "notes"}``:
    the panels on the page, those drawn, and ``{name: why}`` for those with
    nothing to draw yet. An empty store gives one "no data yet" page and no panels.
    ``payload``: the store's payload location when not the default (the
    token-level panels read the newest sample segments there, read-only).
    ``progress(1)`` is called after each panel is drawn. ``tokenizer``: a tokenizer.json (or
    its directory) the trace pages decode tokens with (None: they show token ids). ``compare``: a
    second store whose run is drawn on the same panels (``trajstore.inspect._compare``)."""
    from plotly.utils import PlotlyJSONEncoder

    from trajstore.inspect import _report_page
    from trajstore.inspect._panels import DEFAULT_STUCK_AFTER_S, collect, plotly_js
    from trajstore.inspect._trace import linked_ids, load_tokenizer, write_trace
    from trajstore.inspect.sql import read_only

    script = plotly_js()  # says what to install before anything is read or written
    decoder = load_tokenizer(tokenizer)  # a wrong path fails before anything is written
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TrajstoreError(f"report: {out_dir} is a file; the report writes a directory (index.html and plotly.min.js)")
    other = None
    if compare is not None:  # the compared store is read first: a wrong one writes nothing
        with read_only(compare) as query:
            other = collect(query, stuck_after_s=DEFAULT_STUCK_AFTER_S if stuck_after_s is None else stuck_after_s,
                            payload=_report_page.payload_location(compare, None, query))
    with read_only(url) as query:
        payload_at = _report_page.payload_location(url, payload, query)
        data = collect(query, stuck_after_s=DEFAULT_STUCK_AFTER_S if stuck_after_s is None else stuck_after_s,
                       payload=payload_at, progress=progress)
        os.makedirs(out_dir, exist_ok=True)
        # the trace pages the panels link to, beside the page (a static link opens a file)
        data["trace_files"] = {tid: os.path.basename(write_trace(url, tid, out_dir, payload=payload_at, query=query,
                                                                 back="index.html", tokenizer=tokenizer,
                                                                 decoder=decoder))
                               for tid in linked_ids(data)}
    label = _report_page.store_label(url)
    if other is not None:
        from trajstore.inspect._compare import merge, store_labels

        data = merge(data, other, store_labels(label, _report_page.store_label(compare)))
        label += f" compared with {_report_page.store_label(compare)}"
    page = _report_page.page(title or "trajstore report", label, live=False,
                             data_json=json.dumps(data, cls=PlotlyJSONEncoder))
    files = {"index": os.path.join(out_dir, "index.html"), "script": os.path.join(out_dir, _report_page.PLOTLY_JS)}
    for path, text in ((files["script"], script), (files["index"], page)):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # a reader of the directory sees the old page or the new one, whole
    panels = data["panels"]
    traces = [os.path.join(out_dir, name) for name in data.get("trace_files", {}).values()]
    return {"index": files["index"], "files": [files["index"], files["script"], *traces], "traces": traces,
            "empty": data["empty"],
            "panels": [p["name"] for p in panels], "plotted": [p["name"] for p in panels if p["figure"]],
            "notes": {p["name"]: p["note"] for p in panels if not p["figure"]}}


# -- CLI ---------------------------------------------------------------------------------

_LIVE = "live page (--serve)"
_SERVER = server_options(port=DEFAULT_PORT, token_help="bearer token viewers must present",
                         open_help="serve the page without a token (anyone reaching the port reads the run)",
                         group=_LIVE)


@dataclass(frozen=True)
class _ReportOptions:
    """``trajstore report``'s settings: each field is also its flag."""

    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    out_dir: str | None = option(None, flag="out_dir",
                                 help="directory for the static page (index.html, plotly.min.js); not with --serve")
    title: str | None = option(None, help="page title (default: trajstore report)")
    stuck_after_s: float = option(DEFAULT_STUCK_AFTER_S, min=0,
                                  help="a running trajectory idle this long while the log goes on counts as stuck "
                                       f"(default {DEFAULT_STUCK_AFTER_S:g})")
    rebuild_aggregates: bool = option(
        False, help="count the run aggregates the panels read again from the log and every sample, then "
                    "exit (once after upgrading a store that has samples; docs/report.md)")
    trace: str | None = option(None, metavar="TRAJECTORY_ID",
                               help="write the trace view of one trajectory (its calls and samples token by token) "
                                    "into OUT_DIR instead of the run's page")
    tokenizer: str | None = option(None, metavar="PATH",
                                   help="a Hugging Face tokenizer.json (or the model directory holding it): the "
                                        "trace view shows decoded tokens instead of token ids")
    compare: str | None = option(None, metavar="STORE_URL",
                                 help="a second store (another run) drawn on the same panels, each run its own "
                                      "colour; read-only like the first (docs/report.md \"Comparing runs\")")
    serve: bool = option(False, group=_LIVE,
                         help="serve the page live over HTTP, redrawn from the store (read-only, token required)")
    refresh_s: float = option(DEFAULT_REFRESH_S, min=0, min_exclusive=True, group=_LIVE,
                              help="how often the live page checks whether the store changed (a few indexed maxima); "
                                   "the panels are recomputed and pushed only when it did "
                                   f"(default {DEFAULT_REFRESH_S:g})")
    host: str = _SERVER["host"]
    port: int = _SERVER["port"]
    token: str | None = _SERVER["token"]
    insecure_no_auth: bool = _SERVER["insecure_no_auth"]
    log_level: str = _SERVER["log_level"]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore report``: one per field of its settings."""
    add_flags(parser, _ReportOptions)


def run_from_args(args: argparse.Namespace) -> int:
    options = config_from_args(_ReportOptions, args)
    if options.rebuild_aggregates:
        if options.serve or options.out_dir is not None or options.trace is not None:
            raise TrajstoreError("report --rebuild-aggregates only recounts the aggregates; run it on its own")
        from trajstore.store import connect
        from trajstore.inspect._rebuild import rebuild_aggregates

        with connect(options.store_url, payload=options.payload, create=False) as store:
            counted = rebuild_aggregates(store)
        print(f"recounted the run aggregates from {counted['events']} engine calls, {counted['samples']} samples and "
              f"{counted['trajectories']} finished trajectories")
        sys.stdout.flush()
        return 0
    if options.serve:
        if options.trace is not None:
            raise TrajstoreError("report --serve serves every trace at /trace/ID; --trace writes one into OUT_DIR")
        if options.out_dir is not None:
            raise TrajstoreError("report --serve serves the page; it takes no OUT_DIR (run without --serve to export)")
        from trajstore.ingest._http import server_token
        from trajstore.inspect._live import serve_report

        token = server_token(options.token, insecure_no_auth=options.insecure_no_auth, host=options.host)
        serve_report(options.store_url, host=options.host, port=options.port, token=token,
                     title=options.title or "trajstore report", refresh_s=options.refresh_s, stuck_after_s=options.stuck_after_s, log_level=options.log_level,
                     payload=options.payload, tokenizer=options.tokenizer, compare=options.compare)
        return 0
    if options.out_dir is None:
        raise TrajstoreError("report needs OUT_DIR (the static page) or --serve (the live page)")
    if options.trace is not None:
        from trajstore.inspect._trace import write_trace

        path = write_trace(options.store_url, options.trace, options.out_dir, payload=options.payload,
                           tokenizer=options.tokenizer)
        print(f"wrote {path}")
        return 0
    from trajstore._util.progress import progress_bar
    from trajstore.inspect._panels import PANELS

    with progress_bar("drawing the report's panels", total=len(PANELS), unit="panels") as advance:
        written = render_report(options.store_url, options.out_dir, title=options.title, stuck_after_s=options.stuck_after_s,
                                payload=options.payload, progress=advance, tokenizer=options.tokenizer,
                                compare=options.compare)
    if written["empty"]:
        print(f"wrote {written['index']}: no data yet (the store has no trajectories), 0 panels")
    else:
        notes = written["notes"]
        print(f"wrote {written['index']} with {len(written['panels'])} panels"
              + (f" ({len(notes)} with nothing to draw yet: {', '.join(notes)})" if notes else ""))
    sys.stdout.flush()
    return 0
