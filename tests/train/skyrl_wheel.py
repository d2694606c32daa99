"""SkyRL 0.4.0's modules, loaded from the installed wheel for the tests that use them.

SkyRL declares Python >= 3.12 and some of its package ``__init__`` files import what
3.11 or this machine lacks (Ray workers, 3.12 syntax); the modules the tests use run
on 3.11. ``skyrl_modules()`` stands in bare packages for those ``__init__`` files,
yields the wheel's ``skyrl`` directory, and removes every ``skyrl`` module it loaded
afterwards (the next test file loads its own)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator

BARE_PACKAGES = ["skyrl.backends", "skyrl.train.generators", "skyrl.train.dataset"]


@contextlib.contextmanager
def skyrl_modules() -> Iterator[str]:
    before = set(sys.modules)
    root = os.path.dirname(importlib.util.find_spec("skyrl").origin)
    try:
        for name in BARE_PACKAGES:
            importlib.import_module(name.rsplit(".", 1)[0])
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split(".")[1:])]
            package.__package__ = name
            sys.modules[name] = package
        yield root
    finally:
        for name in set(sys.modules) - before:
            if name == "skyrl" or name.startswith("skyrl."):
                del sys.modules[name]
