"""Module paths the README and docs once documented keep working, with a
DeprecationWarning, and give the very same objects as the new paths."""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

import trajstore
from trajstore._moved import MOVED
from trajstore.demo._simulate import RolloutConfig, trajectory_events


def _optional(new: str) -> None:
    try:
        importlib.import_module(new)
    except ImportError as e:  # an extra that is not installed (torch, fastapi, ray)
        pytest.skip(f"{new}: {e}")


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_module_path_warns_and_forwards(old, new):
    _optional(new)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; import {new} instead"):
        mod = importlib.import_module(old)
    target = importlib.import_module(new)
    assert mod.__all__ == target.__all__
    for name in target.__all__:
        assert getattr(mod, name) is getattr(target, name)
    with pytest.raises(AttributeError):
        mod.no_such_name  # noqa: B018 - forwarding does not invent attributes


def test_from_old_path_import_names_the_importer():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from trajstore.client import Writer\n"
            "import trajstore; assert Writer is trajstore.Writer\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    assert out.returncode == 0, out.stderr
    # the warning points at the user's import statement, not at importlib
    assert out.stderr.startswith("<string>:2: DeprecationWarning: trajstore.client is deprecated"), out.stderr


def test_importing_trajstore_loads_no_moved_edge():
    code = "import sys, trajstore; print(sorted(m for m in sys.modules if m.startswith(('trajstore.train', 'trajstore.inspect', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    assert out.stdout.strip() == "[]", out.stderr


def test_an_unknown_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("trajstore.no_such_module")


def test_routes_from_export_still_decodes_an_export(tmp_path):
    cfg = RolloutConfig(turns=2, prompt_tokens=6, output_tokens=3, observation_tokens=2, layers=2, topk=2, seed=3)
    with trajstore.connect(f"sqlite:///{tmp_path}/s.db") as store:
        store.append(trajectory_events(cfg, 0))
        store.materialize()
        sample = next(iter(store.samples()))
        from trajstore.inspect.export import export_samples
        export_samples(store.samples(), str(tmp_path / "out"))
    table = pq.read_table(str(tmp_path / "out"))
    with pytest.warns(DeprecationWarning, match="routes_from_export is deprecated"):
        from trajstore.export import routes_from_export
        routes = routes_from_export(table, 0)
    assert routes.shape == sample.routed_experts.shape
    np.testing.assert_array_equal(routes, sample.routed_experts)
