"""The panels' figures are plain dicts (trajstore.inspect._plot) in plotly's figure API: each
call the panels make gives the JSON plotly itself gives for it (what the page drew when plotly
built the figures)."""

from __future__ import annotations

import json

import pytest

go = pytest.importorskip("plotly.graph_objects")

from plotly.subplots import make_subplots as plotly_subplots  # noqa: E402

from trajstore.inspect import _plot  # noqa: E402


def _json(fig) -> dict:
    from plotly.utils import PlotlyJSONEncoder

    out = json.loads(json.dumps(fig.to_plotly_json(), cls=PlotlyJSONEncoder))
    out.get("layout", {}).pop("template", None)
    return out


def _draw(lib, make_subplots, grid: dict) -> object:
    """One figure as the panels draw them: a grid, traces on both y axes, axis and layout updates."""
    fig = make_subplots(**grid)
    secondary = any(s and s.get("secondary_y") for row in grid.get("specs", ()) for s in row)
    rows, cols = len(grid.get("specs", ())) or grid.get("rows", 1), len((grid.get("specs") or [[0]])[0]) if \
        grid.get("specs") else grid.get("cols", 1)
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            fig.add_trace(lib.Bar(x=["1", "2"], y=[3, 4], name=f"bar {r} {c}", marker_color="#d62728", opacity=0.5,
                                  text=[1, None], textposition="outside"), r, c)
            fig.add_trace(lib.Scatter(x=[1, 2], y=[0.5, None], mode="lines", line=dict(dash="dot", color="grey"),
                                      customdata=[[1, 2], [3, 4]], hovertemplate="%{y}"), r, c)
    if secondary:
        fig.add_trace(lib.Scatter(x=[1, 2], y=[5, 6], name="right"), secondary_y=True)
        fig.update_yaxes(title_text="right", secondary_y=True, rangemode="tozero", showgrid=False)
        fig.update_yaxes(title_text="left", secondary_y=False)
    fig.update_xaxes(title_text="every x", type="category")
    fig.update_xaxes(title_text="row 1", row=1)
    fig.update_yaxes(tickformat=".0%", row=rows, col=cols)
    fig.add_vline(x=1.5, line_dash="dash", row=1, col=1)
    fig.update_layout(height=330, margin=dict(l=60, r=20, t=40, b=50), barmode="stack")
    fig.update_layout(margin=dict(l=160), title=dict(text="t", font=dict(size=13)), legend=dict(y=0.0))
    return fig


@pytest.mark.parametrize("grid", [
    dict(specs=[[{"secondary_y": True}]]),
    dict(specs=[[{"secondary_y": True}]], subplot_titles=("one title",)),
    dict(rows=1, cols=2, subplot_titles=("a", "b")),
    dict(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=("a", "b")),
    dict(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=("a", "b"), specs=[[{"secondary_y": True}, {}]]),
    dict(rows=2, cols=2, column_widths=[0.68, 0.32], vertical_spacing=0.14, subplot_titles=("a", "b", "c", "d")),
    dict(rows=3, cols=3, subplot_titles=tuple("abcdefg"), vertical_spacing=0.35 / 3, horizontal_spacing=0.08),
    dict(rows=1, cols=3, horizontal_spacing=0.2, subplot_titles=("a", "", "c")),
], ids=lambda g: ",".join(f"{k}" for k in g))
def test_a_grid_is_the_json_plotly_makes(grid):
    import plotly.io as pio

    default, pio.templates.default = pio.templates.default, None
    try:
        want = _json(_draw(go, plotly_subplots, grid))
    finally:
        pio.templates.default = default
    assert _json(_draw(_plot, _plot.make_subplots, grid)) == want


def test_single_figures_heatmaps_and_lines_are_the_json_plotly_makes():
    import plotly.io as pio

    def draw(lib):
        fig = lib.Figure(lib.Bar(y=["t1", "t2"], x=[3.5, 1.0], orientation="h", marker_color=["#d62728", "#1f77b4"]))
        fig.add_trace(lib.Heatmap(z=[[1.0, 2.0]], x=[0, 1], y=["3"], colorscale="RdBu", reversescale=True, zmid=1.0,
                                  colorbar=dict(title="load / mean", x=1.0, len=0.45, y=0.78)))
        fig.add_vline(x=2.0, line_dash="dash", line_color="#d62728", annotation_text="stuck after 2 s")
        fig.update_xaxes(title_text="idle", rangemode="tozero")
        fig.update_layout(height=400)
        return fig

    default, pio.templates.default = pio.templates.default, None
    try:
        want = _json(draw(go))
    finally:
        pio.templates.default = default
    got = _plot.Figure(_plot.Bar(x=[1]))
    got.data[0].meta = {"trajectory_ids": ["a"]}  # set as on a plotly trace, read the same way
    assert got.data[0].meta.trajectory_ids == ["a"] and got.data[0].marker is None
    assert _json(draw(_plot)) == want
