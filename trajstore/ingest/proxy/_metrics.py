"""The proxy's Prometheus counters (``GET /metrics``)."""

from typing import Any


class _ProxyMetrics:
    """What a proxy counts, in the app's Prometheus registry (``GET /metrics``).

    ``trajstore_proxy_calls_total{outcome}``: named calls by what became of
    them: ``recorded``; ``refused`` (not recorded, the harness got an error);
    ``passed_through`` (not recorded, the engine's answer given anyway:
    ``--pass-through-unrecorded``); ``upstream_error`` (the engine answered an
    error status); ``stream_cut`` (the stream ended before its end).
    ``trajstore_proxy_unrecorded_total{rule}``: why named calls and label
    changes were not recorded. ``trajstore_proxy_labels_total{outcome}``:
    label changes relayed with ``X-Trajstore-Model-Version`` (``mapped``,
    ``refused``, ``passed_through``). ``trajstore_proxy_unnamed_calls_total``:
    calls forwarded without a trajectory name.
    """

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter

        p = "trajstore_proxy"
        self._calls = Counter(f"{p}_calls", "named calls by outcome", ["outcome"], registry=registry)
        self._unrecorded = Counter(f"{p}_unrecorded", "named calls and label changes not recorded, by rule", ["rule"],
                                   registry=registry)
        self._labels = Counter(f"{p}_labels", "label changes relayed with X-Trajstore-Model-Version, by outcome",
                               ["outcome"], registry=registry)
        self._unnamed = Counter(f"{p}_unnamed_calls", "calls forwarded without a trajectory name", registry=registry)

    def call(self, outcome: str, rule: str | None = None) -> None:
        self._calls.labels(outcome=outcome).inc()
        if rule is not None:
            self._unrecorded.labels(rule=rule).inc()

    def label(self, outcome: str, rule: str | None = None) -> None:
        self._labels.labels(outcome=outcome).inc()
        if rule is not None:
            self._unrecorded.labels(rule=rule).inc()

    def unnamed(self) -> None:
        self._unnamed.inc()
