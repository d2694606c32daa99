"""The tree is the architecture map: these tests keep it true.

* Imports point one way: the core (``trajstore/*.py`` and ``trajstore/log/``)
  never imports the edges (``ingest/``, ``train/``, ``inspect/``, ``demo/``,
  ``scale/``, ``replay/``, ``cli``), not even inside a function.
* No import cycles between trajstore modules, function-level imports included,
  nor between the folders (concerns): they stack into layers.
* Nothing inside the package imports the root facade (``trajstore/__init__``).
* The public modules are exactly the ones the README and docs/ document
  (``PUBLIC_API`` below); every other module's name starts with ``_``.
* Every public module declares ``__all__``, it lists every public name the
  module defines, and it is exactly that module's rows of ``PUBLIC_API`` (the
  API) and ``EXTENSION_API`` (importable, for extensions; not the API): a name
  enters or leaves the public surface only by changing this file too, and
  docs/reference.md lists each tier ("Python API", "Extension API"), every
  name once.
* No module is longer than ``MAX_MODULE_LINES``: a longer one holds several jobs.
* One driver-error boundary: outside ``trajstore/log/`` no module imports a
  driver's exception classes (``sqlalchemy.exc``, psycopg's or sqlite3's) or
  names one in an ``except``; it runs its database calls inside
  ``trajstore.log._errors.driver_errors`` instead.
* One error boundary per seam for what the storage libraries raise: outside
  ``trajstore/payload/`` no module catches an ``OSError`` (``IOError``,
  ``EnvironmentError``, ``FileNotFoundError`` and every other subclass, by any
  alias), one of pyarrow's errors or botocore's (in an ``except``, a
  ``contextlib.suppress`` or an ``isinstance``), or imports botocore; it runs
  its payload I/O inside ``trajstore.payload._errors.payload_errors``. The
  local edges that do (a socket, the terminal, a client's request body) are
  listed in ``IO_EDGES`` with the reason, and an entry leaves once its module
  no longer catches what it names.
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
import sys
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
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_edge(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EDGES)


def test_nothing_imports_the_root_package():
    # The root (``trajstore/__init__``) is the public facade: it imports the layers, and
    # re-exports an edge's ``Writer``; a module that imported the root back would close
    # a loop through every layer. A module names what it uses by its own path.
    assert sorted(m for m, ts in GRAPH.items() if "trajstore" in ts) == []


def test_the_root_check_sees_an_import_of_the_root(tmp_path):
    # The rule above would be vacuous if the graph dropped the root package.
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import trajstore\n    return trajstore.connect()\n"
                    "from trajstore import lineage, connect\n")
    assert _imports("trajstore.m", path) == {"trajstore", "trajstore.lineage"}
    path.write_text("from trajstore.store import connect\nfrom trajstore import lineage\n")
    assert _imports("trajstore.m", path) == {"trajstore.store", "trajstore.lineage"}


def test_core_never_imports_edges():
    bad = {m: sorted(t for t in GRAPH[m] if _is_edge(t)) for m in GRAPH if not _is_edge(m) and m != "trajstore"}
    assert {m: t for m, t in bad.items() if t} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    # A package __init__ that re-exports its own submodule is not a cycle.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def _concern(name: str) -> str:
    """The folder a module belongs to (``trajstore.reader._plan`` -> ``reader``); a
    module at the root is a concern of its own."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else name


def test_no_two_concerns_import_each_other():
    # The folders are the architecture (docs/design.md, "The tree is the map"): between
    # concerns, too, imports point one way, so the folders stack into layers.
    graph: dict[str, set[str]] = {}
    for m, ts in GRAPH.items():
        graph.setdefault(_concern(m), set()).update(_concern(t) for t in ts if _concern(t) != _concern(m))
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_loop_between_concerns():
    # The rules above would be vacuous if the check missed a loop through several nodes.
    assert _cycles({"_append": {"rollout"}, "rollout": {"log"}, "log": {"_append"}}) == [
        ["_append", "rollout", "log", "_append"]]
    assert _concern("trajstore.reader._plan") == "reader" and _concern("trajstore.store") == "store"


def test_the_check_sees_function_level_imports():
    # The rule above would be vacuous if nested imports were missed.
    assert "trajstore.materializer" in GRAPH["trajstore.store"]


PUBLIC = sorted(m for m in MODULES if not any(p.startswith("_") for p in m.split(".")))

# Each public module and its __all__, in two tiers. Names a public module imports
# from an internal one stay importable from it without being listed (e.g.
# ``trajstore.reader.plan_step``, ``trajstore.ingest.service.decode_json``).
# The API: what a user builds on, documented in docs/reference.md "Python API" and the
# guides: the root, the errors, the wire format's events, the readers, the writer, the
# servers (ingest service, recording proxy, replay), the materializer, the rollout driver and
# the trainers' adapters. Every public module is a row, even with nothing of it in the API.
PUBLIC_API: dict[str, set[str]] = {
    "trajstore": {
        "AppendResult", "ConflictError", "CorruptStoreError", "ReaderConfig", "ResumeStateError", "Sample",
        "SampleReader", "Store", "StoreUnavailable", "TrajstoreError", "ValidationError", "Writer", "connect"
    },
    "trajstore.cli": {"main"},
    "trajstore.demo": set(),
    "trajstore.errors": {
        "CommitUnknownError", "ConflictError", "ContentionError", "CorruptStoreError", "IndexInvariantError",
        "PayloadLocationError", "PayloadMissingError", "ProjectionChangedError", "ResumeStateError", "StoreUnavailable",
        "TrajstoreError", "ValidationError"
    },
    "trajstore.events": {
        "ANNOTATION_ARRAYS", "ARRAY_FIELDS", "Event", "FINISH_STATUSES", "Generation", "GroupDropped", "LINEAGE_TYPES",
        "LOGPROB_PLACEHOLDER", "Reward", "SampleAnnotation", "TOKEN_FIELDS", "TrainStep", "TrajectoryFinished",
        "TrajectoryStarted", "VersionLabel", "WHOLE_STATUSES", "content_hash", "decimal_label", "identity_of", "lineage_identity",
        "parse_event", "parse_events", "routes_dtype", "same_content", "validate_metadata"
    },
    "trajstore.fold": set(),
    "trajstore.ingest": {"TrajectoryWriter", "Writer"},
    "trajstore.ingest.arrow_body": set(),
    "trajstore.ingest.client": {"HttpSink", "StoreSink", "TrajectoryWriter", "Writer"},
    "trajstore.ingest.jsonl": set(),
    "trajstore.ingest.proxy": {"FORWARDED", "RECORDED", "main", "make_proxy_app", "serve_proxy"},
    "trajstore.ingest.service": {"DEFAULT_PORT", "ServeConfig", "main", "make_app", "serve"},
    "trajstore.ingest.sglang": set(),
    "trajstore.ingest.sinks": set(),
    "trajstore.ingest.skyrl": {"RecordingGenerator", "RecordingInferenceClient"},
    "trajstore.ingest.verl": {"RecordingAgentLoopManager", "RecordingAgentLoopWorker", "RecordingLLMClient"},
    "trajstore.ingest.vllm": set(),
    "trajstore.inspect": set(),
    "trajstore.inspect.export": set(),
    "trajstore.inspect.lineage_mlflow": set(),
    "trajstore.inspect.lineage_openlineage": set(),
    "trajstore.inspect.report": set(),
    "trajstore.inspect.sql": set(),
    "trajstore.inspect.trackers": set(),
    "trajstore.inspect.views": set(),
    "trajstore.lineage": {"Annotation", "read_annotations", "step_samples"},
    "trajstore.log": set(),
    "trajstore.log.base": set(),
    "trajstore.log.postgres": set(),
    "trajstore.materializer": {"MaterializeStats", "Materializer"},
    "trajstore.payload": set(),
    "trajstore.reader": {
        "FifoPolicy", "FreshnessPolicy", "ReaderConfig", "ReaderStats", "ReadyFirstPolicy", "ReusePolicy", "SampleReader",
        "SamplingPolicy"
    },
    "trajstore.replay": {"ReplayReader", "ReplayStore"},
    "trajstore.replay.client": {"ReplayReader", "ReplayStore"},
    "trajstore.replay.dataset": {"ReplayDataset"},
    "trajstore.rollout": {"Episode", "Outcome", "RolloutDriver", "RolloutStats"},
    "trajstore.sample": {"Sample"},
    "trajstore.scale": set(),
    "trajstore.scale.ray_actors": set(),
    "trajstore.schema": set(),
    "trajstore.store": {"AppendResult", "Store", "connect"},
    "trajstore.train": set(),
    "trajstore.train.collate": {"SampleDataset", "collate", "collate_arrays", "to_tensors"},
    "trajstore.train.megatron": {"RouteReplay", "moe_layer_ids", "replay_indices", "replay_routes"},
    "trajstore.train.skyrl": {"SkyRLBatch", "generator_output", "skyrl_batches", "trajectory_id_type"},
    "trajstore.train.verl": {"data_proto", "verl_batches"},
}

# The extension API: importable and documented, once, in docs/reference.md "Extension API",
# for code that implements a backend or a reader's store, an engine adapter, a projection
# or a tool on the store's tables; the CLI's edge-command protocol (``add_cli_arguments``,
# ``*_from_args``). Not the API: it may change between releases (with a DeprecationWarning).
# A public module's ``__all__`` is its API row and its extension row together.
EXTENSION_API: dict[str, set[str]] = {
    "trajstore.errors": {"first_line"},
    "trajstore.fold": {
        "DEFAULT_POLICY", "EMPTY_HASH", "FoldMetrics", "FoldPolicy", "FoldResult", "FoldStep", "FoldTail",
        "first_model_version", "fold", "fold_step", "sequence_hash"
    },
    "trajstore.ingest.arrow_body": {
        "ARROW_CONTENT_TYPE", "ArrowBodyError", "decode_arrow_events", "encode_arrow_events"
    },
    "trajstore.ingest.jsonl": {"IngestResult", "ingest_file"},
    "trajstore.ingest.proxy": {"Recorder", "Tag", "add_cli_arguments", "serve_proxy_from_args"},
    "trajstore.ingest.service": {"GroupCommitter", "add_cli_arguments", "app_from_env", "serve_from_args"},
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
    "trajstore.inspect.export": {"export_samples", "export_table", "routes_from_export"},
    "trajstore.inspect.lineage_mlflow": {"consumed_rows", "log_consumed_samples"},
    "trajstore.inspect.lineage_openlineage": {"FACET_NAME", "emit_consumed_samples", "run_event"},
    "trajstore.inspect.report": {"add_cli_arguments", "render_report", "run_from_args"},
    "trajstore.inspect.sql": {
        "QueryResult", "add_cli_arguments", "create_reader_login", "print_result", "read_only", "run_from_args",
        "run_query", "with_iso_times"
    },
    "trajstore.inspect.trackers": {
        "MLflowSink", "StoreMetrics", "TensorBoardSink", "TrackerPusher", "TrackerSink", "WandbSink",
        "add_cli_arguments", "add_tracker_arguments", "expert_load_violation", "mlflow_name", "run_from_args",
        "sinks_from_args", "store_metrics", "wants_trackers"
    },
    "trajstore.inspect.views": {
        "READER_ROLE", "VIEW_NAMES", "create_views", "drop_reader_grants_sql", "drop_views", "reader_role_sql",
        "view_sql"
    },
    "trajstore.lineage": {"RecordedStep", "StepRecorder", "annotation_events", "store_recorder"},
    "trajstore.log.base": {
        "ChecksFailed", "DATA_ERROR", "EventLog", "INTERNAL_ERROR", "RELEASED", "Repoint", "SAMPLES_KIND",
        "SampleIndex", "Shard", "StaleState", "TrajectoryWrite", "shard_index_of"
    },
    "trajstore.log.postgres": {
        "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_STATEMENT_TIMEOUT", "PostgreSQL", "default_payload_dir",
        "engine_options", "make_engines"
    },
    "trajstore.materializer": {"shard_of"},
    "trajstore.payload": {"PayloadStore", "SegmentRows"},
    "trajstore.reader": {"ReaderEventLog", "ReaderPayload", "ReaderSampleIndex", "ReaderStore"},
    "trajstore.replay.client": {"parse_locations"},
    "trajstore.sample": {"FIELDS"},
    "trajstore.scale.ray_actors": {"MaterializerShard", "materialize_with_ray", "start_shards"},
    "trajstore.schema": {
        "events", "lineage_annotation_versions", "lineage_annotations", "lineage_step_samples", "lineage_steps",
        "log_head", "materializer_checkpoints", "metadata", "projection_checkpoints", "projection_samples",
        "projection_unfoldable", "projections", "samples", "segments", "store_settings", "trajectories",
        "unfoldable_trajectories", "unresolved_labels", "version_labels", "agg_expert_load", "agg_logprobs",
        "agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories", "reader_leases",
        "agg_trajectory_stats", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
        "agg_group_variance", "agg_samples", "agg_staleness", "agg_policy_versions", "agg_logprobs_delta",
        "agg_rewards_delta", "agg_trajectory_shapes_delta", "agg_tasks_delta", "agg_versions_delta", "agg_groups_delta",
        "agg_samples_delta", "agg_staleness_delta", "agg_policy_versions_delta", "agg_expert_load_delta",
        "agg_expert_pending", "run_owners", "ledger_groups"
    },
    "trajstore.store": {"AppendCheck", "DEFAULT_URL", "resolve_url"},
}


# Names a public module exported before they became internals: still importable
# from there with a DeprecationWarning (tests/test_moved_modules.py), in no tier.
NO_LONGER_EXPORTED: dict[str, set[str]] = {
    "trajstore.ingest.proxy": {"normalize_upstream", "tag_of", "version_label_events"},
    "trajstore.store": {"dialect_of"},
}

SURFACE: dict[str, set[str]] = {m: PUBLIC_API[m] | EXTENSION_API.get(m, set()) for m in PUBLIC_API}


def test_the_public_modules_are_exactly_the_documented_ones():
    assert PUBLIC == sorted(PUBLIC_API)
    assert set(EXTENSION_API) <= set(PUBLIC_API)


def test_a_name_is_api_or_extension_api_not_both():
    assert {m: PUBLIC_API[m] & names for m, names in EXTENSION_API.items() if PUBLIC_API[m] & names} == {}
    assert {m: SURFACE[m] & names for m, names in NO_LONGER_EXPORTED.items() if SURFACE[m] & names} == {}


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
    assert set(mod.__all__) == SURFACE[name], f"{name}.__all__ is not its rows of PUBLIC_API and EXTENSION_API"


REFERENCE = PKG.parent / "docs" / "reference.md"


def _documented_tier(heading: str) -> list[tuple[str, str]]:
    """(module, name) of each name in the table under ``heading`` of docs/reference.md."""
    import re

    text = REFERENCE.read_text()
    start = text.index("\n" + heading + "\n")
    stop = text.find("\n## ", start + 1)
    rows = []
    for line in text[start: stop if stop != -1 else len(text)].splitlines():
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().startswith("`trajstore"):
            module = cells[1].strip().strip("`")
            rows += [(module, n) for n in re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", cells[2])]
    return rows


@pytest.mark.parametrize("heading,tier", [("## Python API", PUBLIC_API), ("## Extension API", EXTENSION_API)])
def test_the_reference_lists_each_tier_every_name_once(heading: str, tier: dict[str, set[str]]):
    rows = _documented_tier(heading)
    twice = sorted({r for r in rows if rows.count(r) > 1})
    assert twice == [], f"docs/reference.md {heading!r} lists these more than once"
    assert sorted(rows) == sorted((m, n) for m, names in tier.items() for n in names)


# -- module size -----------------------------------------------------------------

MAX_MODULE_LINES = 700
# Modules still over the limit while they are being split. This list only ever
# shrinks: a module leaves it once it is split (the test below then insists), and
# nothing is added to it. Empty, it goes.
OVER_THE_LIMIT_FOR_NOW: set[str] = set()


def _module_lines() -> dict[str, int]:
    """Lines of each module under trajstore/, Alembic's frozen revision scripts aside."""
    versions = PKG / "migrations" / "versions"
    return {path.relative_to(PKG).as_posix(): len(path.read_text().splitlines())
            for path in sorted(PKG.rglob("*.py")) if versions not in path.parents}


def test_no_module_is_longer_than_the_limit():
    lines = _module_lines()
    too_long = {m: n for m, n in lines.items() if n > MAX_MODULE_LINES and m not in OVER_THE_LIMIT_FOR_NOW}
    assert too_long == {}, f"split these modules (at most {MAX_MODULE_LINES} lines each)"
    split_already = sorted(m for m in OVER_THE_LIMIT_FOR_NOW if lines.get(m, 0) <= MAX_MODULE_LINES)
    assert split_already == [], "these are within the limit now: take them off OVER_THE_LIMIT_FOR_NOW"


def test_the_size_check_counts_the_whole_tree():
    # The rule above would be vacuous if it missed packages or counted nothing.
    lines = _module_lines()
    assert {"events/__init__.py", "log/base.py", "ingest/proxy/__init__.py", "migrations/env.py"} <= set(lines)
    assert not any(m.startswith("migrations/versions/") for m in lines)
    assert lines["events/__init__.py"] > 50


# -- one driver-error boundary -------------------------------------------------

def _drivers() -> tuple[str, ...]:
    """SQLAlchemy and every registered backend's driver (``Backend.driver``): a new
    backend's driver is policed by its registry entry, no edit here."""
    from trajstore.log._registry import BACKENDS

    return ("sqlalchemy", *sorted({backend.driver for backend in BACKENDS.values()}))


DRIVERS = _drivers()
_ERROR_MODULES = ("sqlalchemy.exc", *(f"{d}.errors" for d in DRIVERS[1:]))
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
                      if a.name.startswith(_ERROR_MODULES)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            root = mod.split(".")[0]
            if mod.startswith(_ERROR_MODULES):
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


# -- one error boundary per seam: the OS, pyarrow, botocore -------------------------

IO_BOUNDARY = PKG / "payload"  # payload/_errors.py: payload_errors
STORAGE_LIBRARIES = ("pyarrow", "botocore", "boto3", "s3transfer")

# The local edges outside payload/ that catch such an error themselves, because it is
# no payload storage's: module -> (what it catches, as _io_error_uses reports it; why).
_NETWORK = "a socket or connection of its own server or client"
IO_EDGES: dict[str, tuple[set[str], str]] = {
    "trajstore.cli": ({"except BrokenPipeError", "except OSError", "isinstance OSError"},
                      "the terminal: stdout's reader went away (| head); the last-resort line for a user's own file"),
    "trajstore.ingest._body": ({"except ConnectionError"}, _NETWORK + ": the HTTP client went away mid-body"),
    "trajstore.ingest._http": ({"except OSError", "except socket.gaierror"},
                               _NETWORK + ": binding the listening socket, probing it is up"),
    "trajstore.ingest._nodelay": ({"except OSError"}, _NETWORK + ": TCP_NODELAY on a socket the peer closed"),
    "trajstore.ingest.client": ({"except OSError"}, _NETWORK + ": the writer retries a service it cannot reach"),
    "trajstore.ingest.sinks": ({"except OSError"}, _NETWORK + ": the HTTP sink's connection to the ingest service"),
    "trajstore.inspect._live": ({"except OSError"}, _NETWORK + ": the live page's listening socket"),
    "trajstore.replay._server": ({"except fl.FlightError", "except fl.FlightUnauthorizedError",
                                  "except pa.ArrowException", "isinstance fl.FlightUnavailableError"},
                                 _NETWORK + ": Arrow Flight is the replay server's RPC (its errors are pyarrow's)"),
    "trajstore.replay.client": ({"except OSError", "except fl.FlightError", "except fl.FlightServerError",
                                 "except fl.FlightUnauthenticatedError", "except fl.FlightUnauthorizedError",
                                 "isinstance fl.FlightError"},
                                _NETWORK + ": the replay client's Flight calls, retried across servers"),
    "trajstore.ingest.arrow_body": ({"except OSError", "except pa.ArrowException"},
                                    "a client's request body pyarrow refuses: the client's error, not the store's"),
    "trajstore.ingest._metrics": ({"except OSError", "except ProcessLookupError"},
                                  "other processes (kill 0) and their metrics files in the temp dir, not payload"),
    "trajstore.ingest.service": ({"except OSError"}, "ctypes finding glibc's mallopt: no I/O"),
    "trajstore.inspect.sql": ({"except OSError"}, "datetime.fromtimestamp's OSError for a number out of its range"),
    "trajstore.inspect.trackers": ({"except OSError"}, "TensorBoard's writer in the user's own log directory"),
}


def _io_error_family(value: object) -> str | None:
    """Which family an exception class belongs to (None: no storage library's)."""
    if not (inspect.isclass(value) and issubclass(value, BaseException)):
        return None
    root = (value.__module__ or "").split(".")[0]
    if root in STORAGE_LIBRARIES:
        return root
    if issubclass(value, OSError) and (root == "builtins" or root in sys.stdlib_module_names):
        return "OSError"
    return None


def _resolve(dotted: str, imports: dict[str, str]) -> object:
    """The object ``dotted`` names in a module whose imports are ``imports`` (a
    local name -> "module" or "module:name"); only the standard library's and
    the storage libraries' modules are imported to find it (None: another's)."""
    import builtins

    head, *rest = dotted.split(".")
    if head in imports:
        module, _, attr = imports[head].partition(":")
        path = ([attr] if attr else []) + rest
    elif hasattr(builtins, head):
        module, path = "builtins", [head, *rest]
    else:
        return None
    root = module.split(".")[0]
    if root not in STORAGE_LIBRARIES and root not in sys.stdlib_module_names:
        return None
    try:
        obj: object = importlib.import_module(module)
        for part in path:
            nxt = getattr(obj, part, None)
            if nxt is None and inspect.ismodule(obj):
                nxt = importlib.import_module(f"{obj.__name__}.{part}")
            obj = nxt
    except ImportError:  # an optional library not installed here: the import itself is still seen
        return None
    return obj


def _io_error_uses(source: str) -> list[str]:
    """Where ``source`` catches (``except``, ``suppress``, ``isinstance``) an OSError,
    a pyarrow or a botocore error, or imports botocore."""
    tree = ast.parse(source)
    imports: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] == "botocore":
                    found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            imports.update({a.asname or a.name: f"{node.module}:{a.name}" for a in node.names})
            if node.module.split(".")[0] == "botocore":
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    for node in ast.walk(tree):
        caught: list[ast.AST] = []
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            how, caught = "except", [node.type]
        elif isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in ("suppress", "isinstance", "issubclass"):
            how = _dotted(node.func).split(".")[-1]
            caught = list(node.args) if how == "suppress" else node.args[1:2]
        for expr in caught:
            for t in (expr.elts if isinstance(expr, (ast.Tuple, ast.List, ast.Set)) else [expr]):
                name = _dotted(t)
                if name and _io_error_family(_resolve(name, imports)):
                    found.append(f"line {t.lineno}: {how} {name}")
    return found


def _outside_io_boundary() -> dict[str, set[str]]:
    uses = {name: _io_error_uses(path.read_text()) for name, path in MODULES.items()
            if IO_BOUNDARY not in path.parents}
    return {m: {u.split(": ", 1)[1] for u in found} for m, found in uses.items() if found}


def test_no_os_pyarrow_or_botocore_error_is_caught_outside_its_boundary():
    found = _outside_io_boundary()
    unlisted = {m: sorted(uses - IO_EDGES.get(m, (set(), ""))[0]) for m, uses in found.items()}
    assert {m: uses for m, uses in unlisted.items() if uses} == {}, "route it through payload_errors (or list the edge)"
    stale = {m: sorted(caught - found.get(m, set())) for m, (caught, _) in IO_EDGES.items()}
    assert {m: c for m, c in stale.items() if c} == {}, "IO_EDGES names a catch that is gone: remove it"
    assert all(reason for _, reason in IO_EDGES.values())


def test_the_io_boundary_check_sees_every_form():
    # The rule above would be vacuous if it missed the ways code catches these errors.
    source = """
import contextlib, errno, os, shutil, socket
import pyarrow as pa
import pyarrow.lib
from pyarrow import ArrowInvalid as BadArrow
from contextlib import suppress
import botocore.exceptions
from botocore.exceptions import ClientError
class Mine(Exception):
    pass
def f(e):
    try:
        pass
    except IOError:
        pass
    except (ValueError, EnvironmentError):
        pass
    except FileNotFoundError:
        pass
    except socket.timeout:
        pass
    except shutil.Error:
        pass
    except pa.lib.ArrowIOError:
        pass
    except BadArrow:
        pass
    except botocore.exceptions.BotoCoreError:
        pass
    except (Mine, KeyError, ValueError, ZeroDivisionError):
        pass
    try:
        pass
    except* pa.ArrowException:
        pass
    with contextlib.suppress(PermissionError), suppress(KeyError):
        pass
    if isinstance(e, (TypeError, ConnectionResetError)):
        pass
    return errno.ENOENT, os.sep
"""
    lines = sorted(u.split(": ", 1)[1] for u in _io_error_uses(source))
    assert lines == sorted([
        "import botocore.exceptions", "from botocore.exceptions import ClientError",
        "except IOError", "except EnvironmentError", "except FileNotFoundError", "except socket.timeout",
        "except shutil.Error", "except pa.lib.ArrowIOError", "except BadArrow", "except pa.ArrowException",
        "except botocore.exceptions.BotoCoreError", "suppress PermissionError", "isinstance ConnectionResetError"])


# -- one backend per module, one registry ------------------------------------------

def _registered() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the database names, the backends' modules and drivers), from the registry."""
    from trajstore.log._registry import BACKENDS

    return ((*BACKENDS, "postgres"),  # (and the URL scheme alias SQLAlchemy also reads)
            (*(b.__module__ for b in BACKENDS.values()), *DRIVERS[1:]))


DATABASE_NAMES, BACKEND_MODULES = _registered()


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
                      if a.name.split(".")[0] in DRIVERS[1:] or a.name in BACKEND_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            if mod.split(".")[0] in DRIVERS[1:] or any(t in BACKEND_MODULES for t in targets):
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
