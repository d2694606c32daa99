"""Every numeric flag is one argparse type (``trajstore._util.argtypes.number``): NaN and
infinities are refused in one line naming the flag (exit 2), as are values out of
range; the report's library entry points refuse them too (never into SQL or a page)."""

from __future__ import annotations

import math

import pytest

import trajstore
from trajstore.cli import main
from trajstore.errors import TrajstoreError

FLAGS = [
    (["report", "--serve", "--refresh-s={v}"], "--refresh-s"),
    (["report", "--stuck-after-s={v}", "out"], "--stuck-after-s"),
    (["gc", "--grace-s={v}"], "--grace-s"),
    (["gc", "--target-mb={v}"], "--target-mb"),
    (["gc", "--lease-max-age-s={v}"], "--lease-max-age-s"),
    (["sql", "--timeout-s={v}", "SELECT 1"], "--timeout-s"),
    (["replay", "--hold-s={v}"], "--hold-s"),
    (["replay", "--samples-per-insert={v}"], "--samples-per-insert"),
    (["serve", "--max-body-mb={v}"], "--max-body-mb"),
    (["serve", "--group-wait-ms={v}"], "--group-wait-ms"),
    (["serve", "--linger-ms={v}"], "--linger-ms"),
    (["serve", "--max-batch-mb={v}"], "--max-batch-mb"),
    (["proxy", "--upstream", "http://127.0.0.1:9", "--linger-ms={v}"], "--linger-ms"),
    (["materialize", "--abandon-after-s={v}"], "--abandon-after-s"),
    (["track", "--interval-s={v}", "--tensorboard", "tb"], "--interval-s"),
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
@pytest.mark.parametrize("argv, flag", FLAGS, ids=[f for _, f in FLAGS])
def test_non_finite_values_are_refused_naming_the_flag(argv, flag, value, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--store", f"sqlite:///{tmp_path}/s.db", *[a.format(v=value) for a in argv]])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: {value!r} is not a finite number" in err, err
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("argv, words", [
    (["report", "--serve", "--refresh-s", "0"], "argument --refresh-s: 0 must be more than 0"),
    (["gc", "--grace-s", "-1"], "argument --grace-s: -1 must be at least 0"),
    (["serve", "--port", "70000"], "argument --port: 70000 must be at most 65535"),
    (["materialize", "--shard", "x"], "argument --shard: 'x' is not an integer"),
    (["gc", "--lease-max-age-s", "-1"], "argument --lease-max-age-s: -1 must be at least 0"),
    (["replay", "--max-lineage-put-bytes", "0"], "argument --max-lineage-put-bytes: 0 must be at least 1"),
    (["replay", "--max-lineage-put-rows", "1.5"], "argument --max-lineage-put-rows: '1.5' is not an integer"),
])
def test_out_of_range_values_are_refused(argv, words, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--store", f"sqlite:///{tmp_path}/s.db", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_the_report_refuses_a_non_finite_stuck_threshold_before_any_sql(bad, tmp_path):
    from trajstore.inspect.report import render_report
    from trajstore.inspect._live import serve_report

    url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(url, payload=str(tmp_path / "p")).close()
    with pytest.raises(TrajstoreError, match="stuck_after_s must be a finite number"):
        render_report(url, str(tmp_path / "r"), stuck_after_s=bad)
    assert not (tmp_path / "r").exists()
    with pytest.raises(TrajstoreError, match="--refresh-s must be a positive number"):
        serve_report(url, token=None, refresh_s=bad, port=0)
