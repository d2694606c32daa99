"""Generation events from what vLLM returns, without importing vLLM.

Two shapes are accepted, both by duck typing:

* the offline engine's ``CompletionOutput`` (``token_ids``, ``logprobs``,
  ``routed_experts``, ``finish_reason``) with the request's prompt token ids
  (``RequestOutput.prompt_token_ids``);
* the OpenAI-compatible server's JSON. Token ids come back when the request
  sets ``return_token_ids: true``: ``choices[i].token_ids`` for the output,
  the prompt in ``choices[i].prompt_token_ids`` (``/v1/completions``) or the
  top-level ``prompt_token_ids`` (``/v1/chat/completions``). Logprobs are in
  ``choices[i].logprobs.token_logprobs`` (completions, request
  ``logprobs: 0``) or ``choices[i].logprobs.content[j].logprob`` (chat,
  request ``logprobs: true``). Routes are ``choices[i].routed_experts``, a
  base64 ``.npy`` of shape ``[prompt + output - 1, layers, topk]``, present
  only when the server runs with ``--enable-return-routed-experts`` (there is
  no per-request switch) and only in non-streaming responses.

Routes stay numpy arrays from end to end: decoding goes through
``trajstore._wire.decode_array`` (``np.load`` of the ``.npy`` bytes).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from trajstore.errors import ValidationError
from trajstore._wire import decode_array

__all__ = [
    "OpenAIStreamAccumulator",
    "generation_from_output",
    "generations_from_openai",
    "logprobs_from_vllm",
    "request_params_for_recording",
]

_TOKEN_ID_PREFIX = "token_id:"  # what vLLM writes with return_tokens_as_token_ids


def logprobs_from_vllm(logprobs: Any, token_ids: Sequence[int]) -> np.ndarray | None:
    """The sampled tokens' logprobs as float32 ``[len(token_ids)]``.

    Accepts None, a list of floats, vLLM's ``list[dict[token_id, Logprob]]``
    (the sampled token is looked up by id: the top-k entries are other
    candidates), or its ``FlatLogprobs`` (parallel flat lists).
    """
    if logprobs is None:
        return None
    if hasattr(logprobs, "start_indices") and hasattr(logprobs, "token_ids"):
        return _from_flat_logprobs(logprobs, token_ids)
    if isinstance(logprobs, np.ndarray):
        return logprobs.astype(np.float32, copy=False).reshape(-1)
    values = np.empty(len(logprobs), dtype=np.float32)
    for i, entry in enumerate(logprobs):
        values[i] = _one_logprob(entry, token_ids, i)
    return values


def _one_logprob(entry: Any, token_ids: Sequence[int], i: int) -> float:
    if isinstance(entry, Mapping):
        if i >= len(token_ids):
            raise ValidationError(f"logprobs has more positions than the {len(token_ids)} output tokens", rule="length_mismatch")
        hit = entry.get(int(token_ids[i]))
        if hit is None:
            raise ValidationError(f"logprobs position {i} lacks the sampled token {int(token_ids[i])}", rule="logprobs")
        entry = hit
    value = getattr(entry, "logprob", entry)
    if value is None:
        raise ValidationError(f"logprobs position {i} is null", rule="logprobs")
    return float(value)


def _from_flat_logprobs(flat: Any, token_ids: Sequence[int]) -> np.ndarray:
    # vLLM puts the sampled token first at each position; check that rather
    # than trust it, and fall back to a search of the position's range.
    starts = np.asarray(flat.start_indices, dtype=np.int64)
    ends = np.asarray(flat.end_indices, dtype=np.int64)
    flat_ids = np.asarray(flat.token_ids, dtype=np.int64)
    flat_values = np.asarray(flat.logprobs, dtype=np.float32)
    wanted = np.asarray(token_ids, dtype=np.int64)[: len(starts)]
    picked = flat_values[starts].copy()
    for i in np.nonzero(flat_ids[starts] != wanted)[0]:
        span = np.nonzero(flat_ids[starts[i] : ends[i]] == wanted[i])[0]
        if not len(span):
            raise ValidationError(f"logprobs position {int(i)} lacks the sampled token {int(wanted[i])}", rule="logprobs")
        picked[i] = flat_values[starts[i] + span[0]]
    return picked


def generation_from_output(
    output: Any,
    prompt_ids: Any,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    **fields: Any,
) -> dict:
    """A generation event dict from a vLLM ``CompletionOutput``-like object.

    ``output`` may also be a ``RequestOutput`` (its first completion and its
    ``prompt_token_ids`` are used when ``prompt_ids`` is None). Extra
    ``fields`` (loss_mask, reward, routed_experts_start, event_id, ...) are
    copied into the event as given.
    """
    if prompt_ids is None and hasattr(output, "outputs"):
        prompt_ids = output.prompt_token_ids
    if hasattr(output, "outputs"):
        output = output.outputs[0]
    if prompt_ids is None:
        raise ValidationError("prompt_ids are needed: pass the request's prompt token ids", rule="missing_field")
    output_ids = np.asarray(output.token_ids, dtype=np.int64).reshape(-1)
    event = {
        "type": "generation",
        "trajectory_id": trajectory_id,
        "seq": seq,
        "prompt_ids": np.asarray(prompt_ids, dtype=np.int64).reshape(-1),
        "output_ids": output_ids,
        "model_version": model_version,
    }
    logprobs = logprobs_from_vllm(getattr(output, "logprobs", None), output_ids)
    if logprobs is not None:
        event["logprobs"] = logprobs
    routes = getattr(output, "routed_experts", None)
    if routes is not None:
        event["routed_experts"] = _routes_array(routes)
    if getattr(output, "finish_reason", None) is not None:
        event["finish_reason"] = str(output.finish_reason)
    event.update(fields)
    return event


def _routes_array(routes: Any) -> np.ndarray:
    if hasattr(routes, "detach"):  # a torch tensor; never import torch for it
        routes = routes.detach().cpu().numpy()
    return decode_array(routes, field="routed_experts", ndim=3)


def _is_chat(response: Mapping) -> bool:
    obj = str(response.get("object", ""))
    if obj.startswith("chat.completion"):
        return True
    choices = response.get("choices") or [{}]
    return "message" in choices[0] or "delta" in choices[0]


def _output_ids_from_logprob_tokens(tokens: Sequence[str] | None) -> list[int] | None:
    # With return_tokens_as_token_ids the logprob entries name each token as
    # "token_id:123": a fallback when the response lacks choices[i].token_ids.
    if not tokens or not all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens):
        return None
    return [int(t[len(_TOKEN_ID_PREFIX):]) for t in tokens]


def _choice_logprobs(choice: Mapping, chat: bool) -> tuple[list | None, list | None]:
    """(logprob values, token names) of one choice, None where absent."""
    lp = choice.get("logprobs")
    if not lp:
        return None, None
    if chat:
        content = lp.get("content")
        if content is None:
            return None, None
        return [c.get("logprob") for c in content], [c.get("token") for c in content]
    return lp.get("token_logprobs"), lp.get("tokens")


def _parse_choice(response: Mapping, choice: Mapping, chat: bool, prompt_ids: Any) -> dict:
    values, names = _choice_logprobs(choice, chat)
    output_ids = choice.get("token_ids")
    if output_ids is None:
        output_ids = _output_ids_from_logprob_tokens(names)
    if output_ids is None:
        raise ValidationError(
            "the response has no output token ids: request return_token_ids=true", rule="missing_token_ids"
        )
    if prompt_ids is None:
        prompt_ids = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
    if prompt_ids is None:
        raise ValidationError(
            "the response has no prompt_token_ids: request return_token_ids=true or pass prompt_ids",
            rule="missing_token_ids",
        )
    event: dict = {"prompt_ids": np.asarray(prompt_ids, dtype=np.int64), "output_ids": np.asarray(output_ids, dtype=np.int64)}
    if values is not None:
        if any(v is None for v in values):
            raise ValidationError("the response's logprobs hold null entries", rule="logprobs")
        event["logprobs"] = np.asarray(values, dtype=np.float32)
    if choice.get("routed_experts") is not None:
        event["routed_experts"] = _routes_array(choice["routed_experts"])
    if choice.get("finish_reason") is not None:
        event["finish_reason"] = str(choice["finish_reason"])
    return event


def generations_from_openai(
    response: Mapping,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    prompt_ids: Any = None,
    **fields: Any,
) -> list[dict]:
    """Generation event dicts, one per choice, from an OpenAI-compatible JSON response.

    Choice ``i`` gets ``seq + i`` (a response with ``n > 1`` choices is a set
    of alternatives; callers that record them usually want one trajectory
    per choice and pass ``n = 1``). ``prompt_ids`` overrides the response's
    prompt token ids (e.g. a completions call whose prompt was token ids).
    """
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValidationError("the response has no choices", rule="missing_field")
    chat = _is_chat(response)
    events = []
    for i, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
        body = _parse_choice(response, choice, chat, prompt_ids)
        event = {"type": "generation", "trajectory_id": trajectory_id, "seq": seq + i, "model_version": model_version}
        event.update(body)
        event.update(fields)
        events.append(event)
    return events


def request_params_for_recording(body: Mapping, *, chat: bool) -> dict:
    """``body`` plus what vLLM needs to return token ids and sampled-token logprobs.

    Routes need no request field: the vLLM server returns them for every
    request when started with ``--enable-return-routed-experts``.
    """
    out = dict(body)
    out["return_token_ids"] = True
    if chat:
        if not out.get("logprobs"):
            out["logprobs"] = True
    elif out.get("logprobs") is None:
        out["logprobs"] = 0  # 0 = the sampled token's logprob only
    return out


class OpenAIStreamAccumulator:
    """Collects the chunks of a streamed (SSE) OpenAI response into one response.

    Feed each decoded ``data:`` JSON object to :meth:`add`; :meth:`response`
    returns a non-streaming-shaped dict that :func:`generations_from_openai`
    reads. vLLM sends ``prompt_token_ids`` on the first chunk and each chunk's
    new ``token_ids`` and logprobs as deltas.
    """

    def __init__(self) -> None:
        self._object: str | None = None
        self._prompt_ids: list[int] | None = None
        self._choices: dict[int, dict] = {}

    def add(self, chunk: Mapping) -> None:
        self._object = self._object or chunk.get("object")
        if chunk.get("prompt_token_ids") is not None:
            self._prompt_ids = list(chunk["prompt_token_ids"])
        for c in chunk.get("choices") or []:
            self._add_choice(c)

    def _add_choice(self, c: Mapping) -> None:
        acc = self._choices.setdefault(
            c.get("index", 0), {"token_ids": [], "logprobs": [], "tokens": [], "has_logprobs": False}
        )
        if c.get("prompt_token_ids") is not None:
            acc["prompt_token_ids"] = list(c["prompt_token_ids"])
        acc["token_ids"].extend(c.get("token_ids") or [])
        values, names = _choice_logprobs(c, "delta" in c)
        if values is not None:
            acc["has_logprobs"] = True
            acc["logprobs"].extend(values)
            acc["tokens"].extend(names or [])
        for key in ("finish_reason", "routed_experts"):
            if c.get(key) is not None:
                acc[key] = c[key]
        acc["chat"] = "delta" in c

    def response(self) -> dict:
        chat = any(acc.get("chat") for acc in self._choices.values())
        choices = [self._choice(i, acc, chat) for i, acc in sorted(self._choices.items())]
        out = {"object": "chat.completion" if chat else "text_completion", "choices": choices}
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids
        return out

    @staticmethod
    def _choice(index: int, acc: dict, chat: bool) -> dict:
        choice: dict = {"index": index, "finish_reason": acc.get("finish_reason")}
        if acc["token_ids"]:
            choice["token_ids"] = acc["token_ids"]
        for key in ("prompt_token_ids", "routed_experts"):
            if key in acc:
                choice[key] = acc[key]
        if acc["has_logprobs"]:
            if chat:
                content = [{"token": t, "logprob": v} for t, v in zip(acc["tokens"], acc["logprobs"])]
                choice["logprobs"] = {"content": content}
            else:
                choice["logprobs"] = {"token_logprobs": acc["logprobs"], "tokens": acc["tokens"]}
        if chat:
            choice["message"] = {"role": "assistant"}
        return choice
