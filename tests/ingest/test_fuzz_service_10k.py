"""10,000 mutated events over HTTP against the real ingest service on PostgreSQL (the
service's production backend), JSON bodies: every request stored or refused with a 4xx,
never a 500 (test_fuzz_service.py runs 1,000 on both backends and both bodies; this run is
a file of its own so that the two balance across the suite's workers)."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from test_fuzz_service import _fuzz_over_http, _serve  # noqa: E402


@pytest.fixture
def service(store):
    with _serve(store) as url:
        yield url


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("store_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_10k_mutated_events_over_http_are_stored_or_refused(service, store):
    _fuzz_over_http(service, store, 10_000, "json")
