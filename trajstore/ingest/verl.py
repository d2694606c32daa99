"""Record verl 0.9.1's agent-loop rollouts: every engine call, as it returns, one trajectory per episode.

verl's agent loops (``verl/experimental/agent_loop/``: ``SingleTurnAgentLoop``,
``ToolAgentLoop``, any registered subclass) call the engine only through the
``LLMServerClient`` (``verl/workers/rollout/llm_server.py``) their
``AgentLoopWorker`` hands them as ``server_manager``, and the worker runs each
episode in ``_run_agent_loop`` (the agent loop, then the reward in
``_agent_loop_postprocess``). ``RayPPOTrainer.init_workers``
(``verl/trainer/ppo/ray_trainer.py``) builds its agent loop manager from
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, so two settings
record a run::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajstore.ingest.verl.RecordingAgentLoopManager
    +trajstore.sink=http://ingest-host:8700      # `trajstore serve`; or a store URL

``RecordingAgentLoopManager`` starts ``RecordingAgentLoopWorker`` actors: each
episode becomes a trajectory (``<run>-<step>-<hex>``, its GRPO ``uid`` as the
group), each ``generate`` that returns becomes its next generation event
(prompt ids, output ids, logprobs, routes, ``global_steps`` as the model
version), and the episode finishes with the reward verl computed (none when
verl scores later, in the trainer). The worker waits until its calls are
stored before it hands its batch back. Validation episodes are not recorded
unless ``trajstore.record_validation`` is true.

The other keys under ``trajstore``: ``token`` (else ``$TRAJSTORE_TOKEN``),
``run`` (the trajectory ids' prefix, default ``verl``), ``num_experts`` (with
routes), ``writer`` (``Writer`` options).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker

from trajstore.errors import ValidationError, first_line
from trajstore.ingest._episodes import EpisodeRecorder

__all__ = ["RecordingAgentLoopManager", "RecordingAgentLoopWorker", "RecordingLLMClient"]

_log = logging.getLogger("trajstore.ingest.verl")


@dataclass
class _Episode:
    recorder: EpisodeRecorder
    trajectory_id: str
    group_id: str | None
    step: int


_EPISODE: contextvars.ContextVar[_Episode | None] = contextvars.ContextVar("trajstore_verl_episode", default=None)


def _settings(config: Any) -> dict:
    section = config.get("trajstore") if hasattr(config, "get") else None
    if section is None:
        raise ValidationError("verl's config has no trajstore section: add +trajstore.sink=URL (the ingest "
                              "service's http://host:port, or a store URL)", rule="trajstore_config")
    try:
        from omegaconf import OmegaConf

        section = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)
    except ImportError:
        section = dict(section)
    if not section.get("sink"):
        raise ValidationError("trajstore.sink is not set in verl's config: the ingest service's http://host:port, "
                              "or a store URL", rule="trajstore_config")
    return section


def _recorder(config: Any) -> EpisodeRecorder:
    """The recorder verl's config asks for (its ``trajstore`` section)."""
    section = _settings(config)
    return EpisodeRecorder(section["sink"], token=section.get("token") or os.environ.get("TRAJSTORE_TOKEN"),
                           num_experts=section.get("num_experts"), writer_options=section.get("writer"))


class RecordingLLMClient:
    """verl's ``LLMServerClient`` (any subclass) whose ``generate`` also records the call in the
    episode it runs in; every other attribute is the wrapped client's."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)  # e.g. the tokenizer verl's worker sets for its traces

    async def generate(self, request_id: Any, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
        output = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                           **kwargs)
        episode = _EPISODE.get()
        if episode is not None:
            version = (output.extra_fields or {}).get("global_steps")
            episode.recorder.call(
                episode.trajectory_id, prompt_ids, output.token_ids, group_id=episode.group_id,
                model_version=episode.step if version is None else int(version),
                logprobs=output.log_probs or None, routed_experts=output.routed_experts,
                finish_reason=output.stop_reason)
        return output


class RecordingAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker`` that records each training episode's engine calls and reward."""

    def __init__(self, config: Any, llm_client: Any, *args: Any, **kwargs: Any) -> None:
        self.trajstore = _recorder(config)
        self.trajstore_run = str(_settings(config).get("run") or "verl")
        self.trajstore_validation = bool(_settings(config).get("record_validation", False))
        super().__init__(config, RecordingLLMClient(llm_client), *args, **kwargs)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, *, agent_name: str,
                              trace: bool = True, **kwargs: Any) -> Any:
        if trajectory.get("validate") and not self.trajstore_validation:
            return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                 **kwargs)
        step = int(trajectory.get("step", 0))
        uid = kwargs.get("uid")
        episode = _Episode(self.trajstore, f"{self.trajstore_run}-{step}-{uuid.uuid4().hex}",
                           None if uid is None else str(uid), max(step, 0))
        token = _EPISODE.set(episode)
        try:
            output = await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                   **kwargs)
        except BaseException:
            self.trajstore.finish(episode.trajectory_id, "failed")
            raise
        finally:
            _EPISODE.reset(token)
        self.trajstore.finish(episode.trajectory_id, "completed", reward=output.reward_score)
        return output

    async def generate_sequences(self, batch: Any) -> Any:
        flush = asyncio.get_running_loop().run_in_executor
        try:
            output = await super().generate_sequences(batch)
        except BaseException:
            try:  # keep what was recorded (the failed episodes too); the loop's error is the one raised
                await flush(None, self.trajstore.flush)
            except Exception as e:  # noqa: BLE001 - logged, never masking the agent loop's error
                _log.error("trajstore: %s", first_line(e))
            raise
        await flush(None, self.trajstore.flush)  # stored before verl trains
        return output


class RecordingAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` whose workers are ``RecordingAgentLoopWorker`` actors."""

    agent_loop_workers_class = ray.remote(RecordingAgentLoopWorker)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        _settings(config)  # a missing sink fails here, in the trainer, before any worker starts
        super().__init__(config, *args, **kwargs)
