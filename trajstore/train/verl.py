"""verl: reader batches as verl 0.9.1's agent-loop ``DataProto``.

verl's trainer takes the rollout as the ``DataProto`` its agent loop builds
(``verl/experimental/agent_loop/agent_loop.py``, ``_agent_loop_postprocess``
and ``_postprocess``) joined to the dataloader batch it came from
(``RayPPOTrainer.fit``, ``verl/trainer/ppo/ray_trainer.py``). ``data_proto``
builds that joined batch from a ``SampleReader`` batch, with verl's layout:

* ``prompts`` ``[B, P]`` left-padded, ``responses`` ``[B, R]`` right-padded,
  ``input_ids`` their concatenation, ``attention_mask`` (int64, 0 = padding),
  ``position_ids`` = ``clip(cumsum(attention_mask) - 1, 0)``
  (``verl/utils/model.py`` ``compute_position_id_with_mask``),
  ``response_mask`` (1 = generated token, 0 = observation or padding);
* ``rollout_log_probs`` float32 ``[B, R]`` (0.0 on padding), when any
  sample has logprobs;
* ``routed_experts`` int16 ``[B, P+R, layers, topk]``: each captured route
  row at the position of its token, zeros elsewhere, every recorded layer
  kept (dense layers as the engine recorded them: verl's R3 replay indexes
  routes by absolute layer when they cover ``num_layers``,
  ``verl/utils/megatron/router_replay_utils.py``). verl's R3 replays every
  position of a row but its last whenever the row trains a token
  (``build_r3_replay_mask``), so a trained row with an uncaptured position
  before its last is refused (``missing_routes="refuse"``) or left out of
  the loss entirely (``"mask"``): verl then replays none of it. A zero fill is
  never replayed as a route;
* ``rm_scores`` float32 ``[B, R]``: the reward on the last response token
  (plus token rewards where recorded), when every sample has one;
* ``non_tensor_batch``: ``min_global_steps`` / ``max_global_steps`` (the
  sample's oldest and newest policy version), ``uid`` (the GRPO group),
  ``__num_turns__``, ``multi_modal_inputs`` (``{}`` per row, as verl's agent
  loop gives a text row), ``raw_prompt`` (None: the store holds tokens, not
  the chat messages) and verl's default extra fields;
* ``meta_info``: ``temperature`` (verl's engines divide the logits by it),
  ``timing`` (empty: nothing was generated here), ``reward_extra_keys`` with
  ``rm_scores``, and ``trajstore`` (the reader's step and its state after
  this batch, for the trainer checkpoint).

What verl has no field for travels in the same ``DataProto`` under names
verl does not use: ``token_model_versions`` int32 ``[B, R]`` (-1 off the
generated tokens), ``rollout_log_probs_mask`` bool ``[B, R]`` (True where
the engine gave the logprob), ``routed_experts_mask`` bool ``[B, P+R]``
(True where no route was captured, padding included), and the non-tensor
``trajectory_id``, ``sample_index``, ``finish_reason``.

verl is imported only when a batch is built (``verl.protocol`` pulls in Ray,
tensordict and transformers).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import logging

import numpy as np

from trajstore.errors import ValidationError
from trajstore.sample import Sample
from trajstore.train._rows import loss_masks, rewards

__all__ = ["data_proto", "verl_batches"]

_RULE = "verl"
_log = logging.getLogger("trajstore.train")

# verl's agent loop always adds these extra fields (None when unused).
_DEFAULT_EXTRA_FIELDS = ("turn_scores", "tool_rewards", "extras")


def data_proto(samples: Sequence[Sample], *, prompt_length: int | None = None,
               response_length: int | None = None, pad_token_id: int = 0,
               missing_logprobs: Literal["mask", "refuse", "keep"] = "mask",
               missing_reward: float | None = None, meta_info: dict[str, Any] | None = None,
               missing_routes: Literal["refuse", "mask"] = "refuse", temperature: float = 1.0) -> Any:
    """verl's ``DataProto`` for a batch of samples, one row per sample.

    ``prompt_length`` / ``response_length`` are verl's
    ``rollout.prompt_length`` / ``rollout.response_length`` (the padded
    widths; default: the batch's longest); a longer sample is refused.
    ``missing_logprobs``: a generated token without a logprob leaves
    ``response_mask`` (``"mask"``, counted in
    ``meta_info["trajstore"]["masked_missing_logprobs"]``), fails
    (``"refuse"``) or keeps 0.0 (``"keep"``). ``rm_scores`` is left out, as
    verl's agent loop does, when a last step has no reward and no
    ``missing_reward`` is given; an earlier step (a prefix mismatch) scores 0.

    ``missing_routes`` (when some sample of the batch has routes): verl's R3
    replays every position of a row but the last when the row trains any
    token, so a trained row with an uncaptured route before its last position
    (a turn recorded without routes, a sample without any) fails
    (``"refuse"``) or leaves ``response_mask`` entirely (``"mask"``, counted
    in ``meta_info["trajstore"]["masked_missing_routes"]``): verl then replays
    none of the row and it trains nothing. ``temperature``: the sampling
    temperature of the rollout (verl's ``rollout.temperature``, default 1.0),
    which verl's engines read from ``meta_info["temperature"]``.
    """
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

    if not samples:
        raise ValidationError("cannot convert an empty batch", rule=_RULE)
    if missing_routes not in ("refuse", "mask"):
        raise ValidationError(f"missing_routes must be 'refuse' or 'mask', got {missing_routes!r}", rule=_RULE)
    num_rows = len(samples)
    prompt_lens = np.array([len(s.prompt_ids) for s in samples], np.int64)
    response_lens = np.array([len(s.response_ids) for s in samples], np.int64)
    width_p = _width(prompt_length, prompt_lens, "prompt_length", samples)
    width_r = _width(response_length, response_lens, "response_length", samples)
    masks, masked = loss_masks(samples, missing_logprobs, _RULE)

    prompts = np.full((num_rows, width_p), pad_token_id, np.int64)
    responses = np.full((num_rows, width_r), pad_token_id, np.int64)
    response_mask = np.zeros((num_rows, width_r), np.int64)
    attention_mask = np.zeros((num_rows, width_p + width_r), np.int64)
    logprobs = np.zeros((num_rows, width_r), np.float32)
    logprobs_mask = np.zeros((num_rows, width_r), np.bool_)
    versions = np.full((num_rows, width_r), -1, np.int32)
    for i, (s, loss_mask) in enumerate(zip(samples, masks)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        prompts[i, width_p - p:] = s.prompt_ids
        responses[i, :r] = s.response_ids
        response_mask[i, :r] = loss_mask
        attention_mask[i, width_p - p: width_p + r] = 1
        logprobs[i, :r] = s.rollout_logprobs
        logprobs_mask[i, :r] = s.logprobs_mask
        versions[i, :r] = s.token_model_versions
    position_ids = np.clip(np.cumsum(attention_mask, axis=-1) - 1, 0, None)

    tensors: dict[str, Any] = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1), "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    if logprobs_mask.any():
        tensors["rollout_log_probs"] = logprobs
    routes = _routes(samples, width_p, width_r)
    masked_routes = 0
    if routes is not None:
        tensors["routed_experts"], tensors["routed_experts_mask"] = routes
        for i in _unreplayable(samples, masks, missing_routes):
            masked_routes += int(response_mask[i].sum())
            response_mask[i] = 0
        if masked_routes:
            _log.info("%d trained tokens in rows without captured routes left out of the loss", masked_routes)
    rm_scores = _rm_scores(samples, response_lens, width_r, missing_reward)
    if rm_scores is not None:
        tensors["rm_scores"] = rm_scores
    tensors["token_model_versions"] = versions
    tensors["rollout_log_probs_mask"] = logprobs_mask
    batch = TensorDict({k: torch.from_numpy(v) for k, v in tensors.items()}, batch_size=num_rows)

    non_tensor: dict[str, np.ndarray] = {
        "__num_turns__": np.array([_num_turns(s.loss_mask) for s in samples], np.int32),
        "multi_modal_inputs": _objects([{} for _ in samples]),
        "raw_prompt": _objects([None] * num_rows),
        "uid": _objects([s.group_id if s.group_id is not None else s.trajectory_id for s in samples]),
        "min_global_steps": _objects([int(s.min_model_version) for s in samples]),
        "max_global_steps": _objects([int(s.max_model_version) for s in samples]),
        **{key: _objects([None] * num_rows) for key in _DEFAULT_EXTRA_FIELDS},
        "trajectory_id": _objects([s.trajectory_id for s in samples]),
        "sample_index": _objects([int(s.sample_index) for s in samples]),
        "finish_reason": _objects([s.finish_reason for s in samples]),
    }
    info: dict[str, Any] = {"temperature": float(temperature), "timing": {}}
    if rm_scores is not None:
        info["reward_extra_keys"] = []
    info["trajstore"] = {"masked_missing_logprobs": masked, "masked_missing_routes": masked_routes,
                         **(meta_info or {})}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=info)


def verl_batches(reader: Any, **kwargs: Any) -> Iterator[Any]:
    """``data_proto`` of each batch of a ``SampleReader``; ``meta_info["trajstore"]``
    holds the reader's ``step`` and ``reader_state`` after the batch (resume:
    ``reader.load_state_dict(state)``). An empty batch is skipped; its step still
    advances the state."""
    for step, samples in reader.iter_steps():
        if not samples:
            continue
        yield data_proto(samples, meta_info={"step": step, "reader_state": reader.state_dict()}, **kwargs)


def _width(given: int | None, lengths: np.ndarray, name: str, samples: Sequence[Sample]) -> int:
    longest = int(lengths.max())
    if given is None:
        return longest
    if longest > given:
        s = samples[int(lengths.argmax())]
        raise ValidationError(f"sample {s.trajectory_id}#{s.sample_index} has {longest} tokens, more than "
                              f"{name}={given}", rule=_RULE)
    return given


def _routes(samples: Sequence[Sample], width_p: int, width_r: int) -> tuple[np.ndarray, np.ndarray] | None:
    """verl's int16 routes (captured rows at their tokens, zeros elsewhere) and the route mask."""
    with_routes = [s for s in samples if s.routed_experts is not None]
    if not with_routes:
        return None
    layer_topk = {s.routed_experts.shape[1:] for s in with_routes}
    if len(layer_topk) > 1:
        raise ValidationError(f"samples disagree on routes [layers, topk]: {sorted(layer_topk)}", rule=_RULE)
    routes = np.zeros((len(samples), width_p + width_r, *next(iter(layer_topk))), np.int16)
    mask = np.ones((len(samples), width_p + width_r), np.bool_)
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            continue
        if s.routed_experts.dtype != np.uint8 and int(s.routed_experts.max(initial=0)) > np.iinfo(np.int16).max:
            raise ValidationError(f"sample {s.trajectory_id}#{s.sample_index}: expert id "
                                  f"{int(s.routed_experts.max())} does not fit verl's int16 routes", rule=_RULE)
        start = width_p - len(s.prompt_ids)
        rows = routes[i, start: start + s.num_tokens]
        rows[...] = s.routed_experts  # one contiguous copy; the few uncaptured rows are zeroed after
        rows[s.routed_experts_mask] = 0
        mask[i, start: start + s.num_tokens] = s.routed_experts_mask
    return routes, mask


def _unreplayable(samples: Sequence[Sample], masks: list[list[int]], missing_routes: str) -> list[int]:
    """The rows verl's R3 would replay with an uncaptured route; refused unless ``missing_routes="mask"``.

    verl 0.9.1 (``build_r3_replay_mask``, ``verl/utils/megatron/router_replay_utils.py``)
    replays positions ``[0, P+R-1)`` of every row whose ``response_mask`` is not all
    zero, and no position of the others."""
    rows = []
    for i, s in enumerate(samples):
        if not any(masks[i]) or s.num_tokens < 2:
            continue
        if s.routed_experts is None:
            what = "has no routes but other samples of the batch do"
        else:
            uncaptured = np.flatnonzero(s.routed_experts_mask[:s.num_tokens - 1])
            if not uncaptured.size:
                continue
            what = f"has no captured route at position {int(uncaptured[0])}"
        if missing_routes == "refuse":
            raise ValidationError(
                f"sample {s.trajectory_id}#{s.sample_index} {what}: verl's R3 replays every position of a trained "
                "row but the last, and would route it to expert 0; pass missing_routes='mask' to leave the row "
                "out of the loss", rule=_RULE)
        rows.append(i)
    return rows


def _rm_scores(samples: Sequence[Sample], response_lens: np.ndarray, width_r: int,
               missing_reward: float | None) -> np.ndarray | None:
    if missing_reward is None and any(s.reward is None and s.is_last_step for s in samples):
        return None  # as verl's agent loop: rm_scores only when every row has a score
    scores = np.zeros((len(samples), width_r), np.float32)
    for i, reward in enumerate(rewards(samples, missing_reward, _RULE)):
        r = int(response_lens[i])
        if isinstance(reward, list):  # token rewards, the reward already on the last token
            scores[i, :r] = reward
        elif r:
            scores[i, r - 1] = reward
    return scores


def _num_turns(loss_mask: np.ndarray) -> int:
    """The prompt plus each run of generated or observation tokens: what verl's
    tool agent loop counts as user, assistant and tool turns."""
    runs = 1 + int(np.count_nonzero(np.diff(loss_mask.astype(np.int8)))) if len(loss_mask) else 0
    return 1 + runs


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
