"""Fixtures of the replay tests: servers as real processes (replay_procs.py)."""

from __future__ import annotations

import pytest

from replay_procs import ReplayProcess, free_port


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
