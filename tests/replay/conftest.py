"""Fixtures of the replay tests: servers as real processes (replay_procs.py)."""

from __future__ import annotations

import multiprocessing

import pytest

from replay_procs import ReplayProcess, free_port

# The DataLoader tests start their workers from the forkserver (a fresh interpreter: gRPC is
# not fork-safe once this process has had replay clients). The forkserver imports torch and
# the datasets once, before any client exists; every worker forked from it has them (each
# worker importing torch itself took seconds).
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "trajstore.replay.dataset", "trajstore.train.collate"])


@pytest.fixture
def replay_servers(tmp_path):
    """Start replay servers with ``start(store, *flags)``; all are stopped at the end."""
    started: list[ReplayProcess] = []

    def start(store, *extra: str, metrics: bool = False) -> ReplayProcess:
        p = ReplayProcess(store.url, store.payload.location, tmp_path, *extra,
                          metrics_port=free_port() if metrics else None)
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.stop()
