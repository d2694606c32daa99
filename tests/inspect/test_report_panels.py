"""How the run view's panels read to an RL engineer, checked on the figures the page draws
(the panels' own draw functions over the rows their SQL returns): lines break at buckets
with no data, per-version panels stay readable at hundreds of versions, the training panels
draw each metric once on its own axis, the length axis starts at zero, the expert-load
colorbar and legend keep apart. ``test_report_browser.py`` draws the same figures in
Chromium."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from trajstore.inspect import _panels_lineage, _panels_run, _panels_tokens, _step_panels  # noqa: E402
from trajstore.inspect._figures import MANY_VERSIONS, Clock, _gapped, drawing  # noqa: E402
from trajstore.inspect.sql import QueryResult  # noqa: E402

CLOCK = Clock(num_trajectories=100, first_s=1_700_000_000.0, last_s=1_700_000_090.0, width_s=10,
              max_output_len=50, stuck_after_s=300.0)


def _result(*rows) -> QueryResult:
    return QueryResult([f"c{i}" for i in range(len(rows[0]) if rows else 0)], list(rows))


def test_gapped_fills_every_missing_bucket_with_none():
    rows = [(2, 1.0, 5), (3, 2.0, 6), (7, 3.0, 7)]
    assert _gapped(rows) == [(2, 1.0, 5), (3, 2.0, 6), (4, None, None), (5, None, None), (6, None, None),
                             (7, 3.0, 7)]
    assert _gapped([]) == []


@pytest.mark.parametrize("draw, rows, trace", [
    # (bucket, rewarded, mean, min, max): the mean reward's line
    (_panels_run._reward_time_draw, [(0, 4, 0.5, 0.0, 1.0), (5, 4, 0.7, 0.0, 1.0)], "mean reward"),
    # (bucket, samples, mean, max, policy version)
    (_panels_run._staleness_time_draw, [(0, 8, 1.5, 3, 10), (6, 8, 2.5, 4, 20)], "mean staleness"),
    # (bucket, calls, mean length, max length, calls cut by the length limit)
    (_step_panels._length_time_draw, [(1, 10, 30.0, 48, 2), (4, 10, 20.0, 40, 0)], "mean"),
])
def test_time_series_break_at_buckets_with_no_data(draw, rows, trace):
    with drawing():
        fig = draw(CLOCK, [_result(*rows)])
    (line,) = [t for t in fig.data if t.name == trace]
    first, last = rows[0][0], rows[-1][0]
    assert len(line.x) == last - first + 1  # every bucket between the two, on the time axis
    assert line.y[0] is not None and line.y[-1] is not None
    assert all(y is None for y in line.y[1:-1])  # nothing drawn across the gap
    assert not line.connectgaps


def _versions(n: int) -> QueryResult:
    # agg_versions' row: version, generated tokens, trajectories, multi-version, mean reward, rewarded, failed, aborted
    return _result(*[(v, 100 + v, 10, 3, 0.5, 10, 1, 1) for v in range(n)])


@pytest.mark.parametrize("draw", [_panels_run._versions_draw, _panels_run._reward_version_draw])
def test_per_version_panels_are_lines_on_a_scale_past_many_versions(draw):
    with drawing():
        few = draw(CLOCK, [_versions(6)])
        many = draw(CLOCK, [_versions(300)])
    assert {t.type for t in few.data} == {"bar"}
    assert {few.layout[name].type for name in few.layout if name.startswith("xaxis")} == {"category"}
    assert {t.type for t in many.data} == {"scatter"} and all(t.mode == "lines" for t in many.data)
    assert {many.layout[name].type for name in many.layout if name.startswith("xaxis")} == {"linear"}
    assert all(list(t.x) == list(range(300)) for t in many.data)  # every version, run-long
    if draw is _panels_run._versions_draw:  # stacked bars stay stacked: areas
        stacked = [t for t in many.data if t.name in ("this version only", "also other versions")]
        assert len(stacked) == 2 and stacked[0].stackgroup == stacked[1].stackgroup is not None
    assert MANY_VERSIONS < 300


def test_the_training_steps_panel_draws_no_trainer_metric_and_keeps_its_title():
    steps = _result(*[("run-a", s, 8, 1.5, 3, 10) for s in range(50)])
    with drawing():
        fig = _panels_lineage._steps_draw(CLOCK, [steps, _result((400, 100))])
    assert [t.name for t in fig.data] == ["samples consumed", "mean staleness (policy - oldest token)",
                                         "max staleness"]
    assert len(fig.layout.annotations) == 1 and "never trained on: 25.0% of 400" in fig.layout.annotations[0].text
    # the trainer's metrics: one plot each, each on its own y axis
    metrics = _result(*[("run-a", s, 0, '{"loss": %f, "kl": %f}' % (1.0 / (s + 1), 0.001 * s)) for s in range(50)])
    with drawing():
        fig = _step_panels._metrics_draw(CLOCK, [metrics])
    titles = [a.text for a in fig.layout.annotations]
    assert sorted(titles) == ["kl", "loss"]  # each metric once, a subplot of its own
    assert len({t.yaxis for t in fig.data}) == 2  # each on its own y axis


def test_the_response_length_axis_starts_at_zero():
    bins = _result(*[(5, 40 + b, 3) for b in range(0, 10, 2)])
    means = _result((5, 44.0, 48))
    with drawing():
        fig = _panels_tokens._length_draw(CLOCK, [bins, means])
    assert fig.layout.xaxis.rangemode == "tozero" and fig.layout.yaxis2.rangemode == "tozero"


def test_the_expert_load_colorbar_and_legend_keep_apart():
    import numpy as np

    layer, e = np.indices((4, 16))
    rows = [(v, 4, 16, (10 + (e * 7 + layer + v) % 5).astype("<i8").tobytes()) for v in (1, 2)]  # one array a version
    with drawing():
        fig = _panels_tokens._experts_draw(CLOCK, [_result(*rows), _result()])
    bar = next(t.colorbar for t in fig.data if t.type == "heatmap" and t.showscale is not False)
    bottom_of_colorbar = bar.y - bar.len / 2  # its y is its middle (yanchor "middle")
    assert fig.layout.legend.yanchor == "bottom" and fig.layout.legend.y == 0.0
    assert bottom_of_colorbar > 0.4  # the legend's few entries sit well below it


def test_fractional_numbers_reach_the_page_with_three_significant_digits():
    """Hovers show the values the figure carries: fractional ones are rounded (integer digits
    kept), integers, labels and gaps untouched; a histogram's raw values are plotly's to bin."""
    import numpy as np
    import plotly.graph_objects as go

    from trajstore.inspect._figures import figure_json, rounded

    assert rounded([0.0123456, 12.345, 1234.56, 3, None, "v1", [2 / 3]]) == [0.0123, 12.3, 1235.0, 3, None, "v1",
                                                                              [0.667]]
    arr = rounded(np.array([1 / 3, -5.55555, 0.0, np.nan, 123456.789]))
    assert arr[:3].tolist() == [0.333, -5.56, 0.0] and np.isnan(arr[3]) and arr[4] == 123457.0
    assert rounded(np.arange(3)).tolist() == [0, 1, 2]
    with drawing():
        fig = go.Figure([go.Scatter(x=[1, 2], y=[0.123456789, np.nan], customdata=[[7, 0.98765]]),
                         go.Histogram(x=[0.123456789])])
        data = figure_json(fig)["data"]
    assert list(data[0]["y"][:1]) == [0.123] and list(data[0]["x"]) == [1, 2]
    assert [list(r) for r in data[0]["customdata"]] == [[7, 0.988]]
    assert list(data[1]["x"]) == [0.123456789]


def test_two_runs_side_by_side_on_the_training_panels():
    """Two trainer runs (or projections) on one store: each panel draws each run as its own traces,
    one colour a run, the run in the name, at the steps it recorded."""
    steps = _result(*[(run, s, 8, 1.5 + k, 3 + k, 10) for k, run in enumerate(("run-a", "run-b")) for s in range(20)])
    by_version = _result(("run-a", 3, 100, 0.01, 0.1), ("run-b", 3, 80, 0.02, 0.2))
    by_step = _result(*[(run, s, 0.01 * (k + 1), 50) for k, run in enumerate(("run-a", "run-b")) for s in range(20)])
    metrics = _result(*[(run, s, 0, '{"loss": %f}' % (k + 1.0 / (s + 1))) for k, run in enumerate(("run-a", "run-b"))
                        for s in range(20)])
    with drawing():
        figs = [_panels_lineage._steps_draw(CLOCK, [steps, _result((400, 100))]),
                _panels_lineage._train_mismatch_draw(CLOCK, [by_version, by_step]),
                _step_panels._metrics_draw(CLOCK, [metrics])]
    for fig in figs:
        for run in ("run-a", "run-b"):
            mine = [t for t in fig.data if t.name and (f"({run})" in t.name or t.name == run)]
            assert mine, (run, [t.name for t in fig.data])
            assert all(list(t.x) == (list(range(20)) if t.type == "scatter" else list(t.x)) for t in mine)
        colours = {run: {t.line.color if t.type == "scatter" else t.marker.color for t in fig.data
                         if t.name and run in t.name} for run in ("run-a", "run-b")}
        assert len(colours["run-a"]) == len(colours["run-b"]) == 1 and colours["run-a"] != colours["run-b"]
    bars = [t for t in figs[0].data if t.type == "bar"]
    assert [t.name for t in bars] == ["samples consumed (run-a)", "samples consumed (run-b)"]
    assert [list(t.y) for t in figs[0].data if t.name.startswith("mean staleness")] == [[1.5] * 20, [2.5] * 20]
