"""A framework's engine calls as trajstore trajectories: what the verl and SkyRL hooks share.

``EpisodeRecorder`` holds one ``Writer`` per process (opened on first use, so
the recorder can be pickled into a Ray actor or a worker process before it
writes anything), starts a trajectory at its first recorded call, numbers its
calls and finishes it with the episode's reward. The hooks in
``trajstore.ingest.verl`` and ``trajstore.ingest.skyrl`` decide which
episode a call belongs to; nothing here knows either framework.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from trajstore.errors import ValidationError
from trajstore.ingest._event_dicts import to_numpy

__all__: list[str] = []

log = logging.getLogger("trajstore.ingest.episodes")


def _token_list(values: Any) -> list:
    values = to_numpy(values)
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class EpisodeRecorder:
    """Records engine calls under episode ids through one ``Writer`` (``sink``: the
    ingest service's ``http://host:port``, a store URL, or a ``Store``)."""

    def __init__(self, sink: Any, *, token: str | None = None, num_experts: int | None = None,
                 writer_options: dict | None = None) -> None:
        if sink is None or sink == "":
            raise ValidationError("trajstore's recorder needs a sink: the ingest service's http://host:port, "
                                  "or a store URL", rule="sink")
        self.sink, self.token, self.num_experts = sink, token, num_experts
        self.writer_options = dict(writer_options or {})
        self._writer: Any = None
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # a Writer owns a thread: each process opens its own on first use
        state = self.__dict__.copy()
        state.update(_writer=None, _handles={}, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def writer(self) -> Any:
        with self._lock:
            if self._writer is None:
                from trajstore.ingest.client import Writer

                self._writer = Writer(self.sink, token=self.token, **self.writer_options)
            return self._writer

    def call(self, trajectory_id: str, prompt_ids: Any, output_ids: Any, *, model_version: int,
             group_id: str | None = None, logprobs: Any = None, routed_experts: Any = None,
             routed_experts_start: int | None = None, finish_reason: str | None = None) -> int:
        """Queue one engine call as the trajectory's next generation (starting the trajectory
        at its first call); returns its seq."""
        writer = self.writer
        with self._lock:
            handle = self._handles.get(trajectory_id)
            if handle is None:
                handle = writer.trajectory(trajectory_id, group_id=group_id, num_experts=self.num_experts)
                self._handles[trajectory_id] = handle
        output = _token_list(output_ids)
        if logprobs is not None:
            logprobs = to_numpy(logprobs)
            if len(logprobs) == 0 and output:
                logprobs = None  # verl's "no logprobs" is an empty list
        if routed_experts is not None:
            routed_experts = np.asarray(to_numpy(routed_experts))
        return handle.generation(_token_list(prompt_ids), output, model_version=max(int(model_version), 0),
                                 logprobs=logprobs, routed_experts=routed_experts,
                                 routed_experts_start=routed_experts_start or None, finish_reason=finish_reason)

    def open_ids(self, prefix: str = "") -> list[str]:
        """The trajectories this recorder started and has not finished, whose id starts with ``prefix``."""
        with self._lock:
            return [t for t in self._handles if t.startswith(prefix)]

    def finish(self, trajectory_id: str, status: str = "completed", reward: float | None = None) -> bool:
        """Finish a trajectory this recorder started; False (nothing written) when it recorded no call."""
        with self._lock:
            handle = self._handles.pop(trajectory_id, None)
        if handle is None:
            return False
        handle.finish(status, reward=None if reward is None else float(reward))
        return True

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued call is stored; raise the first refusal."""
        if self._writer is not None:
            self._writer.flush(timeout_s)

    def close(self) -> None:
        with self._lock:
            writer, self._writer = self._writer, None
            open_ids = list(self._handles)
            self._handles.clear()
        if open_ids:
            log.warning("trajstore: %d episodes were still open when the recorder closed (e.g. %s); they stay "
                        "running in the store", len(open_ids), open_ids[0])
        if writer is not None:
            writer.close()
