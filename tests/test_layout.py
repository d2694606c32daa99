"""The tree is the architecture map: these tests keep it true.

* Imports point one way: the core (``trajstore/*.py`` and ``trajstore/log/``)
  never imports the edges (``ingest/``, ``train/``, ``inspect/``, ``demo/``,
  ``scale/``, ``replay/``, ``cli``), not even inside a function.
* No import cycles between trajstore modules, function-level imports included.
* The public modules are exactly the ones the README and docs/ document
  (``PUBLIC_API`` below); every other module's name starts with ``_``.
* Every public module declares ``__all__``, it lists every public name the
  module defines, and it is exactly that module's row of ``PUBLIC_API``: a name
  enters or leaves the public surface only by changing this file too.
* One driver-error boundary: outside ``trajstore/log/`` no module imports a
  driver's exception classes (``sqlalchemy.exc``, psycopg's or sqlite3's) or
  names one in an ``except``; it runs its database calls inside
  ``trajstore.log._errors.driver_errors`` instead.
* One backend per module, one registry: outside ``trajstore/log/`` (and the
  frozen migrations) no module branches on a database's name (compares a
  string with ``"sqlite"``/``"postgresql"``, tests a URL's prefix, reads
  ``dialect.name`` or ``get_backend_name()``) or imports a backend's module or
  driver; it asks the backend ``trajstore.log._registry`` picks. Inside
  ``log/`` each module defines at most one backend, and every backend is in
  the registry under its name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import trajstore

PKG = Path(trajstore.__file__).resolve().parent
EDGES = ("trajstore.ingest", "trajstore.train", "trajstore.inspect", "trajstore.demo", "trajstore.scale",
         "trajstore.replay", "trajstore.cli")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "migrations":
            continue  # Alembic scripts, loaded by file path
        parts = ["trajstore", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """trajstore modules that ``name`` imports anywhere in its body."""
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t != "trajstore":
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_edge(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EDGES)


def test_core_never_imports_edges():
    bad = {m: sorted(t for t in GRAPH[m] if _is_edge(t)) for m in GRAPH if not _is_edge(m) and m != "trajstore"}
    assert {m: t for m, t in bad.items() if t} == {}


def test_no_import_cycles():
    # A package __init__ that re-exports its own submodule is not a cycle.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_check_sees_function_level_imports():
    # The rule above would be vacuous if nested imports were missed.
    assert "trajstore.materializer" in GRAPH["trajstore.store"]


PUBLIC = sorted(m for m in MODULES if not any(p.startswith("_") for p in m.split(".")))

# Each public module and its __all__. Names a public module imports from an
# internal one stay importable from it without being listed (e.g.
# ``trajstore.reader.plan_step``, ``trajstore.ingest.service.decode_json``).
PUBLIC_API: dict[str, set[str]] = {
    "trajstore": {
        "AppendResult", "ConflictError", "CorruptStoreError", "ReaderConfig", "ResumeStateError", "Sample",
        "SampleReader", "Store", "StoreUnavailable", "TrajstoreError", "ValidationError", "Writer", "connect"
    },
    "trajstore.cli": {"main"},
    "trajstore.demo": set(),
    "trajstore.errors": {
        "CommitUnknownError", "ConflictError", "ContentionError", "CorruptStoreError", "IndexInvariantError",
        "PayloadLocationError", "PayloadMissingError", "ProjectionChangedError", "ResumeStateError", "StoreUnavailable", "TrajstoreError",
        "ValidationError", "first_line"
    },
    "trajstore.events": {
        "ARRAY_FIELDS", "Event", "FINISH_STATUSES", "Generation", "LOGPROB_PLACEHOLDER", "Reward", "TrajectoryFinished",
        "TrajectoryStarted", "VersionLabel", "content_hash", "decimal_label", "identity_of", "parse_event",
        "parse_events", "routes_dtype", "same_content", "TOKEN_FIELDS", "validate_metadata",
        "ANNOTATION_ARRAYS", "LINEAGE_TYPES", "SampleAnnotation", "TrainStep", "lineage_identity"
    },
    "trajstore.fold": {
        "DEFAULT_POLICY", "EMPTY_HASH", "FoldMetrics", "FoldPolicy", "FoldResult", "FoldStep", "FoldTail", "fold",
        "first_model_version", "fold_step", "sequence_hash"
    },
    "trajstore.ingest": {"TrajectoryWriter", "Writer"},
    "trajstore.ingest.arrow_body": {
        "ARROW_CONTENT_TYPE", "ArrowBodyError", "decode_arrow_events", "encode_arrow_events"
    },
    "trajstore.ingest.client": {"HttpSink", "StoreSink", "TrajectoryWriter", "Writer"},
    "trajstore.ingest.jsonl": {"IngestResult", "ingest_file"},
    "trajstore.ingest.proxy": {
        "FORWARDED", "RECORDED", "Recorder", "Tag", "add_cli_arguments", "main", "make_proxy_app", "normalize_upstream",
        "serve_proxy", "serve_proxy_from_args", "tag_of", "version_label_events"
    },
    "trajstore.ingest.service": {
        "DEFAULT_PORT", "GroupCommitter", "ServeConfig", "add_cli_arguments", "app_from_env", "main", "make_app",
        "serve", "serve_from_args"
    },
    "trajstore.ingest.sglang": {
        "GenerateStreamAccumulator", "OpenAIStreamAccumulator", "finish_reason_of", "generation_from_generate",
        "generations_from_openai", "logprobs_from_sglang", "request_params_for_generate", "request_params_for_openai",
        "route_layout", "routed_experts_start_len_of", "routes_from_sglang"
    },
    "trajstore.ingest.sinks": {
        "BODY_FORMATS", "HttpSink", "Sink", "StoreSink", "encode_events", "error_from_response", "make_sink"
    },
    "trajstore.ingest.vllm": {
        "LOGPROB_FLOOR", "OpenAIStreamAccumulator", "VersionMap", "generation_from_output", "generations_from_openai",
        "generations_from_tito", "logprobs_from_vllm", "request_params_for_recording", "request_params_for_tito",
        "routed_experts_prompt_start_of", "token_model_versions_from_spans"
    },
    "trajstore.inspect": set(),
    "trajstore.inspect.export": {"export_samples", "export_table", "routes_from_export"},
    "trajstore.inspect.lineage_mlflow": {"consumed_rows", "log_consumed_samples"},
    "trajstore.inspect.report": {"add_cli_arguments", "render_report", "run_from_args"},
    "trajstore.inspect.trackers": {
        "MLflowSink", "StoreMetrics", "TensorBoardSink", "TrackerPusher", "TrackerSink", "WandbSink",
        "add_cli_arguments", "expert_load_violation", "run_from_args", "store_metrics"
    },
    "trajstore.inspect.sql": {
        "QueryResult", "add_cli_arguments", "create_reader_login", "print_result", "read_only", "run_from_args",
        "run_query", "with_iso_times"
    },
    "trajstore.inspect.views": {
        "READER_ROLE", "VIEW_NAMES", "create_views", "drop_reader_grants_sql", "drop_views", "reader_role_sql",
        "view_sql"
    },
    "trajstore.lineage": {
        "Annotation", "RecordedStep", "StepRecorder", "annotation_events", "read_annotations", "step_samples",
        "store_recorder"
    },
    "trajstore.log": set(),
    "trajstore.log.base": {
        "DATA_ERROR", "EventLog", "INTERNAL_ERROR", "RELEASED", "Repoint", "SAMPLES_KIND", "SampleIndex", "Shard",
        "StaleState", "TrajectoryWrite", "shard_index_of"
    },
    "trajstore.log.postgres": {
        "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_STATEMENT_TIMEOUT", "PostgreSQL", "default_payload_dir",
        "engine_options", "make_engines"
    },
    "trajstore.materializer": {"MaterializeStats", "Materializer", "shard_of"},
    "trajstore.payload": {"PayloadStore", "SegmentRows"},
    "trajstore.reader": {
        "ReaderConfig", "ReaderEventLog", "ReaderPayload", "ReaderSampleIndex", "ReaderStats", "ReaderStore",
        "SampleReader"
    },
    "trajstore.replay": {"ReplayReader", "ReplayStore"},
    "trajstore.replay.client": {"ReplayReader", "ReplayStore", "parse_locations"},
    "trajstore.replay.dataset": {"ReplayDataset"},
    "trajstore.sample": {"FIELDS", "Sample"},
    "trajstore.scale": set(),
    "trajstore.scale.ray_actors": {"MaterializerShard", "materialize_with_ray", "start_shards"},
    "trajstore.schema": {
        "events", "log_head", "materializer_checkpoints", "metadata", "projection_checkpoints", "projection_samples",
        "projection_unfoldable", "projections", "samples", "segments", "store_settings", "trajectories",
        "unfoldable_trajectories", "unresolved_labels", "version_labels", "lineage_annotation_versions",
        "lineage_annotations", "lineage_step_samples", "lineage_steps", "reader_leases"
    },
    "trajstore.store": {"AppendCheck", "AppendResult", "DEFAULT_URL", "Store", "connect", "resolve_url"},
    "trajstore.train": set(),
    "trajstore.train.collate": {"SampleDataset", "collate", "collate_arrays", "to_tensors"},
    "trajstore.train.megatron": {"RouteReplay", "moe_layer_ids", "replay_indices", "replay_routes"},
    "trajstore.train.skyrl": {"SkyRLBatch", "generator_output", "skyrl_batches", "trajectory_id_type"},
    "trajstore.train.verl": {"data_proto", "verl_batches"},
}


def test_the_public_modules_are_exactly_the_documented_ones():
    assert PUBLIC == sorted(PUBLIC_API)


@pytest.mark.parametrize("name", PUBLIC)
def test_all_lists_exactly_the_public_definitions(name: str):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:  # an optional extra that is not installed
        pytest.skip(f"{name}: {e}")
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    for n in mod.__all__:
        assert hasattr(mod, n), f"{name}.__all__ names {n!r}, which does not exist"
    defined = {
        n for n, v in vars(mod).items()
        if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == name
    }
    missing = defined - set(mod.__all__)
    assert not missing, f"{name} defines public {sorted(missing)} but __all__ leaves them out"
    assert len(mod.__all__) == len(set(mod.__all__)), f"{name}.__all__ lists a name twice"
    assert set(mod.__all__) == PUBLIC_API[name], f"{name}.__all__ is not its row of PUBLIC_API"


# -- one driver-error boundary -------------------------------------------------

DRIVERS = ("sqlalchemy", "psycopg", "sqlite3")
# sqlalchemy.exc names that are no driver's error: a URL SQLAlchemy cannot parse
NOT_DRIVER_ERRORS = {"ArgumentError"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _driver_error_uses(source: str) -> list[str]:
    """Where ``source`` imports a driver's exception classes or catches one."""
    import sqlalchemy.exc

    sa_errors = {n for n, v in vars(sqlalchemy.exc).items()
                 if inspect.isclass(v) and issubclass(v, BaseException)} - NOT_DRIVER_ERRORS
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith(("sqlalchemy.exc", "psycopg.errors"))]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            root = mod.split(".")[0]
            if mod.startswith(("sqlalchemy.exc", "psycopg.errors")):
                names = [a.name for a in node.names if a.name not in NOT_DRIVER_ERRORS]
            elif root in DRIVERS:
                names = [a.name for a in node.names if a.name.endswith(("Error", "Warning", "Exception"))
                         or a.name in ("exc", "errors")]
            else:
                names = []
            found += [f"line {node.lineno}: from {mod} import {n}" for n in names]
        elif isinstance(node, ast.ExceptHandler) and node.type is not None:
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            for t in types:
                name = _dotted(t)
                if name.split(".")[0] in DRIVERS or name.split(".")[-1] in sa_errors:
                    found.append(f"line {node.lineno}: except {name}")
    return found


def test_no_driver_error_is_caught_outside_the_boundary():
    log_pkg = PKG / "log"
    bad = {name: _driver_error_uses(path.read_text()) for name, path in MODULES.items()
           if log_pkg not in path.parents}
    assert {m: uses for m, uses in bad.items() if uses} == {}


def test_the_boundary_check_sees_driver_errors():
    # The rule above would be vacuous if it missed the ways code catches driver errors.
    source = """
import sqlite3
import psycopg
from sqlalchemy.exc import IntegrityError, ArgumentError
def f():
    from sqlalchemy.exc import DBAPIError
    try:
        pass
    except (sqlite3.Error, sqlite3.Warning):
        pass
    except psycopg.Error:
        pass
    except DBAPIError:
        pass
    except ArgumentError:
        pass
"""
    uses = _driver_error_uses(source)
    assert sorted(u.split(": ", 1)[1] for u in uses) == sorted([
        "from sqlalchemy.exc import IntegrityError", "from sqlalchemy.exc import DBAPIError",
        "except sqlite3.Error", "except sqlite3.Warning", "except psycopg.Error", "except DBAPIError"])


# -- one backend per module, one registry ------------------------------------------

DATABASE_NAMES = ("sqlite", "postgresql", "postgres")
BACKEND_MODULES = ("trajstore.log._sqlite", "trajstore.log.postgres", "sqlite3", "psycopg")


def _names_a_database(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.lower().startswith(DATABASE_NAMES))


def _dialect_branches(source: str) -> list[str]:
    """Where ``source`` decides by a database's name, or reaches a backend's module or driver."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare) and any(_names_a_database(n) for n in [node.left, *node.comparators]):
            found.append(f"line {line}: compares with {ast.unparse(node)}")
        elif (isinstance(node, ast.Compare) and any(isinstance(n, (ast.Tuple, ast.List, ast.Set))
                                                    and any(_names_a_database(e) for e in n.elts)
                                                    for n in node.comparators)):
            found.append(f"line {line}: compares with {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args and _names_a_database(node.args[0])):
            found.append(f"line {line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "get_backend_name":
            found.append(f"line {line}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
              and node.value.attr == "dialect"):
            found.append(f"line {line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            found += [f"line {line}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in ("sqlite3", "psycopg") or a.name in BACKEND_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            if mod.split(".")[0] in ("sqlite3", "psycopg") or any(t in BACKEND_MODULES for t in targets):
                found.append(f"line {line}: from {mod} import {', '.join(a.name for a in node.names)}")
    return found


def test_nothing_outside_log_branches_on_the_database():
    log_pkg = PKG / "log"
    bad = {name: _dialect_branches(path.read_text()) for name, path in MODULES.items()
           if log_pkg not in path.parents}
    assert {m: uses for m, uses in bad.items() if uses} == {}


def test_the_backend_check_sees_dialect_branches():
    # The rule above would be vacuous if it missed the ways code has branched on the database.
    source = """
import sqlite3
from trajstore.log import _sqlite
from trajstore.log.postgres import engine_options
def f(url, conn, store, dialect, name):
    if conn.dialect.name == "postgresql":
        pass
    if store.log.write_engine.dialect.name != "postgresql":
        pass
    if dialect == "postgresql" or name in ("sqlite", "postgresql"):
        pass
    if make_url(url).get_backend_name() != "sqlite" or not url.startswith("sqlite"):
        pass
    pg = url.startswith("postgresql")
    print("sqlite:///x.db is a store URL")
"""
    lines = {int(u.split(":")[0].removeprefix("line ")) for u in _dialect_branches(source)}
    assert lines == {2, 3, 4, 6, 8, 10, 12, 14}  # every branch, not the message naming a URL (15)


def test_each_backend_is_one_module_in_the_one_registry():
    from trajstore.log._backend import Backend
    from trajstore.log._registry import BACKENDS

    defined: dict[str, list[str]] = {}
    for name in MODULES:
        if name.startswith("trajstore.log"):
            mod = importlib.import_module(name)
            defined[name] = [n for n, v in vars(mod).items() if inspect.isclass(v) and issubclass(v, Backend)
                             and v is not Backend and v.__module__ == name]
    assert {m: cs for m, cs in defined.items() if len(cs) > 1} == {}, "a module defines two backends"
    classes = {getattr(importlib.import_module(m), cs[0]) for m, cs in defined.items() if cs}
    assert set(BACKENDS.values()) == classes, "a backend class is not in the registry (or one in it is elsewhere)"
    assert all(name == backend.name for name, backend in BACKENDS.items())
