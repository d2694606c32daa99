"""The ingest service's Prometheus metrics (``prometheus_client``), one registry per app.

Under ``serve --workers N`` every worker process writes its values into
``$PROMETHEUS_MULTIPROC_DIR`` and a scrape of any worker sums them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

__all__ = ["MULTIPROC_ENV", "Metrics", "make_multiproc_dir"]

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode (serve --workers N)
_DIR_PREFIX = "trajstore-serve-metrics-"
_DIR_NAME = re.compile(re.escape(_DIR_PREFIX) + r"(\d+)-")
_FILE_PID = re.compile(r"_(\d+)\.db$")  # prometheus_client's files: <kind>_<pid>.db
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The service's Prometheus metrics (``prometheus_client``), one registry per app.

    Under ``serve --workers N`` every worker writes its values to
    ``$PROMETHEUS_MULTIPROC_DIR`` (``serve`` makes it) and ``render()`` sums
    them, so a scrape sees the whole service, whichever worker answers it."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        p = "trajstore_ingest"
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(f"{p}_requests", "answers to POST /v1/events, by HTTP status", ["status"],
                                 registry=r)
        self._errors = Counter(f"{p}_errors", "refused requests, by rule", ["rule"], registry=r)
        self._events = Counter(f"{p}_events", "events stored by acknowledged requests (duplicates not counted)",
                               registry=r)
        self._duplicates = Counter(f"{p}_duplicate_events", "events acknowledged that were already stored",
                                   registry=r)
        self._tokens = Counter(f"{p}_tokens", "generated tokens in acknowledged requests", registry=r)
        self._commits = Counter(f"{p}_commits", "store transactions (requests/commits: the mean group size)",
                                registry=r)
        self._grouped = Counter(f"{p}_committed_requests", "requests (engine calls) those transactions held "
                                "(committed_requests/commits: requests per payload object)", registry=r)
        self._latency = Histogram(f"{p}_ack_latency_seconds", "time from request to answer",
                                  buckets=_LATENCY_BUCKETS_S, registry=r)
        self._in_flight = Gauge(f"{p}_body_bytes_in_flight", "request body bytes read, parsed or committing",
                                registry=r, multiprocess_mode="livesum")
        self._peak = Gauge(f"{p}_body_bytes_in_flight_peak", "highest body_bytes_in_flight of a process",
                           registry=r, multiprocess_mode="max")
        self._limit = Gauge(f"{p}_body_bytes_in_flight_limit", "--max-in-flight-mb of a process, in bytes",
                            registry=r, multiprocess_mode="max")

    def observe(self, status: int, latency_s: float, *, events: int = 0, duplicates: int = 0, tokens: int = 0,
                rule: str | None = None) -> None:
        self._requests.labels(status=str(status)).inc()
        if events:
            self._events.inc(events)
        if duplicates:
            self._duplicates.inc(duplicates)
        if tokens:
            self._tokens.inc(tokens)
        if rule is not None:
            self._errors.labels(rule=rule).inc()
        self._latency.observe(latency_s)

    def count_commit(self, requests: int = 1) -> None:
        self._commits.inc()
        self._grouped.inc(requests)

    @property
    def commits(self) -> int:
        """Store transactions this process made (what ``trajstore_ingest_commits_total`` counts)."""
        return int(self.registry.get_sample_value("trajstore_ingest_commits_total") or 0)

    def budget(self, in_flight: int, peak: int, limit: int) -> None:
        self._in_flight.set(in_flight)
        self._peak.set(peak)
        self._limit.set(limit)

    def render(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest

        if os.environ.get(MULTIPROC_ENV):
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry).decode()
        return generate_latest(self.registry).decode()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    try:  # a zombie (killed, not reaped yet) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def make_multiproc_dir(parent: str | None = None) -> str:
    """A new ``trajstore-serve-metrics-<pid>-*`` directory in ``parent`` (the temp dir) for
    ``serve --workers N``'s multiprocess metrics, after removing the ones a killed ``serve``
    left there: this user's, whose ``serve`` and every worker named by its files are gone
    (a ``serve`` stopped normally removes its own; one killed with -9 cannot)."""
    parent = parent or tempfile.gettempdir()
    try:
        names = os.listdir(parent)
    except OSError:
        names = []
    for name in names:
        m = _DIR_NAME.match(name)
        path = os.path.join(parent, name)
        try:
            if not m or os.stat(path).st_uid != os.getuid() or _alive(int(m.group(1))):
                continue
            if any(_alive(int(f.group(1))) for f in map(_FILE_PID.search, os.listdir(path)) if f):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s: the metrics directory of a serve that is gone", path)
    return tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=parent)
