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
from trajstore._util.moved import MOVED
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


# names ``trajstore.payload`` exported before they became internals -> where they live now
PAYLOAD_INTERNALS = {
    "list_column": ("trajstore.payload._columns", "list_column"),
    "binary_column": ("trajstore.payload._columns", "binary_column"),
    "column_chunks": ("trajstore.payload._columns", "column_chunks"),
    "binary_chunks": ("trajstore.payload._columns", "binary_chunks"),
    "routes_from_bytes": ("trajstore.payload._columns", "routes_from_bytes"),
    "rows_per_batch": ("trajstore.payload._format", "rows_per_batch"),
    "fsync_dir": ("trajstore.payload._durable", "fsync_path"),
    "write_arrow_segment": ("trajstore.payload._direct", "write_arrow_segment"),
    "filesystem_of": ("trajstore.payload._filesystem", "filesystem_of"),
    "is_uri": ("trajstore.payload._filesystem", "is_uri"),
    "S3_DEFAULTS": ("trajstore.payload._filesystem", "S3_DEFAULTS"),
}


@pytest.mark.parametrize("name", sorted(PAYLOAD_INTERNALS))
def test_payload_internal_names_still_import_from_payload_with_a_warning(name):
    import trajstore.payload as payload

    module, new = PAYLOAD_INTERNALS[name]
    with pytest.warns(DeprecationWarning, match=rf"trajstore\.payload\.{name} is internal now"):
        got = getattr(payload, name)
    assert got is getattr(importlib.import_module(module), new)


def test_payload_public_names_do_not_warn():
    import warnings

    import trajstore.payload as payload

    assert payload.__all__ == ["PayloadStore", "SegmentRows"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from trajstore.payload import PayloadStore, SegmentRows  # noqa: F401
    with pytest.raises(AttributeError):
        payload.no_such_name  # noqa: B018


def test_from_payload_import_an_internal_name_warns_at_the_importer():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from trajstore.payload import fsync_dir, list_column\n"
            "from trajstore.payload._durable import fsync_path\n"
            "assert fsync_dir is fsync_path\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("<string>:2: DeprecationWarning: trajstore.payload.fsync_dir is internal"), out.stderr


def test_the_split_sql_index_keeps_its_old_names():
    # trajstore.log.sql was split by job; every name it exported still comes through the old path
    sys.modules.pop("trajstore.log.sql", None)
    with pytest.warns(DeprecationWarning, match="trajstore.log.sql is deprecated"):
        old = importlib.import_module("trajstore.log.sql")
    from trajstore.log._events import SqlEventLog
    from trajstore.log._errors import translate
    from trajstore.log._samples import SqlProjectionIndex, SqlSampleIndex
    assert sorted(old.__all__) == sorted(["SqlEventLog", "SqlSampleIndex", "SqlProjectionIndex", "first_line",
                                          "open_sql", "translate", "RELEASED"])
    assert (old.SqlEventLog, old.SqlSampleIndex, old.SqlProjectionIndex, old.translate) == (
        SqlEventLog, SqlSampleIndex, SqlProjectionIndex, translate)
    assert old.RELEASED == "trajectory_released"


# names ``trajstore.ingest.proxy`` exported before they became internals -> where they live now
PROXY_INTERNALS = {
    "normalize_upstream": "trajstore.ingest.proxy._app",
    "version_label_events": "trajstore.ingest.proxy._app",
    "tag_of": "trajstore.ingest.proxy._record",
}


@pytest.mark.parametrize("name", sorted(PROXY_INTERNALS))
def test_proxy_internal_names_still_import_from_the_proxy_with_a_warning(name):
    _optional("trajstore.ingest.proxy")
    import trajstore.ingest.proxy as proxy

    assert name not in proxy.__all__
    with pytest.warns(DeprecationWarning, match=rf"trajstore\.ingest\.proxy\.{name} is internal now"):
        got = getattr(proxy, name)
    assert got is getattr(importlib.import_module(PROXY_INTERNALS[name]), name)
    with pytest.raises(AttributeError):
        proxy.no_such_name  # noqa: B018


def test_the_proxy_api_does_not_warn():
    _optional("trajstore.ingest.proxy")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from trajstore.ingest.proxy import FORWARDED, RECORDED, main, make_proxy_app, serve_proxy  # noqa: F401
        from trajstore.ingest.proxy import _sglang  # noqa: F401 - a submodule is not a deprecated name


def test_from_proxy_import_an_internal_name_warns_at_the_importer():
    _optional("trajstore.ingest.proxy")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from trajstore.ingest.proxy import normalize_upstream\n"
            "assert normalize_upstream('http://h:1/v1') == 'http://h:1'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp")
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("<string>:2: DeprecationWarning: trajstore.ingest.proxy.normalize_upstream is "
                                 "internal"), out.stderr


def test_store_dialect_of_still_picks_the_backend_with_a_warning(tmp_path):
    # trajstore.store.dialect_of was public; the backend registry picks a URL's backend now
    import trajstore.store as store_module
    from trajstore.log._registry import backend_of

    assert "dialect_of" not in store_module.__all__
    url = f"sqlite:///{tmp_path}/s.db"
    with pytest.warns(DeprecationWarning, match="trajstore.store.dialect_of is deprecated"):
        from trajstore.store import dialect_of
    assert dialect_of is backend_of
    backend = dialect_of(url)
    assert backend.default_payload_dir(url) == f"{tmp_path}/s.db.payload"
    write_engine, read_engine = backend.make_engines(url)  # what the module it returned offered
    write_engine.dispose()
    read_engine.dispose()
    with pytest.raises(AttributeError):
        store_module.no_such_name  # noqa: B018
