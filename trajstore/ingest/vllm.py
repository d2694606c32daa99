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
  no per-request switch);
* the token-in/token-out endpoint ``POST /inference/v1/generate``: the
  request's ``token_ids`` are the prompt, ``choices[i].token_ids`` the
  output, logprobs in ``choices[i].logprobs.content[j].logprob``, routes in
  ``choices[i].routed_experts`` (:func:`generations_from_tito`). Streamed,
  routes and version spans come on the final chunk.

What every path also carries:

* **weight versions.** An engine that swaps weights while a request runs
  reports ``weight_versions``: spans ``{version, start, end}`` over output
  token indexes (``[start, end)``), on the final ``CompletionOutput`` and per
  choice in the server's JSON. They become ``token_model_versions`` (one int
  per output token) and ``model_version`` its last entry. A label becomes
  ``int(label)``, or what the caller's ``version_map`` (a mapping or a
  function) gives it; a label neither can turn into an integer is a
  ValidationError, never a guess.
* **skipped route rows.** A request with ``routed_experts_prompt_start = k``
  gets route rows from position ``k`` on; the event then carries
  ``routed_experts_start = k`` (pass ``routed_experts_prompt_start`` to the
  adapter, or the request body to :func:`generations_from_tito`).
* **logprobs the engine could not give.** ``-inf``/NaN become vLLM's floor
  ``LOGPROB_FLOOR`` (-9999.0) and the event's ``metadata`` counts them
  (``{"clamped_logprobs": n}``); the store itself keeps refusing non-finite
  values sent directly.
* ``finish_reason`` as given; a non-null ``stop_reason`` (the stop string or
  token id) goes in ``metadata["stop_reason"]``. ``metadata`` is emitted only
  when it has something to say.

Routes stay numpy arrays from end to end: decoding goes through
``trajstore.events._wire.decode_array`` (``np.load`` of the ``.npy`` bytes).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from trajstore.errors import ValidationError
from trajstore.events._wire import decode_array
from trajstore.ingest._event_dicts import partial_routes_of_abort, to_numpy
from trajstore.ingest._openai_stream import OpenAIStreamAccumulator as _OpenAIStreamAccumulator

__all__ = [
    "LOGPROB_FLOOR",
    "OpenAIStreamAccumulator",
    "VersionMap",
    "generation_from_output",
    "generations_from_openai",
    "generations_from_tito",
    "logprobs_from_vllm",
    "request_params_for_recording",
    "request_params_for_tito",
    "routed_experts_prompt_start_of",
    "token_model_versions_from_spans",
]

LOGPROB_FLOOR = -9999.0  # what vLLM's server puts for a logprob it cannot give; SkyRL clamps to the same
_INT32_MAX = int(np.iinfo(np.int32).max)

VersionMap = Union[Mapping[Any, int], Callable[[Any], int], None]

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


def _version_int(label: Any, version_map: VersionMap) -> int:
    """One weight-version label as the integer model version (never a guess)."""
    if version_map is not None:
        if isinstance(version_map, Mapping):
            try:
                value = version_map.get(label, version_map.get(str(label)))
            except TypeError:  # an unhashable label (a list in the JSON, say)
                value = None
        else:
            try:
                value = version_map(label)
            except Exception as e:  # the caller's function said no
                raise ValidationError(f"version_map cannot map weight version {label!r}: {e}", rule="weight_versions") from None
        if value is None:
            raise ValidationError(f"weight version {label!r} is not in the version_map", rule="weight_versions")
    else:
        value = label
        if isinstance(label, str) and label.strip().lstrip("+-").isdecimal():
            value = int(label.strip())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValidationError(
            f"weight version {label!r} is not an integer: pass version_map to say which model version it is",
            rule="weight_versions",
        )
    if not 0 <= int(value) <= _INT32_MAX:
        raise ValidationError(f"weight version {label!r} gives model version {int(value)}, outside [0, 2**31)", rule="weight_versions")
    return int(value)


def _span_fields(span: Any) -> tuple[Any, Any, Any]:
    if isinstance(span, Mapping):
        return span.get("version"), span.get("start"), span.get("end")
    if isinstance(span, (list, tuple)) and len(span) == 3:
        return span[0], span[1], span[2]
    return getattr(span, "version", None), getattr(span, "start", None), getattr(span, "end", None)


def token_model_versions_from_spans(spans: Any, num_tokens: int, *, version_map: VersionMap = None) -> np.ndarray | None:
    """vLLM's ``weight_versions`` spans as int32 ``[num_tokens]`` model versions.

    Spans are ``{version, start, end}`` (dicts, objects with those attributes,
    or ``(version, start, end)`` tuples) over output-token indexes, ``end``
    exclusive. They must tile ``[0, num_tokens)`` in order; None or an empty
    list means the engine reported none (None is returned).
    """
    if spans is None or (hasattr(spans, "__len__") and len(spans) == 0):
        return None
    if isinstance(spans, (str, bytes, Mapping)) or not isinstance(spans, Sequence):
        raise ValidationError(f"weight_versions must be a list of spans, got {type(spans).__name__}", rule="weight_versions")
    versions, lengths, expected = [], [], 0
    for i, span in enumerate(spans):
        label, start, end = _span_fields(span)
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (start, end)):
            raise ValidationError(f"weight_versions span {i} needs integer start and end, got {start!r}, {end!r}", rule="weight_versions")
        if start != expected or end < start:
            raise ValidationError(
                f"weight_versions span {i} is [{start}, {end}) but the spans must tile the output from {expected}",
                rule="weight_versions",
            )
        if label is None:
            raise ValidationError(f"weight_versions span {i} has no version", rule="weight_versions")
        versions.append(_version_int(label, version_map))
        lengths.append(int(end) - int(start))
        expected = int(end)
    if expected != num_tokens:
        raise ValidationError(
            f"weight_versions spans cover {expected} output tokens but the call has {num_tokens}", rule="weight_versions"
        )
    return np.repeat(np.asarray(versions, dtype=np.int32), lengths)


def _clamped(values: np.ndarray) -> np.ndarray:
    """``values`` with non-finite entries set to LOGPROB_FLOOR, as vLLM's server does
    (the store counts every value at or below the floor and keeps it as missing)."""
    bad = ~np.isfinite(values)
    if bad.any():
        values = values.copy()
        values[bad] = LOGPROB_FLOOR
    return values


def _spans_as_sent(spans: Any) -> list[dict] | None:
    """The engine's spans as wire ``weight_versions`` (labels verbatim), None when it sent none.

    Accepts dicts, objects with ``version``/``start``/``end`` (vLLM's
    ``WeightVersionSpan``) or ``(version, start, end)`` tuples; the store
    checks that they tile the output and resolves the labels.
    """
    if spans is None:
        return None
    if isinstance(spans, (str, bytes, Mapping)) or not isinstance(spans, (Sequence, np.ndarray)):
        raise ValidationError(f"weight_versions must be a list of spans, got {type(spans).__name__}", rule="weight_versions")
    out = []
    for span in spans:
        label, start, end = _span_fields(span)
        if isinstance(label, np.integer):
            label = int(label)
        out.append({"version": label, "start": start, "end": end})
    return out


def _drop_declared_version(event: dict) -> None:
    """The engine's spans say every token's version: the call's declared
    ``model_version`` stays only as the version of the engine's unset label
    ``"default"`` (docs/reference.md "Versions"), or when the spans are empty. Sent beside
    spans that do not use it, it would have to equal the last token's version,
    which the declaration (made before the call ran) cannot know."""
    spans = event.get("weight_versions")
    if isinstance(spans, (list, tuple)) and spans and not any(
            isinstance(s, Mapping) and s.get("version") == "default" for s in spans):
        event.pop("model_version", None)  # (spans of another shape are refused by the store, as sent)


def _versions_from_map(spans: list[dict], num_tokens: int, version_map: VersionMap) -> np.ndarray | None:
    """Per-token versions when ``version_map`` (deprecated) maps every label, else None (the store resolves)."""
    import warnings

    warnings.warn("version_map is deprecated: append version_label events ({'type': 'version_label', 'label': ..., "
                  "'model_version': ...}) and the store resolves the engine's labels", DeprecationWarning, stacklevel=4)
    try:
        return token_model_versions_from_spans(spans, num_tokens, version_map=version_map)
    except ValidationError:
        return None


def _complete(
    event: dict,
    *,
    logprobs: np.ndarray | None,
    routes: Any,
    routes_start: int,
    finish_reason: Any,
    stop_reason: Any,
    weight_versions: Any,
    version_map: VersionMap,
    fields: Mapping[str, Any],
) -> dict:
    """Add what every adapter path carries to ``event`` (which has the ids and model_version)."""
    metadata: dict = {}
    if logprobs is not None:
        event["logprobs"] = _clamped(np.asarray(logprobs, dtype=np.float32).reshape(-1))
    spans = _spans_as_sent(weight_versions)
    if spans is not None:
        event["weight_versions"] = spans
        _drop_declared_version(event)
        if version_map is not None:
            versions = _versions_from_map(spans, len(event["output_ids"]), version_map)
            if versions is not None:
                event["token_model_versions"] = versions
                event["model_version"] = int(versions[-1])
    if routes is not None:
        event["routed_experts"] = _routes_array(routes)
        if routes_start:
            event["routed_experts_start"] = int(routes_start)
    if isinstance(finish_reason, Enum):  # the offline engine's FinishReason
        finish_reason = str(finish_reason)
    if finish_reason is not None:
        if not isinstance(finish_reason, str):
            raise ValidationError(f"finish_reason must be a string, got {type(finish_reason).__name__}", rule="finish_reason")
        event["finish_reason"] = finish_reason
    if stop_reason is not None:
        metadata["stop_reason"] = stop_reason if isinstance(stop_reason, (int, str)) else str(stop_reason)
    if "routed_experts" in event:  # an aborted call's partial rows: left out, said so (_event_dicts)
        partial_routes_of_abort(event, metadata, len(event["routed_experts"]))
    fields = dict(fields)
    given = fields.pop("metadata", None)
    if given:
        metadata = {**given, **metadata}
    if metadata:
        event["metadata"] = metadata
    event.update(fields)
    return event


def generation_from_output(
    output: Any,
    prompt_ids: Any,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    version_map: VersionMap = None,
    routed_experts_prompt_start: int = 0,
    **fields: Any,
) -> dict:
    """A generation event dict from a vLLM ``CompletionOutput``-like object.

    ``output`` may also be a ``RequestOutput`` (its first completion and its
    ``prompt_token_ids`` are used when ``prompt_ids`` is None). Read:
    ``token_ids``, ``logprobs``, ``routed_experts``, ``weight_versions``,
    ``finish_reason``, ``stop_reason``. ``routed_experts_prompt_start``: the
    request's ``SamplingParams.routed_experts_prompt_start`` (the routes then
    start at that position). Extra ``fields`` (loss_mask, reward, event_id,
    metadata, ...) are copied into the event as given (``metadata`` merged).
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
    return _complete(
        event,
        logprobs=logprobs_from_vllm(getattr(output, "logprobs", None), output_ids),
        routes=getattr(output, "routed_experts", None),
        routes_start=routed_experts_prompt_start,
        finish_reason=getattr(output, "finish_reason", None),
        stop_reason=getattr(output, "stop_reason", None),
        weight_versions=getattr(output, "weight_versions", None),
        version_map=version_map,
        fields=fields,
    )


def _routes_array(routes: Any) -> np.ndarray:
    return decode_array(to_numpy(routes), field="routed_experts", ndim=3)


def _ids(value: Any, field: str) -> np.ndarray:
    """A JSON list of token ids as int64 ``[n]``; ValidationError for anything else (never a silent cast)."""
    if isinstance(value, (list, tuple)):
        arr = decode_array(list(value), field=field, ndim=1)
    elif isinstance(value, np.ndarray):
        arr = value.reshape(-1)
    else:
        raise ValidationError(f"{field} must be a list of token ids, got {type(value).__name__}", rule="token_ids")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValidationError(f"{field} must hold integer token ids, got {arr.dtype.name}", rule="token_ids")
    return arr.astype(np.int64, copy=False)


def _values(value: Any, field: str) -> np.ndarray:
    """A JSON list of numbers as float32 ``[n]`` (None entries and non-numbers refused)."""
    if not isinstance(value, (list, tuple)):
        raise ValidationError(f"{field} must be a list of numbers, got {type(value).__name__}", rule="logprobs")
    if any(v is None for v in value):
        raise ValidationError("the response's logprobs hold null entries", rule="logprobs")
    arr = decode_array(list(value), field=field, ndim=1)
    if arr.size and arr.dtype.kind not in "iuf":
        raise ValidationError(f"{field} must hold numbers, got {arr.dtype.name}", rule="logprobs")
    return arr.astype(np.float32)


def _output_ids_from_logprob_tokens(tokens: Sequence[Any] | None) -> list[int] | None:
    # A fallback when the response lacks choices[i].token_ids: vLLM 0.33's
    # /inference/v1/generate names each logprob entry's token_id, and with
    # return_tokens_as_token_ids the OpenAI entries name it "token_id:123".
    if not tokens:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return list(tokens)
    if not all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) and t[len(_TOKEN_ID_PREFIX):].isdecimal() for t in tokens):
        return None
    return [int(t[len(_TOKEN_ID_PREFIX):]) for t in tokens]


def _mapping(value: Any, what: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} must be an object, got {type(value).__name__}", rule="upstream_response")
    return value


def _choice_logprobs(choice: Mapping) -> tuple[list | None, list | None]:
    """(logprob values, token names or ids) of one choice, None where absent.

    ``logprobs.content[j]`` (chat and ``/inference/v1/generate``, whose
    entries carry ``token_id``) or ``logprobs.token_logprobs`` (completions).
    """
    lp = choice.get("logprobs")
    if not lp:
        return None, None
    lp = _mapping(lp, "a choice's logprobs")
    if "content" in lp:
        content = lp.get("content")
        if content is None:
            return None, None
        if not isinstance(content, list):
            raise ValidationError(f"logprobs.content must be a list, got {type(content).__name__}", rule="logprobs")
        entries = [_mapping(c, "a logprobs.content entry") for c in content]
        names = [c["token_id"] if "token_id" in c else c.get("token") for c in entries]
        return [c.get("logprob") for c in entries], names
    values, names = lp.get("token_logprobs"), lp.get("tokens")
    if values is not None and not isinstance(values, list):
        raise ValidationError(f"logprobs.token_logprobs must be a list, got {type(values).__name__}", rule="logprobs")
    return values, names if isinstance(names, list) else None


def _parse_choice(
    response: Mapping,
    choice: Mapping,
    prompt_ids: Any,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    version_map: VersionMap,
    routes_start: int,
    fields: Mapping[str, Any],
) -> dict:
    choice = _mapping(choice, "a choice")
    values, names = _choice_logprobs(choice)
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
    event: dict = {
        "type": "generation",
        "trajectory_id": trajectory_id,
        "seq": seq,
        "prompt_ids": _ids(prompt_ids, "prompt_token_ids"),
        "output_ids": _ids(output_ids, "token_ids"),
        "model_version": model_version,
    }
    return _complete(
        event,
        logprobs=None if values is None else _values(values, "logprobs"),
        routes=choice.get("routed_experts"),
        routes_start=routes_start,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        weight_versions=choice.get("weight_versions"),
        version_map=version_map,
        fields=fields,
    )


def _choices(response: Mapping) -> list:
    choices = _mapping(response, "the response").get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValidationError("the response has no choices", rule="missing_field")
    for c in choices:
        index = _mapping(c, "a choice").get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValidationError(f"a choice's index must be an integer, got {index!r:.40}", rule="upstream_response")
    return sorted(choices, key=lambda c: c.get("index", 0))


def generations_from_openai(
    response: Mapping,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    prompt_ids: Any = None,
    version_map: VersionMap = None,
    routed_experts_prompt_start: int = 0,
    **fields: Any,
) -> list[dict]:
    """Generation event dicts, one per choice, from an OpenAI-compatible JSON response.

    Choice ``i`` gets ``seq + i`` (a response with ``n > 1`` choices is a set
    of alternatives; callers that record them usually want one trajectory
    per choice and pass ``n = 1``). ``prompt_ids`` overrides the response's
    prompt token ids (e.g. a completions call whose prompt was token ids).
    ``routed_experts_prompt_start``: what the request set (the top-level
    request field of the same name); ``choices[i].weight_versions`` spans
    become ``token_model_versions``.
    """
    return [
        _parse_choice(response, choice, prompt_ids, trajectory_id=trajectory_id, seq=seq + i,
                      model_version=model_version, version_map=version_map,
                      routes_start=routed_experts_prompt_start, fields=fields)
        for i, choice in enumerate(_choices(response))
    ]


def routed_experts_prompt_start_of(request: Mapping) -> int:
    """The ``routed_experts_prompt_start`` a request body sets (0 when unset).

    The OpenAI endpoints take it as a top-level field, ``/inference/v1/generate``
    inside ``sampling_params``.
    """
    params = request.get("sampling_params")
    value = (params.get("routed_experts_prompt_start") if isinstance(params, Mapping) else None)
    if value is None:
        value = request.get("routed_experts_prompt_start")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationError(f"routed_experts_prompt_start must be a non-negative integer, got {value!r}",
                              rule="routed_experts_start")
    return value


def generations_from_tito(
    response: Mapping,
    request: Mapping,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    version_map: VersionMap = None,
    **fields: Any,
) -> list[dict]:
    """Generation event dicts from vLLM's token-in/token-out ``POST /inference/v1/generate``.

    ``request`` is the body that was sent: its ``token_ids`` are the prompt and
    its ``sampling_params.routed_experts_prompt_start`` the first route row's
    position. The response (``GenerateResponse``) has ``choices[i].token_ids``,
    ``.logprobs.content[j].logprob`` (request ``sampling_params.logprobs``),
    ``.routed_experts`` (base64 ``.npy``), ``.weight_versions``,
    ``.finish_reason`` and ``.stop_reason``.
    """
    prompt_ids = request.get("token_ids")
    if prompt_ids is None:
        raise ValidationError("the generate request has no token_ids", rule="missing_token_ids")
    start = routed_experts_prompt_start_of(request)
    return [
        _parse_choice(response, choice, prompt_ids, trajectory_id=trajectory_id, seq=seq + i,
                      model_version=model_version, version_map=version_map, routes_start=start, fields=fields)
        for i, choice in enumerate(_choices(response))
    ]


def request_params_for_recording(body: Mapping, *, chat: bool) -> dict:
    """``body`` plus what vLLM needs to return token ids, sampled-token logprobs and version spans.

    ``return_token_ids`` and ``return_weight_versions`` are set to true even
    when the caller set them false: a record needs them, and the answer only
    gains fields an OpenAI client ignores. Older servers ignore the second
    (vLLM's request models accept unknown fields with a warning).
    Routes need no request field: the vLLM server returns them for every
    request when started with ``--enable-return-routed-experts``.
    """
    out = dict(body)
    out["return_token_ids"] = True
    out["return_weight_versions"] = True  # vLLM >= 0.33: spans per choice (else one version per call)
    if chat:
        if not out.get("logprobs"):
            out["logprobs"] = True
    elif out.get("logprobs") is None:
        out["logprobs"] = 0  # 0 = the sampled token's logprob only
    return out


def request_params_for_tito(body: Mapping) -> dict:
    """A ``/inference/v1/generate`` body asking for the sampled tokens' logprobs.

    Token ids always come back from this endpoint; ``sampling_params.logprobs``
    is set to 0 (the sampled token only) unless the caller set it.
    """
    out = dict(body)
    params = out.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValidationError("sampling_params must be an object", rule="sampling_params")
    params = dict(params)
    if params.get("logprobs") is None:
        params["logprobs"] = 0
    out["sampling_params"] = params
    return out


def _list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise ValidationError(f"{field} must be a list, got {type(value).__name__}", rule="upstream_response")
    return value


class OpenAIStreamAccumulator(_OpenAIStreamAccumulator):
    """Collects the chunks of a streamed (SSE) OpenAI response from vLLM into one response.

    Feed each decoded ``data:`` JSON object to :meth:`add`; :meth:`response`
    returns a non-streaming-shaped dict that :func:`generations_from_openai`
    (or, for ``/inference/v1/generate`` streams, :func:`generations_from_tito`)
    reads. vLLM sends ``prompt_token_ids`` on the first chunk and each chunk's
    new ``token_ids`` and logprobs as deltas; ``finish_reason``,
    ``stop_reason``, ``routed_experts`` and ``weight_versions`` are kept from
    whichever chunk carries them (the final one). The accumulation is the
    shared one (``trajstore.ingest._openai_stream``); this says how vLLM's
    chunks read.
    """

    engine = "vLLM"
    kept = ("finish_reason", "stop_reason", "routed_experts", "weight_versions")
    shape_rule = "upstream_response"

    def __init__(self) -> None:
        super().__init__()
        self._object: str | None = None
        self._prompt_ids: list[int] | None = None

    def add_chunk(self, chunk: Mapping) -> None:
        if chunk.get("prompt_token_ids") is not None:
            self._prompt_ids = _list(chunk["prompt_token_ids"], "prompt_token_ids")
        self._object = self._object or chunk.get("object")

    def logprobs_of(self, c: Mapping) -> tuple[list | None, list | None, bool]:
        values, names = _choice_logprobs(c)
        return values, names, "content" in (c.get("logprobs") or {})

    def logprobs_field(self, acc: dict) -> dict:
        if acc["content"]:
            return {"content": [{"token": t, "logprob": v} for t, v in zip(acc["tokens"], acc["logprobs"])]}
        return {"token_logprobs": acc["logprobs"], "tokens": acc["tokens"]}

    def choice(self, index: int, acc: dict, chat: bool) -> dict:
        choice = super().choice(index, acc, chat)
        if chat:
            choice["message"] = {"role": "assistant"}
        return choice

    def finish_response(self, out: dict, chat: bool) -> dict:
        out["object"] = "chat.completion" if chat else "text_completion"
        if self._prompt_ids is not None:
            out["prompt_token_ids"] = self._prompt_ids
        return out
