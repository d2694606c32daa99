"""Record SkyRL 0.4.0's rollouts: every call its generator makes to the inference engine, one
trajectory per ``TrajectoryID``, finished with the generator's reward.

SkyRL's generator (``SkyRLGymGenerator``, ``skyrl/train/generators/skyrl_gym_generator.py``)
reaches the engine only through the inference-engine client it is built with
(``InferenceEngineInterface.generate``; ``RemoteInferenceClient`` in
``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``), one call per
turn, naming the trajectory in ``session_ids`` (``"{instance_id}_{repetition_id}"``).
``BasePPOExp.get_generator`` (``skyrl/train/entrypoints/main_base.py``) builds the
generator; overriding it records a run::

    class RecordedExp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            client = RecordingInferenceClient(inference_engine_client, "http://ingest-host:8700")
            return RecordingGenerator(super().get_generator(cfg, tokenizer, client), client)

The trainer keeps the client it made (weight sync, pause, sleep go to it unchanged); the
generator calls through the recording one, which records each prompt's call (prompt ids,
response ids, logprobs, routes, the stop reason, the client's ``weight_version`` as the
model version) as the next generation of its trajectory. ``RecordingGenerator`` gives each
``generate`` batch its own trajectory ids (``<run>-<batch>-<instance_id>_<repetition_id>``,
in the group ``<run>-<batch>-<instance_id>``: SkyRL's ids repeat every epoch), finishes each
trajectory with its reward (a per-token reward list: its sum) once the batch is generated,
and waits until the batch's calls are stored before SkyRL's trainer gets it.
SkyRL is never imported here (it needs Python 3.12).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import Any

from trajstore.errors import first_line
from trajstore.ingest._episodes import EpisodeRecorder

__all__ = ["RecordingGenerator", "RecordingInferenceClient"]

log = logging.getLogger("trajstore.ingest.skyrl")

_BATCH: contextvars.ContextVar[str | None] = contextvars.ContextVar("trajstore_skyrl_batch", default=None)


def _row(values: Any, i: int) -> Any:
    return None if values is None else values[i]


class RecordingInferenceClient:
    """SkyRL's inference-engine client whose ``generate`` also records every prompt's call.

    ``sink``: the ingest service's ``http://host:port`` (bearer ``token``, default
    ``$TRAJSTORE_TOKEN``), a store URL or a ``Store``; ``run``: the trajectory ids'
    prefix; ``num_experts``: with routes. Every other attribute is the wrapped client's.
    """

    def __init__(self, inner: Any, sink: Any, *, token: str | None = None, run: str = "skyrl",
                 num_experts: int | None = None, writer_options: dict | None = None) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "recorder", EpisodeRecorder(sink, token=token, num_experts=num_experts,
                                                             writer_options=writer_options))
        object.__setattr__(self, "_warned", False)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def trajectory_id(self, session_id: Any, batch: str | None = None) -> str:
        """The store's id of SkyRL's session ``session_id`` in generator batch ``batch``."""
        batch = _BATCH.get() if batch is None else batch
        return f"{self.run}-{batch}-{session_id}" if batch else f"{self.run}-{session_id}"

    def group_id(self, session_id: Any, batch: str | None = None) -> str | None:
        """The GRPO group of SkyRL's session ``"{instance_id}_{repetition_id}"``: its instance in this batch."""
        instance, _, repetition = str(session_id).rpartition("_")
        if not instance or not repetition.isdigit():
            return None
        return self.trajectory_id(instance, batch)

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        output = await self.inner.generate(input_batch, model=model)
        sessions = input_batch.get("session_ids")
        prompts = input_batch.get("prompt_token_ids")
        if not sessions or prompts is None:
            if not self._warned:
                log.warning("trajstore: a SkyRL engine call without session_ids (or prompt_token_ids) is not "
                            "recorded: only calls that name their trajectory are")
                object.__setattr__(self, "_warned", True)
            return output
        version = int(getattr(self.inner, "weight_version", 0) or 0)
        starts = input_batch.get("routed_experts_prompt_starts")
        for i, prompt in enumerate(prompts):
            self.recorder.call(
                self.trajectory_id(sessions[i]), prompt, output["response_ids"][i], model_version=version,
                group_id=self.group_id(sessions[i]),
                logprobs=_row(output.get("response_logprobs"), i),
                routed_experts=_row(output.get("rollout_expert_indices"), i),
                routed_experts_start=_row(starts, i), finish_reason=_row(output.get("stop_reasons"), i))
        return output


class RecordingGenerator:
    """SkyRL's generator (any ``GeneratorInterface``) whose batches finish their recorded
    trajectories with the generator's rewards; every other attribute is the wrapped one's."""

    def __init__(self, inner: Any, client: RecordingInferenceClient) -> None:
        self.inner, self.client = inner, client

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "client"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def generate(self, input_batch: Any) -> Any:
        batch = uuid.uuid4().hex[:12]
        token = _BATCH.set(batch)
        flush = asyncio.get_running_loop().run_in_executor
        try:
            output = await self.inner.generate(input_batch)
        except BaseException:
            self._finish_all(batch, "failed")
            try:  # keep what was recorded; the generator's error is the one raised
                await flush(None, self.client.recorder.flush)
            except Exception as e:  # noqa: BLE001 - logged, never masking the generator's error
                log.error("trajstore: %s", first_line(e))
            raise
        finally:
            _BATCH.reset(token)
        ids = output.get("trajectory_ids") or input_batch.get("trajectory_ids") or []
        last = output.get("is_last_step") or [True] * len(ids)
        recorder = self.client.recorder
        for i, (trajectory, is_last) in enumerate(zip(ids, last)):
            if not is_last:
                continue
            reward = output["rewards"][i]
            reward = float(sum(reward)) if isinstance(reward, (list, tuple)) else float(reward)
            recorder.finish(self.client.trajectory_id(trajectory.to_string(), batch), "completed", reward=reward)
        self._finish_all(batch, "failed")  # a trajectory the output does not account for
        await flush(None, recorder.flush)  # stored before SkyRL trains
        return output

    def _finish_all(self, batch: str, status: str) -> None:
        recorder = self.client.recorder
        for trajectory_id in recorder.open_ids(self.client.trajectory_id("", batch)):
            recorder.finish(trajectory_id, status)
