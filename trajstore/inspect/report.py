"""``trajstore report OUT_DIR``: an HTML page with PNG plots of a run.

Everything comes from the inspection views (``trajstore.inspect.views``, documented
in docs/sql.md) through the same read-only connection ``trajstore sql``
uses, in one snapshot; each plot's caption shows the SQL it was drawn from,
so any number on the page can be re-derived with ``trajstore sql``.
matplotlib is imported lazily, and only its Agg canvas is used (no pyplot,
no display, no global backend switch).
"""

from __future__ import annotations

import argparse
import html
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from trajstore.errors import TrajstoreError
from trajstore.inspect.sql import Query, QueryResult, read_only

__all__ = ["PLOTS", "Plot", "render_report", "add_cli_arguments", "run_from_args"]

FIGSIZE_IN = (10.0, 3.8)
DPI = 100


@dataclass(frozen=True)
class Plot:
    name: str
    """File stem: ``<name>.png``."""
    title: str
    caption: str
    queries: tuple[str, ...]
    draw: Callable[[Any, list[QueryResult]], None]
    """draw(figure, results of ``queries``) fills a matplotlib Figure."""


# -- drawing helpers -------------------------------------------------------------

def _axes(fig: Any, n: int) -> list[Any]:
    return [fig.add_subplot(1, n, i + 1) for i in range(n)]


def _empty(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _bars(ax: Any, xs: Sequence[Any], ys: Sequence[float], title: str, xlabel: str, ylabel: str,
          **kw: Any) -> None:
    if not xs:
        _empty(ax, title)
        return
    ax.bar([str(x) for x in xs], [0 if y is None else y for y in ys], **kw)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def _share(part: Any, whole: Any) -> float:
    return float(part) / float(whole) if whole else 0.0


# -- the plots ---------------------------------------------------------------------

def _draw_versions(fig: Any, results: list[QueryResult]) -> None:
    rows = results[0].rows
    v = [r[0] for r in rows]
    ax_tokens, ax_trajs = _axes(fig, 2)
    _bars(ax_tokens, v, [r[1] for r in rows], "generated tokens", "model version", "tokens")
    _bars(ax_trajs, v, [r[2] - r[3] for r in rows], "trajectories", "model version", "trajectories",
          label="this version only")
    if rows:
        ax_trajs.bar([str(x) for x in v], [r[3] for r in rows], bottom=[r[2] - r[3] for r in rows],
                     label="also other versions")
        ax_trajs.legend(fontsize="small")


def _draw_staleness(fig: Any, results: list[QueryResult]) -> None:
    ax_stale, ax_span = _axes(fig, 2)
    stale, span = results[0].rows, results[1].rows
    _bars(ax_stale, [r[0] for r in stale], [r[1] for r in stale],
          "staleness at finish (latest version - oldest in sample)", "versions behind", "samples")
    _bars(ax_span, [r[0] for r in span], [r[1] for r in span],
          "versions within one sample (max - min)", "version span", "samples", color="tab:orange")


def _draw_reward(fig: Any, results: list[QueryResult]) -> None:
    rows = results[0].rows
    v = [r[0] for r in rows]
    ax_reward, ax_status = _axes(fig, 2)
    _bars(ax_reward, v, [r[1] for r in rows], "mean reward", "model version", "reward")
    for x, r in enumerate(rows):
        ax_reward.annotate(f"n={r[2]}", (x, r[1] or 0), ha="center", va="bottom", fontsize="small")
    ax_reward.margins(y=0.12)  # room for the labels
    _bars(ax_status, v, [_share(r[3], r[5]) for r in rows], "failed / aborted trajectories",
          "model version", "share of trajectories", label="failed")
    if rows:
        ax_status.bar([str(x) for x in v], [_share(r[4], r[5]) for r in rows],
                      bottom=[_share(r[3], r[5]) for r in rows], label="aborted")
        ax_status.legend(fontsize="small")


def _draw_merge(fig: Any, results: list[QueryResult]) -> None:
    per_traj, per_sample = results[0].rows, results[1].rows
    ax_ratio, ax_calls = _axes(fig, 2)
    if per_traj:
        ratios = [_share(r[1], r[0]) for r in per_traj]
        ax_ratio.hist(ratios, bins=20, range=(0, 1), weights=[r[2] for r in per_traj])
        overall = _share(sum(r[1] * r[2] for r in per_traj), sum(r[0] * r[2] for r in per_traj))
        ax_ratio.axvline(overall, color="black", linestyle="--", label=f"run: {overall:.3f}")
        ax_ratio.legend(fontsize="small")
        ax_ratio.set_title("merge ratio per trajectory (samples / calls)")
        ax_ratio.set_xlabel("merge ratio")
        ax_ratio.set_ylabel("trajectories")
    else:
        _empty(ax_ratio, "merge ratio per trajectory")
    _bars(ax_calls, [r[0] for r in per_sample], [r[1] for r in per_sample],
          "engine calls merged into one sample", "calls", "samples", color="tab:green")


def _draw_mismatches(fig: Any, results: list[QueryResult]) -> None:
    per_traj, per_version = results[0].rows, results[1].rows
    ax_traj, ax_version = _axes(fig, 2)
    _bars(ax_traj, [r[0] for r in per_traj], [r[1] for r in per_traj],
          "prefix mismatches per trajectory", "mismatches", "trajectories", color="tab:red")
    _bars(ax_version, [r[0] for r in per_version], [_share(r[2], r[1]) for r in per_version],
          "calls that start a new sample by mismatch", "model version", "share of calls", color="tab:red")


_MISSING_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 9, "2-9"), (10, 99, "10-99"), (100, None, "100+"))


def _draw_routes(fig: Any, results: list[QueryResult]) -> None:
    missing, per_version = results[0].rows, results[1].rows
    ax_missing, ax_calls = _axes(fig, 2)
    counts = [sum(n for m, n, *_ in missing if lo <= m and (hi is None or m <= hi)) for lo, hi, _ in _MISSING_BUCKETS]
    tokens = sum(r[2] for r in missing)
    covered = _share(sum(r[3] for r in missing), tokens)
    _bars(ax_missing, [b[2] for b in _MISSING_BUCKETS] if missing else [], counts,
          f"tokens without a route per sample ({covered:.2%} covered)",
          "tokens without a captured route (1 = the final token only)", "samples", color="tab:purple")
    _bars(ax_calls, [r[0] for r in per_version], [_share(r[2], r[1]) for r in per_version],
          "engine calls that returned routes", "model version", "share of calls", color="tab:purple")


PLOTS: tuple[Plot, ...] = (
    Plot("versions", "Tokens and trajectories per model version",
         "Tokens generated by each policy version, and the trajectories it took part in (a trajectory "
         "resumed under a newer version counts under each).",
         ("SELECT model_version, num_generated_tokens, num_trajectories, num_multi_version "
          "FROM model_version_stats ORDER BY model_version",), _draw_versions),
    Plot("staleness", "Staleness of samples",
         "How many versions the oldest token of a sample lags the newest version in the log when its "
         "trajectory finished, and how many versions one sample mixes.",
         ("SELECT staleness, count(*) FROM sample_summary GROUP BY staleness ORDER BY staleness",
          "SELECT model_version_span, count(*) FROM sample_summary GROUP BY model_version_span "
          "ORDER BY model_version_span"), _draw_staleness),
    Plot("reward", "Reward by model version",
         "Mean trajectory reward over the trajectories each version generated in, and the share of them "
         "that failed or were aborted.",
         ("SELECT model_version, mean_reward, num_rewarded, num_failed, num_aborted, num_trajectories "
          "FROM model_version_stats ORDER BY model_version",), _draw_reward),
    Plot("merge_ratio", "Merge ratio",
         "Samples per engine call for each finished trajectory (SPEC merge_ratio; lower is more "
         "merging), and how many calls each sample folds.",
         ("SELECT num_generations, num_samples, count(*) FROM trajectory_summary "
          "WHERE status <> 'running' AND num_generations > 0 GROUP BY num_generations, num_samples",
          "SELECT num_merged_calls, count(*) FROM sample_summary GROUP BY num_merged_calls "
          "ORDER BY num_merged_calls"), _draw_merge),
    Plot("prefix_mismatches", "Prefix mismatches",
         "Calls whose prompt did not continue the trajectory's sequence, so a new sample started.",
         ("SELECT num_prefix_mismatches, count(*) FROM trajectory_summary WHERE num_generations > 0 "
          "GROUP BY num_prefix_mismatches ORDER BY num_prefix_mismatches",
          "SELECT model_version, count(*), count(*) FILTER (WHERE is_prefix_mismatch) "
          "FROM generation_events GROUP BY model_version ORDER BY model_version"), _draw_mismatches),
    Plot("route_coverage", "Route coverage (R3)",
         "Tokens of each sample without a captured router route (the final token never has one, so 1 "
         "is complete capture), and the share of engine calls that returned routes at all.",
         ("SELECT num_tokens - num_route_rows, count(*), sum(num_tokens), sum(num_route_rows) "
          "FROM sample_summary WHERE num_route_rows IS NOT NULL GROUP BY num_tokens - num_route_rows",
          "SELECT model_version, count(*), count(*) FILTER (WHERE has_routes) "
          "FROM generation_events GROUP BY model_version ORDER BY model_version"), _draw_routes),
)

_SUMMARY_QUERIES = {
    "trajectories by status": "SELECT status, count(*) FROM trajectory_summary GROUP BY status ORDER BY status",
    "totals": (
        "SELECT count(*), sum(num_generations), sum(num_generated_tokens), sum(num_observed_tokens), "
        "sum(num_prefix_mismatches), min(min_model_version), max(max_model_version) FROM trajectory_summary"),
    "samples": (
        "SELECT count(*), sum(num_merged_calls), avg(staleness), max(staleness), "
        "sum(num_route_rows), sum(CASE WHEN num_route_rows IS NULL THEN 0 ELSE num_tokens END) "
        "FROM sample_summary"),
}


# -- rendering -----------------------------------------------------------------------

def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise TrajstoreError("trajstore report needs matplotlib: pip install -e '.[report]' in the trajstore checkout") from None
    return Figure, FigureCanvasAgg


def _fmt(x: Any, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def _summary(query: Query) -> list[tuple[str, str]]:
    by_status = query(_SUMMARY_QUERIES["trajectories by status"]).rows
    n, calls, generated, observed, mismatches, vmin, vmax = query(_SUMMARY_QUERIES["totals"]).rows[0]
    samples, folded_calls, mean_stale, max_stale, routed, routable = query(_SUMMARY_QUERIES["samples"]).rows[0]
    return [
        ("trajectories", f"{n} ({', '.join(f'{s} {c}' for s, c in by_status) or 'none'})"),
        ("engine calls (generation events)", _fmt(calls)),
        ("tokens generated / observed", f"{_fmt(generated)} / {_fmt(observed)}"),
        ("model versions", "-" if vmin is None else f"{vmin} .. {vmax}"),
        ("samples", _fmt(samples)),
        ("merge ratio (samples / folded calls)", _fmt(_share(samples, folded_calls) if folded_calls else None, ".3f")),
        ("prefix mismatches", _fmt(mismatches)),
        ("staleness of samples: mean / max", f"{_fmt(mean_stale, '.2f')} / {_fmt(max_stale)}"),
        ("tokens with captured routes", _fmt(_share(routed, routable) if routable else None, ".2%")),
    ]


def render_report(url: str | None, out_dir: str, *, title: str | None = None) -> dict[str, Any]:
    """Write ``index.html`` and one PNG per plot into ``out_dir``; return their paths."""
    Figure, FigureCanvasAgg = _matplotlib()
    os.makedirs(out_dir, exist_ok=True)
    with read_only(url) as query:
        summary = _summary(query)
        data = [(plot, [query(q) for q in plot.queries]) for plot in PLOTS]
    images = []
    for plot, results in data:
        fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        plot.draw(fig, results)
        path = os.path.join(out_dir, f"{plot.name}.png")
        fig.savefig(path, dpi=DPI)
        images.append(path)
    index = os.path.join(out_dir, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write(_html(title or "trajstore report", _store_label(url), summary))
    return {"index": index, "images": images}


def _store_label(url: str | None) -> str:
    from sqlalchemy.engine import make_url

    from trajstore.store import resolve_url

    return make_url(resolve_url(url)).render_as_string(hide_password=True)


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1040px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td{padding:2px 12px;border-bottom:1px solid #ddd}"
        "figure{margin:2em 0}img{max-width:100%}pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}"
        "figcaption{color:#444}")


def _html(title: str, store: str, summary: list[tuple[str, str]]) -> str:
    e = html.escape
    rows = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in summary)
    figures = "".join(
        f"<figure id='{p.name}'><h2>{e(p.title)}</h2><img src='{p.name}.png' alt='{e(p.title)}'>"
        f"<figcaption>{e(p.caption)}<details><summary>SQL</summary>"
        + "".join(f"<pre>{e(q)}</pre>" for q in p.queries) + "</details></figcaption></figure>"
        for p in PLOTS
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>"
            f"<p>store <code>{e(store)}</code>, {e(when)}. Views and columns: docs/sql.md.</p>"
            f"<table>{rows}</table>{figures}</body></html>\n")


# -- CLI ---------------------------------------------------------------------------------

def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory for index.html and the PNG plots")
    parser.add_argument("--title", default=None, help="page title (default: trajstore report)")


def run_from_args(args: argparse.Namespace) -> int:
    written = render_report(args.store, args.out_dir, title=args.title)
    print(f"wrote {written['index']} with {len(written['images'])} plots")
    return 0
