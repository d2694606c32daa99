"""``trajstore report``: renders from a demo-like store on both backends; every
plot is a real PNG of the expected size with something drawn on it."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
from matplotlib import image as mpimg

import trajstore
from trajstore.cli import main
from trajstore.demo.run import DEMO_CONFIG
from tests.helpers import reader_url_for
from trajstore.inspect.report import DPI, FIGSIZE_IN, PLOTS, render_report
from trajstore.demo.simulate import trajectory_events

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_TRAJECTORIES = 40


@pytest.fixture
def demo_like(store_url, tmp_path):
    """The demo's rollout shape, smaller: versions advance over the run, aborts resume."""
    from dataclasses import replace

    cfg = replace(DEMO_CONFIG, prompt_tokens=24, output_tokens=16, observation_tokens=8)
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    for i in range(NUM_TRAJECTORIES):
        store.append(trajectory_events(cfg, i, version=i * 4 // NUM_TRAJECTORIES))
    stats = store.materialize()
    yield store, stats
    store.close()


def assert_real_png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, f"{path} is not a PNG"
    pixels = mpimg.imread(path)
    height, width = pixels.shape[:2]
    assert (width, height) == (round(FIGSIZE_IN[0] * DPI), round(FIGSIZE_IN[1] * DPI)), path
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10, f"{path} is blank"


def test_report_renders_every_plot(demo_like, tmp_path):
    store, stats = demo_like
    out = tmp_path / "report"
    written = render_report(reader_url_for(store.url), str(out), title="run 7")
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert len(PLOTS) == 6 and len(written["images"]) == len(PLOTS)
    assert pngs == sorted(f"{p.name}.png" for p in PLOTS)
    for name in pngs:
        assert_real_png(str(out / name))
    page = (out / "index.html").read_text()
    assert sorted(re.findall(r"<img src='([^']+)'", page)) == pngs
    assert "<title>run 7</title>" in page
    assert f"{stats.merge_ratio:.3f}" in page  # the summary agrees with the materializer
    assert f"<td>{NUM_TRAJECTORIES} (" in page


def test_report_of_an_empty_store(store_url, tmp_path):
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()
    written = render_report(reader_url_for(store_url), str(tmp_path / "report"))
    assert len(written["images"]) == len(PLOTS)
    for path in written["images"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE


def test_report_command(demo_like, tmp_path, capsys):
    store, _ = demo_like
    rc = main(["--store", reader_url_for(store.url), "report", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.strip() == f"wrote {tmp_path / 'r' / 'index.html'} with {len(PLOTS)} plots"


def test_without_matplotlib_the_error_says_what_to_install(demo_like, tmp_path, capsys, monkeypatch):
    store, _ = demo_like
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    rc = main(["--store", reader_url_for(store.url), "report", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err == "error: trajstore report needs matplotlib: pip install -e '.[report]' in the trajstore checkout\n"
