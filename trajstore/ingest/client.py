"""Writing events from rollout workers: a thread-safe, batching, retrying writer.

::

    with Writer("http://ingest:8700", token=TOKEN) as writer:      # or a Store, or "sqlite:///x.db"
        traj = writer.trajectory("t1", group_id="g1", num_experts=128)
        traj.generation(prompt_ids, output_ids, logprobs=lp, routed_experts=routes, model_version=5)
        traj.from_vllm(request_output, model_version=5)           # vLLM offline output or server JSON
        traj.finish("completed", reward=1.0)

Events go into a bounded in-memory queue; a background thread sends them in
batches (by event count, token count, bytes, or time: ``flush_interval_s`` is
the writer's linger) to the sink: an in-process ``Store`` (through the store's
group committer: writers of one store in one process share appends) or the
HTTP ingest service (``POST /v1/events``, which coalesces many writers'
batches into one append). A batch of many trajectories' calls is one payload
object and one index transaction when it reaches the store.
The sinks live in ``sinks.py`` and are re-exported here; this module holds
``Writer`` and ``TrajectoryWriter``.

Delivery is at-least-once on the wire and exactly-once in the store: every
event gets an ``event_id`` when it is queued, so a batch re-sent after a lost
connection or a service restart carries the same ids and the store treats it
as an idempotent retry (training lineage events keep their key as identity
instead: a restored trainer's replay from a new writer is a retry too). A refused event (validation or conflict) fails its
trajectory only and is never retried: the other trajectories' events in the
batch are re-sent, and later events of the failed trajectory are dropped
instead of piling up seq errors. A failure the sink cannot classify (an HTTP
500, a driver error) is isolated the same way: the batch is split per
trajectory, and the trajectory that keeps failing fails alone. Errors surface from ``flush()``/``close()`` and from the failed
trajectory's own handle.

A full queue blocks ``put`` (back-pressure) up to ``put_timeout_s``, then
raises StoreUnavailable: memory stays bounded when the sink falls behind.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from trajstore._util.backoff import Backoff
from trajstore._util.deprecated import renamed
from trajstore.errors import StoreUnavailable, TrajstoreError, ValidationError, first_line
from trajstore.events import LINEAGE_TYPES, TOKEN_FIELDS
from trajstore.ingest._event_dicts import to_numpy, trajectory_started
from trajstore.ingest._group_commit import DEFAULT_MAX_GROUP_BYTES, request_bytes
from trajstore.ingest.sinks import HttpSink, Sink, StoreSink, encode_events, error_from_response, make_sink

_log = logging.getLogger("trajstore.ingest.client")

# HttpSink and StoreSink are documented here too (docs/ingest.md); the sinks'
# other names are importable from here but belong to ingest.sinks.
__all__ = ["HttpSink", "StoreSink", "TrajectoryWriter", "Writer"]


def _num_tokens(event: Mapping) -> int:
    total = 0
    for key in TOKEN_FIELDS:
        value = event.get(key)
        if isinstance(value, Mapping):
            total += int(np.prod(value.get("shape") or [0]))
        elif value is not None and not isinstance(value, str):
            total += len(value)
    return total


class Writer:
    """Thread-safe batching writer (see the module docstring).

    ``sink``: ``"http://host:port"`` of the ingest service (bearer ``token``,
    default ``$TRAJSTORE_TOKEN``), a store URL (the writers of one URL in a
    process share its ``Store``, closed with the last of them), a ``Store``, or
    a ``Sink``.
    A batch closes at ``max_batch_events`` events (``batch_size``: its old,
    deprecated name), ``max_batch_tokens`` tokens, ``max_batch_bytes`` bytes
    (arrays' buffers, estimated), or ``flush_interval_s`` after its first
    event (the linger). Queued plus in-flight events
    are bounded by ``max_pending_events`` and ``max_pending_tokens``.
    Transient failures (connection lost, database restarting, 429/502/503/504)
    are retried with backoff for up to ``retry_timeout_s`` (120 s), with one
    ``logging`` warning per retry burst naming the sink and the error; each
    HTTP request times out after ``timeout_s`` (60 s). A refused event fails
    its own trajectory and is never retried; the rest of its batch is stored.
    ``on_ack(events)`` runs on the sender thread after each stored batch.
    ``body``: what an HTTP sink sends, ``"arrow"`` (an Arrow IPC stream:
    numpy arrays as raw bytes, no JSON or base64 for them) or ``"json"``.
    """

    def __init__(
        self,
        sink: Any = None,
        *,
        token: str | None = None,
        max_batch_events: int = 1024,
        max_batch_tokens: int = 65_536,
        flush_interval_s: float = 0.05,
        max_pending_events: int = 4096,
        max_pending_tokens: int = 1 << 18,
        put_timeout_s: float = 60.0,
        retry_timeout_s: float = 120.0,
        timeout_s: float = 60.0,
        assign_event_ids: bool = True,
        on_ack: Callable[[list[dict]], None] | None = None,
        body: str = "arrow",
        batch_size: int | None = None,
        max_batch_bytes: int = DEFAULT_MAX_GROUP_BYTES,
    ) -> None:
        max_batch_events = renamed("batch_size", "max_batch_events", batch_size, max_batch_events, 1024)
        if not max_batch_bytes >= 1:
            raise ValueError(f"max_batch_bytes must be at least 1, got {max_batch_bytes!r}")
        self.max_batch_bytes = max_batch_bytes
        self._sink = make_sink(sink, token, timeout_s, body)
        self._sink_name = getattr(self._sink, "name", None) or type(self._sink).__name__
        self.max_batch_events, self.max_batch_tokens = max_batch_events, max_batch_tokens
        self.flush_interval_s = flush_interval_s
        self.max_pending_events, self.max_pending_tokens = max_pending_events, max_pending_tokens
        self.put_timeout_s, self.retry_timeout_s = put_timeout_s, retry_timeout_s
        self._on_ack = on_ack
        self._id_prefix = uuid.uuid4().hex if assign_event_ids else None
        self._num_ids = 0
        self._cond = threading.Condition()
        self._queue: deque[tuple[dict, int, int]] = deque()  # (event, tokens, bytes)
        # pending = queued + in flight (bounds memory); queued = not yet taken by the sender
        self._pending_events = self._pending_tokens = self._queued_tokens = self._queued_bytes = 0
        self._num_put = self._num_done = 0
        self._flush_target = 0
        self._closing = self._aborted = False
        self._errors: list[TrajstoreError] = []
        self._failed: dict[str, TrajstoreError] = {}
        self.num_acked = 0
        self._thread = threading.Thread(target=self._run, name="trajstore-writer", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------

    def put(self, event: Mapping) -> dict:
        """Queue one wire-format event dict; blocks while the queue is full."""
        event = dict(event)
        n_tokens = _num_tokens(event)
        n_bytes = request_bytes([event])
        with self._cond:
            self._check_open(event.get("trajectory_id"))
            self._wait_for_room(n_tokens)
            # lineage events keep their key as identity: a restored trainer's replay,
            # from another writer, must find its step already recorded (a no-op)
            if self._id_prefix is not None and "event_id" not in event and event.get("type") not in LINEAGE_TYPES:
                event["event_id"] = f"{self._id_prefix}-{self._num_ids}"
                self._num_ids += 1
            self._queue.append((event, n_tokens, n_bytes))
            self._pending_events += 1
            self._pending_tokens += n_tokens
            self._queued_tokens += n_tokens
            self._queued_bytes += n_bytes
            self._num_put += 1
            self._cond.notify_all()
        return event

    def extend(self, events: Iterable[Mapping]) -> None:
        for event in events:
            self.put(event)

    def _check_open(self, trajectory_id: Any) -> None:
        if self._closing:
            raise TrajstoreError("writer is closed")
        failed = self._failed.get(trajectory_id) if isinstance(trajectory_id, str) else None
        if failed is not None:
            raise failed

    def _wait_for_room(self, n_tokens: int) -> None:
        deadline = time.monotonic() + self.put_timeout_s
        # An event larger than the token bound alone still goes through once
        # the queue is empty, so one huge event cannot wedge the writer.
        while self._pending_events >= self.max_pending_events or (
            self._pending_events and self._pending_tokens + n_tokens > self.max_pending_tokens
        ):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailable(
                    f"writer queue stayed full for {self.put_timeout_s:g} s "
                    f"({self._pending_events} events pending): the sink is not keeping up"
                )
            self._cond.wait(remaining)

    def trajectory(
        self,
        trajectory_id: str,
        *,
        group_id: str | None = None,
        num_experts: int | None = None,
        metadata: Mapping | None = None,
        start: bool = True,
        next_seq: int = 0,
        run: str | None = None,
        prompt_id: str | None = None,
        epoch: int | None = None,
        group_size: int | None = None,
    ) -> "TrajectoryWriter":
        """A handle that writes one trajectory and numbers its generations.

        ``start=False, next_seq=k`` resumes a trajectory already started (a running
        trajectory of a rollout plan: ``next_seq=tail.next_seq``). ``run``,
        ``prompt_id``, ``epoch``, ``group_size``: the rollout ledger's fields (all or none).
        """
        if start:
            self.put(trajectory_started(trajectory_id, group_id=group_id, num_experts=num_experts, metadata=metadata,
                                        run=run, prompt_id=prompt_id, epoch=epoch, group_size=group_size))
        return TrajectoryWriter(self, trajectory_id, next_seq)

    def rollout_state(self, run: str, *, flush: bool = True) -> Any:
        """The resume plan of rollout run ``run`` (docs/reference.md "Rollout ledger"), from
        the store or the ingest service this writer sends to (``GET /v1/rollout_state``).
        ``flush``: first wait until every event put so far is stored, so the plan holds them."""
        if flush:
            self.flush()
        reader = getattr(self._sink, "rollout_state", None)
        if reader is None:
            raise TypeError(f"{self._sink_name} cannot read a rollout plan (a Sink without rollout_state)")
        return reader(run)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every event queued so far is stored (or refused); raise the first error."""
        with self._cond:
            target = self._num_put
            self._flush_target = max(self._flush_target, target)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._num_done >= target, timeout_s):
                raise StoreUnavailable(f"flush timed out after {timeout_s:g} s with {target - self._num_done} events unsent")
            self._raise_errors()

    def _raise_errors(self) -> None:
        if self._errors:
            first, self._errors = self._errors[0], []
            raise first

    @property
    def errors(self) -> list[TrajstoreError]:
        """Errors not yet raised by flush()/close()."""
        with self._cond:
            return list(self._errors)

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued, stop the sender, close the sink; raise the first error.

        After ``timeout_s`` the sender gives up on unsent events (they are lost
        and StoreUnavailable is raised).
        """
        with self._cond:
            if self._closing and not self._thread.is_alive():
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with self._cond:
                self._aborted = True
                self._cond.notify_all()
            self._thread.join()
        self._sink.close()
        with self._cond:
            self._raise_errors()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sender side ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._deliver([event for event, _, _ in batch])
            except Exception as e:  # a bug or a failing on_ack: never leave flush() waiting
                self._fail(None, TrajstoreError(f"writer sender failed: {type(e).__name__}: {e}"))
            with self._cond:
                self._pending_events -= len(batch)
                self._pending_tokens -= sum(n for _, n, _ in batch)
                self._num_done += len(batch)
                self._cond.notify_all()

    def _batch_ready(self) -> bool:
        return (
            len(self._queue) >= self.max_batch_events
            or self._queued_tokens >= self.max_batch_tokens
            or self._queued_bytes >= self.max_batch_bytes
            or self._closing
            or self._flush_target > self._num_done
        )

    def _next_batch(self) -> list[tuple[dict, int, int]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closing)
            if not self._queue:
                return None
            deadline = time.monotonic() + self.flush_interval_s
            while not self._batch_ready():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch: list[tuple[dict, int, int]] = []
            n_tokens = n_bytes = 0
            while self._queue and len(batch) < self.max_batch_events:
                if batch and (n_tokens + self._queue[0][1] > self.max_batch_tokens
                              or n_bytes + self._queue[0][2] > self.max_batch_bytes):
                    break
                batch.append(self._queue.popleft())
                n_tokens += batch[-1][1]
                n_bytes += batch[-1][2]
            self._queued_tokens -= n_tokens
            self._queued_bytes -= n_bytes
            return batch

    def _deliver(self, events: list[dict]) -> None:
        """Store ``events``; a refusal or a failure tied to one trajectory fails
        that trajectory only, and the rest of the batch is stored."""
        todo = [events]
        while todo:
            part = self._without_failed(todo.pop())
            if not part:
                continue
            try:
                self._send_with_retry(part)
            except ValidationError as e:  # refused: never retried
                culprit = _refused_trajectory(part, e)
                if e.rule == "body_too_large" and len(part) > 1:
                    half = len(part) // 2
                    todo += [part[half:], part[:half]]  # popped from the end: first half first
                elif culprit is None and e.index is not None and 0 <= e.index < len(part):
                    # a store-wide event (version_label, train_step) was refused: only it fails
                    self._fail(None, e)
                    todo.append(part[:e.index] + part[e.index + 1:])
                elif culprit is not _UNKNOWN:
                    # the whole trajectory fails: its later events could only be refused too
                    self._fail(culprit, e)
                    todo.append([ev for ev in part if ev.get("trajectory_id") != culprit])
                elif len(_by_trajectory(part)) > 1:
                    todo += reversed(_by_trajectory(part))  # find out whose event it is
                else:
                    self._fail_all(part, e)
            except _Unclassified as e:  # the sink failed on this batch: whose event is it?
                groups = _by_trajectory(part)
                if len(groups) > 1:
                    todo += reversed(groups)
                else:
                    self._fail_all(part, e.error)
            except TrajstoreError as e:  # gave up retrying (retry_timeout_s) or aborted by close()
                self._fail_all(part, e)
            else:
                self._acked(part)

    def _send_with_retry(self, events: list[dict]) -> None:
        """Send one part. Retriable failures (StoreUnavailable, OSError,
        contention) are retried with backoff for ``retry_timeout_s``; a failure
        the sink cannot classify is retried for at most ``_UNCLASSIFIED_RETRY_S``
        when the part holds one trajectory (a part of several is split at once)."""
        backoff = Backoff(first_s=0.05)
        attempt = 0
        warned = False
        budget_s = self.retry_timeout_s
        num_trajectories = len({repr(ev.get("trajectory_id")) for ev in events})
        while True:
            attempt += 1
            try:
                self._sink.send(events)
            except ValidationError as e:
                if e.rule != "contention":  # a store that predates ContentionError says "contention" so
                    raise
                error: BaseException = e
            except (StoreUnavailable, OSError) as e:
                error = e
            except Exception as e:
                if 400 <= getattr(e, "http_status", 500) < 500:  # 401, 403, 404: the same for every request
                    _log.error("trajstore writer: %s: %s", self._sink_name, first_line(e))
                    raise
                # One trajectory's part gets a short budget (a service answering 500 while its
                # database restarts recovers within it); a part of several is split at once.
                budget_s = min(self.retry_timeout_s, _UNCLASSIFIED_RETRY_S)
                if num_trajectories > 1 or self._aborted or backoff.exhausted(budget_s):
                    what = (f"trajectory {events[0].get('trajectory_id')!r}" if num_trajectories == 1
                            else f"a batch of {num_trajectories} trajectories")
                    wrapped = TrajstoreError(f"{self._sink_name} failed on {what}: {type(e).__name__}: {first_line(e)}")
                    if num_trajectories == 1:
                        _log.warning("trajstore writer: %s", wrapped)
                    raise _Unclassified(wrapped) from None
                error = e
            else:
                if warned:
                    _log.info("trajstore writer: %s is back; sent %d events after %d attempts in %.1f s",
                                 self._sink_name, len(events), attempt, backoff.elapsed())
                return
            if not warned:  # one warning per retry burst
                _log.warning("trajstore writer: cannot send %d events to %s (%s: %s); retrying for up to %g s",
                             len(events), self._sink_name, type(error).__name__, first_line(error),
                             budget_s)
                warned = True
            else:
                _log.debug("trajstore writer: attempt %d to %s failed: %s", attempt, self._sink_name, first_line(error))
            if self._aborted or backoff.exhausted(self.retry_timeout_s):
                why = "the writer was closed" if self._aborted else f"{self.retry_timeout_s:g} s of retries"
                _log.error("trajstore writer: gave up sending %d events to %s after %s: %s",
                           len(events), self._sink_name, why, first_line(error))
                raise StoreUnavailable(f"gave up sending {len(events)} events to {self._sink_name} after {why}: "
                                       f"{first_line(error)}") from None
            backoff.pause()

    def _acked(self, events: list[dict]) -> None:
        self.num_acked += len(events)
        if self._on_ack is not None:
            self._on_ack(events)

    def _without_failed(self, events: list[dict]) -> list[dict]:
        with self._cond:
            if not self._failed:
                return events
            return [ev for ev in events if ev.get("trajectory_id") not in self._failed]

    def _fail(self, trajectory_id: Any, error: TrajstoreError) -> None:
        with self._cond:
            self._errors.append(error)
            if isinstance(trajectory_id, str):
                self._failed[trajectory_id] = error

    def _fail_all(self, events: list[dict], error: TrajstoreError) -> None:
        with self._cond:
            self._errors.append(error)
            for ev in events:
                if isinstance(ev.get("trajectory_id"), str):
                    self._failed.setdefault(ev["trajectory_id"], error)


_UNKNOWN = object()
_UNCLASSIFIED_RETRY_S = 15.0  # retries of a one-trajectory part the sink fails on for no known reason


class _Unclassified(Exception):
    """The sink failed on a part for a reason that is neither a refusal nor retriable."""

    def __init__(self, error: TrajstoreError) -> None:
        super().__init__(str(error))
        self.error = error


def _refused_trajectory(events: list[dict], e: ValidationError) -> Any:
    """The trajectory a refusal names, or _UNKNOWN."""
    if e.index is not None and 0 <= e.index < len(events):
        if events[e.index].get("type") in LINEAGE_TYPES:
            return None  # store-wide (an annotation's trajectory_id names its sample)
        return events[e.index].get("trajectory_id")
    if e.trajectory_id is not None and any(ev.get("trajectory_id") == e.trajectory_id for ev in events):
        return e.trajectory_id
    return _UNKNOWN


def _by_trajectory(events: list[dict]) -> list[list[dict]]:
    """``events`` split per trajectory, each in its original order."""
    groups: dict[str, list[dict]] = {}
    for ev in events:
        groups.setdefault(repr(ev.get("trajectory_id")), []).append(ev)
    return list(groups.values())


def _as_routes(routes: Any) -> Any:
    # Routes stay one numpy array (raw bytes in an Arrow body), never a list of Python ints.
    routes = to_numpy(routes)
    return np.asarray(routes) if isinstance(routes, (list, tuple)) else routes


class TrajectoryWriter:
    """Writes one trajectory through a Writer; numbers generations 0, 1, 2, ...

    Used as a context manager it finishes the trajectory on exit: "failed"
    when the block raised, else "completed" unless ``finish`` was called.
    """

    def __init__(self, writer: Writer, trajectory_id: str, next_seq: int = 0) -> None:
        self.writer = writer
        self.trajectory_id = trajectory_id
        self._next_seq = next_seq
        self._lock = threading.Lock()
        self.finished = False

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def generation(
        self,
        prompt_ids: Any,
        output_ids: Any,
        *,
        model_version: int | None = None,
        logprobs: Any = None,
        routed_experts: Any = None,
        **fields: Any,
    ) -> int:
        """Queue one engine call; returns its seq. ``fields``: loss_mask,
        token_model_versions (then ``model_version`` may be left out: it is the
        last entry), routed_experts_start, reward, token_rewards,
        finish_reason, metadata, event_id."""
        event: dict[str, Any] = {"prompt_ids": prompt_ids, "output_ids": output_ids}
        if model_version is not None:
            event["model_version"] = model_version
        if logprobs is not None:
            event["logprobs"] = logprobs
        if routed_experts is not None:
            event["routed_experts"] = _as_routes(routed_experts)
        event.update((k, v) for k, v in fields.items() if v is not None)
        return self._put_generations([event])[0]

    def from_vllm(self, output: Any, prompt_ids: Any = None, *, model_version: int, **fields: Any) -> int:
        """Queue what vLLM returned: a ``RequestOutput``/``CompletionOutput``
        (offline engine) or the OpenAI-compatible server's response JSON."""
        from trajstore.ingest.vllm import generation_from_output, generations_from_openai

        ids = {"trajectory_id": self.trajectory_id, "seq": 0, "model_version": model_version}
        if isinstance(output, Mapping):
            events = generations_from_openai(output, prompt_ids=prompt_ids, **ids, **fields)
            if len(events) != 1:
                raise ValidationError(f"a trajectory records one choice per call, the response has {len(events)}", rule="choices")
        else:
            events = [generation_from_output(output, prompt_ids, **ids, **fields)]
        return self._put_generations(events)[0]

    def _put_generations(self, events: list[dict]) -> list[int]:
        with self._lock:
            seqs = []
            for event in events:
                event.update(type="generation", trajectory_id=self.trajectory_id, seq=self._next_seq)
                self.writer.put(event)
                seqs.append(self._next_seq)
                self._next_seq += 1
            return seqs

    def reward(self, value: float) -> None:
        self.writer.put({"type": "reward", "trajectory_id": self.trajectory_id, "reward": value})

    def finish(self, status: str = "completed", *, reward: float | None = None) -> None:
        if reward is not None:
            self.reward(reward)
        self.writer.put({"type": "trajectory_finished", "trajectory_id": self.trajectory_id, "status": status})
        self.finished = True

    def __enter__(self) -> "TrajectoryWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.finished:
            self.finish("failed" if exc_type is not None else "completed")
