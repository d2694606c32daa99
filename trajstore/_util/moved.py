"""Module paths that moved, kept importable with a ``DeprecationWarning``.

The README and docs once documented flat module paths (``trajstore.client``,
``trajstore.megatron``, ``trajstore.sql``, ...); the tree now groups the edges
into ``ingest/``, ``train/``, ``inspect/`` and ``scale/``. Code written
against the old paths keeps working: importing one warns once and yields a
module that forwards every attribute to the new one, so
``trajstore.client.Writer is trajstore.ingest.client.Writer``. Edge modules
that no document names are internals (``inspect._live``, ``demo._simulate``,
``replay._server``, ...); their plain paths forward the same way.

The new module is imported only when the old path is, so importing
``trajstore`` never pulls an edge (torch, FastAPI, ray) in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

__all__: list[str] = []

# old path -> new path: paths the README or docs/ documented, and edge modules no
# document names, which are internals (a leading underscore) importable by their plain name
MOVED: dict[str, str] = {
    "trajstore.client": "trajstore.ingest.client",
    "trajstore.sinks": "trajstore.ingest.sinks",
    "trajstore.vllm": "trajstore.ingest.vllm",
    "trajstore.service": "trajstore.ingest.service",
    "trajstore.proxy": "trajstore.ingest.proxy",
    "trajstore.collate": "trajstore.train.collate",
    "trajstore.megatron": "trajstore.train.megatron",
    "trajstore.sql": "trajstore.inspect.sql",
    "trajstore.views": "trajstore.inspect.views",
    "trajstore.report": "trajstore.inspect.report",
    "trajstore.export": "trajstore.inspect.export",
    "trajstore.ray_actors": "trajstore.scale.ray_actors",
    "trajstore._payload_home": "trajstore.payload._home",
    # the SQL index, split by job (docs/design.md); its engines' internals
    "trajstore.log.sql": "trajstore.log._open",
    "trajstore.log.sqlite": "trajstore.log._sqlite",
    "trajstore.inspect.live": "trajstore.inspect._live",
    "trajstore.inspect.panels": "trajstore.inspect._panels",
    "trajstore.replay.server": "trajstore.replay._server",
    "trajstore.demo.run": "trajstore.demo._run",
    "trajstore.demo.simulate": "trajstore.demo._simulate",
    "trajstore.demo.train_stage": "trajstore.demo._train_stage",
    "trajstore.ingest._sglang_proxy": "trajstore.ingest.proxy._sglang",
}


class _Forwarding(types.ModuleType):
    """The old module: every attribute read goes to the new module."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name, target.__doc__)
        self.__dict__["_target"] = target
        if hasattr(target, "__all__"):
            self.__dict__["__all__"] = list(target.__all__)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_target"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__dict__["_target"])))


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} is deprecated; import {new} instead (same names)", DeprecationWarning,
                      stacklevel=2)  # warnings skips importlib's own frames
        return _Forwarding(spec.name, importlib.import_module(new))

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Put the finder at the end of ``sys.meta_path`` (once): real modules always win."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
