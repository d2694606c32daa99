"""Generation events from what SGLang returns, without importing SGLang.

Read from SGLang 0.5.23's released code (``pip download --no-deps
sglang==0.5.23``; paths below are inside ``sglang/srt/``). Three shapes:

* the native ``POST /generate`` (``managers/io_struct.py`` ``GenerateReqInput``):
  the prompt is the request's ``input_ids`` (or the response's
  ``prompt_token_ids`` when the request sets ``return_prompt_token_ids``),
  the output ``output_ids``, and ``meta_info`` holds ``finish_reason`` (a dict,
  ``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ...}``: ``managers/schedule_batch.py``
  ``FINISH_*.to_json``), ``output_token_logprobs`` (``[logprob, token_id,
  text]`` triples, request ``return_logprob``), ``routed_experts`` and the
  weight versions (:func:`generation_from_generate`). Streamed, the chunks
  are cumulative by default and deltas under ``--incremental-streaming-output``
  (:class:`GenerateStreamAccumulator` takes both);
* the OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
  (``entrypoints/openai/protocol.py``, ``serving_completions.py``,
  ``serving_chat.py``): token ids in ``choices[i].token_ids`` /
  ``prompt_token_ids`` (completions, ``return_token_ids``),
  ``choices[i].response_token_ids`` / ``prompt_token_ids`` (chat,
  ``return_token_ids``) or the response-level ``sglext.input_ids`` /
  ``sglext.output_ids`` (``return_input_ids_in_sglext`` /
  ``return_output_ids_in_sglext``, the only way a streamed chat gets them);
  routes at response level in ``sglext.routed_experts`` (streamed: a last
  chunk with ``choices: []``); versions in ``metadata.weight_version(s)``,
  taken from the first choice only (:func:`generations_from_openai`).
  Streamed responses carry no ``metadata``: no spans, only the call's
  declared version (:class:`OpenAIStreamAccumulator`).

What the events carry:

* **routes.** ``routed_experts`` is base64 of the raw int32 bytes of a
  ``[rows, layers, topk]`` tensor (``managers/detokenizer_manager.py``
  ``_b64_encode_per_request``), rows for positions ``routed_experts_start_len
  .. prompt + output - 2`` (``managers/scheduler_components/
  batch_result_processor.py`` ``_maybe_collect_routed_experts``), layers =
  every hidden layer of the model (dense ones zero, as vLLM records them),
  topk = ``num_experts_per_tok`` (``state_capturer/routed_experts.py``). No
  shape travels with it and ``/model_info`` reports neither layers nor topk,
  so the caller gives the layout ``(layers, topk)`` (:func:`route_layout`);
  the byte count must be exactly the rows the call covers times
  ``layers * topk * 4``, else the event is refused in one line (never
  reshaped by guess). The event gets the wire's ``{b64, dtype: "int32",
  shape}`` ARRAY: the store reads the bytes in place, no copy loop.
* **only new route rows.** ``routed_experts_start_len = k`` becomes the
  event's ``routed_experts_start = k``, as ``routed_experts_prompt_start``
  does for vLLM.
* **versions.** ``meta_info["weight_versions"]`` (spans ``{version, start,
  end}`` over output tokens, ``utils/weight_versions.py``) go into the
  event's ``weight_versions`` as sent, beside the call's declared
  ``model_version``: the store resolves them (docs/reference.md "Versions": the unset
  label ``"default"`` is that ``model_version``, an integer label is itself,
  any other label goes through the store's label map). A response with only
  ``weight_version`` (one label) is one span over the whole output.
* **logprobs** as sent. SGLang serialises ``-inf`` as JSON ``null`` (orjson,
  pydantic): a null (or any non-finite value) becomes ``LOGPROB_FLOOR``
  (-9999.0), which the store keeps as "no logprob".
* ``finish_reason``: the dict's ``type``; a stop's ``matched`` (string or
  token id) goes in ``metadata["stop_reason"]`` (the key the vLLM adapter
  uses), an abort's message in ``metadata["abort_message"]``.

An SGLang call and a vLLM call of the same tokens give the same sample.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Mapping, Sequence

import numpy as np

from trajstore.errors import ValidationError
from trajstore.ingest._event_dicts import partial_routes_of_abort
from trajstore.ingest._openai_stream import OpenAIStreamAccumulator as _OpenAIStreamAccumulator
from trajstore.ingest.vllm import LOGPROB_FLOOR, _drop_declared_version

__all__ = [
    "GenerateStreamAccumulator",
    "OpenAIStreamAccumulator",
    "finish_reason_of",
    "generation_from_generate",
    "generations_from_openai",
    "logprobs_from_sglang",
    "request_params_for_generate",
    "request_params_for_openai",
    "route_layout",
    "routed_experts_start_len_of",
    "routes_from_sglang",
]

_MAX_LAYOUT = 1 << 16
_FIRST, _SECOND, _LOGPROB = itemgetter(0), itemgetter(1), itemgetter("logprob")


def route_layout(value: Any) -> tuple[int, int] | None:
    """``(layers, topk)`` from ``(48, 8)``, ``"48x8"``, ``"48,8"`` or ``{"layers", "topk"}``; None stays None.

    ``layers`` is the model's ``num_hidden_layers`` (every layer, dense ones
    included), ``topk`` its ``num_experts_per_tok``.
    """
    if value is None:
        return None
    parts: Any = value
    if isinstance(value, Mapping):
        parts = (value.get("layers"), value.get("topk"))
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        parts = text.lower().replace("x", ",").replace(" ", "").split(",")
        try:
            parts = [int(p) for p in parts]
        except ValueError:
            parts = None
    if (not isinstance(parts, (list, tuple)) or len(parts) != 2
            or not all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in parts)
            or not all(0 < int(p) <= _MAX_LAYOUT for p in parts)):
        raise ValidationError(
            f"route layout must be LAYERSxTOPK (two positive integers, e.g. 48x8), got {value!r}", rule="route_layout"
        )
    return int(parts[0]), int(parts[1])


def _b64_len(text: str) -> int:
    """Bytes a padded base64 string decodes to (the store checks the characters themselves)."""
    n = len(text)
    if n % 4:
        raise ValidationError(f"routed_experts is not base64 ({n} characters, not a multiple of 4)",
                              rule="array_encoding")
    return n // 4 * 3 - (2 if text.endswith("==") else 1 if text.endswith("=") else 0)


def routes_from_sglang(routes: Any, layout: Any, *, rows: int | None = None) -> dict | np.ndarray:
    """SGLang's routes as a wire ARRAY: ``{"b64", "dtype": "int32", "shape": [rows, layers, topk]}``.

    ``routes`` is ``meta_info["routed_experts"]`` (base64 of raw int32 bytes)
    or an int32 array/tensor already shaped ``[rows, layers, topk]`` (then it
    is returned as a numpy array). ``rows``: how many rows the call covers
    (``prompt + output - 1 - routed_experts_start``); the byte count must be
    exactly ``rows * layers * topk * 4``.
    """
    if hasattr(routes, "detach"):  # a torch tensor from an in-process engine
        routes = routes.detach().cpu().numpy()
    if isinstance(routes, np.ndarray):
        if routes.ndim != 3:
            raise ValidationError(f"routed_experts must be [rows, layers, topk], got shape {list(routes.shape)}",
                                  rule="array_shape")
        return routes
    if not isinstance(routes, str):
        raise ValidationError(f"routed_experts must be SGLang's base64 string, got {type(routes).__name__}",
                              rule="array_encoding")
    shape = route_layout(layout)
    if shape is None:
        raise ValidationError(
            "routed_experts came back as raw int32 without a shape: give the route layout LAYERSxTOPK "
            "(route_layout= / X-Trajstore-Route-Layout / --route-layout)", rule="route_layout")
    layers, topk = shape
    nbytes, row_bytes = _b64_len(routes), layers * topk * 4
    if rows is not None and nbytes != rows * row_bytes:
        raise ValidationError(
            f"routed_experts holds {nbytes} bytes but {rows} rows of int32 [{layers}, {topk}] need "
            f"{rows * row_bytes}: the route layout {layers}x{topk} does not fit this model", rule="route_layout")
    if nbytes % row_bytes:
        raise ValidationError(
            f"routed_experts holds {nbytes} bytes, not whole int32 rows of [{layers}, {topk}] "
            f"({row_bytes} bytes each): the route layout {layers}x{topk} does not fit this model", rule="route_layout")
    return {"b64": routes, "dtype": "int32", "shape": [nbytes // row_bytes, layers, topk]}


def logprobs_from_sglang(triples: Any, output_ids: np.ndarray | None = None) -> np.ndarray | None:
    """``output_token_logprobs`` (``[logprob, token_id, text]`` triples) as float32 logprobs.

    A null logprob (``-inf`` on SGLang's side) becomes ``LOGPROB_FLOOR``.
    With ``output_ids`` the triples' token ids must be the output tokens.
    """
    if triples is None:
        return None
    if not isinstance(triples, (list, tuple)):
        raise ValidationError(f"output_token_logprobs must be a list, got {type(triples).__name__}", rule="logprobs")
    if not triples:
        return np.zeros(0, dtype=np.float32)
    try:  # map(itemgetter) walks the list in C: no Python bytecode per token
        values, ids = list(map(_FIRST, triples)), list(map(_SECOND, triples))
    except (TypeError, IndexError, KeyError):
        raise ValidationError("output_token_logprobs entries must be [logprob, token_id, text]", rule="logprobs") from None
    if output_ids is not None:
        if len(ids) != len(output_ids):
            raise ValidationError(
                f"output_token_logprobs has {len(ids)} entries but the call has {len(output_ids)} output tokens",
                rule="length_mismatch")
        try:
            named = np.asarray(ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValidationError("output_token_logprobs names a non-integer token id", rule="logprobs") from None
        wrong = np.nonzero(named != output_ids)[0]
        if len(wrong):
            i = int(wrong[0])
            raise ValidationError(
                f"output_token_logprobs position {i} is for token {int(named[i])} but output token {i} is "
                f"{int(output_ids[i])}", rule="logprobs")
    return _float_logprobs(values, "output_token_logprobs")


def _float_logprobs(values: Sequence, what: str) -> np.ndarray:
    """float32 logprobs; null (what SGLang's JSON makes of -inf) and other non-finite values -> LOGPROB_FLOOR."""
    try:
        arr = np.asarray(values, dtype=np.float32)  # None -> nan
    except (TypeError, ValueError):
        raise ValidationError(f"{what} holds a logprob that is not a number", rule="logprobs") from None
    if arr.ndim != 1:
        raise ValidationError(f"{what} must be a flat list of numbers", rule="logprobs")
    bad = ~np.isfinite(arr)
    if bad.any():
        arr[bad] = LOGPROB_FLOOR
    return arr


def finish_reason_of(finish_reason: Any) -> tuple[str | None, dict]:
    """(the finish reason's type, what goes in metadata) from SGLang's dict (or an OpenAI string)."""
    if finish_reason is None:
        return None, {}
    if isinstance(finish_reason, str):
        return finish_reason, {}
    if not isinstance(finish_reason, Mapping) or not isinstance(finish_reason.get("type"), str):
        raise ValidationError(f"finish_reason must be SGLang's {{type, ...}} object, got {finish_reason!r:.80}",
                              rule="finish_reason")
    extra: dict = {}
    matched = finish_reason.get("matched")
    if matched is not None:
        if isinstance(matched, (int, str)) or (isinstance(matched, list) and all(
                isinstance(m, int) for m in matched)):
            extra["stop_reason"] = matched  # the stop string, token id or token ids
        else:
            extra["stop_reason"] = str(matched)[:200]
    if finish_reason["type"] == "abort" and finish_reason.get("message"):
        extra["abort_message"] = str(finish_reason["message"])[:1000]
    return finish_reason["type"], extra


def _spans(weight_versions: Any, weight_version: Any, num_tokens: int) -> Any:
    if weight_versions is not None:
        return [dict(s) if isinstance(s, Mapping) else s for s in weight_versions] \
            if isinstance(weight_versions, (list, tuple)) else weight_versions
    if weight_version is not None:
        return [{"version": weight_version, "start": 0, "end": num_tokens}]
    return None


def _ids(value: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValidationError(f"{what} must be a list of token ids", rule="missing_token_ids") from None
    if arr.ndim != 1:
        raise ValidationError(f"{what} must be one list of token ids (one prompt per recorded call)",
                              rule="missing_token_ids")
    return arr


def _event(*, trajectory_id: str, seq: int, model_version: int, prompt_ids: Any, output_ids: Any, logprobs: Any,
           routes: Any, routes_start: int, layout: Any, finish_reason: Any, spans: Any, fields: Mapping) -> dict:
    prompt = _ids(prompt_ids, "prompt_ids")
    output = _ids(output_ids, "output_ids")
    event: dict = {"type": "generation", "trajectory_id": trajectory_id, "seq": seq,
                   "prompt_ids": prompt, "output_ids": output, "model_version": model_version}
    if logprobs is not None:
        if len(logprobs) != len(output):
            raise ValidationError(f"the response has {len(logprobs)} logprobs for {len(output)} output tokens",
                                  rule="length_mismatch")
        event["logprobs"] = logprobs
    if spans is not None:
        event["weight_versions"] = spans
        _drop_declared_version(event)  # the spans say the versions ("default" takes the declared one)
    reason, metadata = finish_reason_of(finish_reason)
    if routes is not None:
        covered = len(prompt) + len(output) - 1
        start = min(routes_start, max(covered, 0))  # SGLang clamps the start to seqlen - 1
        # an aborted call may hold rows for part of its sequence only: counted, not checked here
        event["routed_experts"] = routes_from_sglang(routes, layout, rows=None if reason == "abort" else covered - start)
        if start:
            event["routed_experts_start"] = start
    if reason is not None:
        event["finish_reason"] = reason
    if "routed_experts" in event:  # an aborted call's partial rows: left out, said so (_event_dicts)
        r = event["routed_experts"]
        partial_routes_of_abort(event, metadata, int(r["shape"][0]) if isinstance(r, dict) else len(r))
    fields = dict(fields)
    given = fields.pop("metadata", None)
    if given:
        metadata = {**given, **metadata}
    if metadata:
        event["metadata"] = metadata
    event.update(fields)
    return event


def routed_experts_start_len_of(request: Mapping) -> int:
    """The ``routed_experts_start_len`` a request body sets (0 when unset)."""
    value = request.get("routed_experts_start_len")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValidationError(f"routed_experts_start_len must be a non-negative integer, got {value!r}",
                              rule="routed_experts_start")
    return value


def generation_from_generate(
    response: Mapping,
    request: Mapping | None = None,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    route_layout: Any = None,
    prompt_ids: Any = None,
    **fields: Any,
) -> dict:
    """A generation event dict from SGLang's native ``/generate`` response (one prompt, ``n = 1``).

    ``request`` is the body that was sent: its ``input_ids`` are the prompt
    (else the response's ``prompt_token_ids``, or ``prompt_ids``) and its
    ``routed_experts_start_len`` the first route row's position.
    ``route_layout``: ``(layers, topk)`` of the model, needed when the
    response has routes. Extra ``fields`` (loss_mask, reward, event_id,
    metadata, ...) are copied into the event (``metadata`` merged).
    """
    request = request or {}
    if isinstance(response, list):
        if len(response) != 1:
            raise ValidationError(f"a recorded /generate call must have one prompt and n = 1, got {len(response)} "
                                  "outputs", rule="n")
        response = response[0]
    if not isinstance(response, Mapping) or not isinstance(response.get("meta_info"), Mapping):
        raise ValidationError("the /generate response has no meta_info", rule="missing_field")
    meta = response["meta_info"]
    if prompt_ids is None:
        prompt_ids = request.get("input_ids")
    if prompt_ids is None:
        prompt_ids = response.get("prompt_token_ids")
    if prompt_ids is None:
        raise ValidationError("the /generate call has no prompt token ids: send input_ids or request "
                              "return_prompt_token_ids", rule="missing_token_ids")
    output_ids = response.get("output_ids")
    if output_ids is None:
        raise ValidationError("the /generate response has no output_ids", rule="missing_token_ids")
    output = _ids(output_ids, "output_ids")
    return _event(
        trajectory_id=trajectory_id, seq=seq, model_version=model_version, prompt_ids=prompt_ids,
        output_ids=output, logprobs=logprobs_from_sglang(meta.get("output_token_logprobs"), output),
        routes=meta.get("routed_experts"), routes_start=routed_experts_start_len_of(request), layout=route_layout,
        finish_reason=meta.get("finish_reason"),
        spans=_spans(meta.get("weight_versions"), meta.get("weight_version"), len(output)), fields=fields,
    )


def _obj(value: Any, what: str) -> Mapping:
    """``value`` as a JSON object ({} for null); anything else is refused naming ``what``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} must be an object, got {type(value).__name__}", rule="upstream_shape")
    return value


def _index_ok(index: Any) -> bool:
    return isinstance(index, int) and not isinstance(index, bool) and index >= 0


def _openai_logprobs(choice: Mapping) -> list | None:
    lp = _obj(choice.get("logprobs"), "choices[i].logprobs")
    if not lp:
        return None
    if "content" in lp:
        content = lp.get("content")
        if content is None:
            return None
        try:
            return list(map(_LOGPROB, content))
        except (TypeError, KeyError):
            raise ValidationError("logprobs.content entries must be objects with a logprob", rule="logprobs") from None
    return lp.get("token_logprobs")


def generations_from_openai(
    response: Mapping,
    request: Mapping | None = None,
    *,
    trajectory_id: str,
    seq: int,
    model_version: int,
    route_layout: Any = None,
    prompt_ids: Any = None,
    **fields: Any,
) -> list[dict]:
    """Generation event dicts, one per choice, from SGLang's OpenAI-compatible JSON (completions or chat).

    ``request``: the body that was sent (its ``routed_experts_start_len``,
    and a token-id ``prompt`` when the response has no prompt ids).
    Routes (``sglext.routed_experts``) and ``metadata.weight_version(s)``
    are per response in SGLang (the first choice's), so they go to choice 0
    only; record calls with ``n = 1``.
    """
    request = request or {}
    choices = _obj(response, "the response").get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValidationError("the response has no choices", rule="missing_field")
    if not all(isinstance(c, Mapping) and _index_ok(c.get("index", 0)) for c in choices):
        raise ValidationError("the response's choices must be objects with an index >= 0", rule="upstream_shape")
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    sglext = _obj(response.get("sglext"), "sglext")
    metadata = _obj(response.get("metadata"), "metadata")
    ext_outputs = sglext.get("output_ids") or []
    if not isinstance(ext_outputs, list):
        raise ValidationError("sglext.output_ids must be a list of token id lists", rule="upstream_shape")
    events = []
    for i, choice in enumerate(choices):
        index = choice.get("index", i)
        output_ids = choice.get("token_ids", choice.get("response_token_ids"))
        if output_ids is None and index < len(ext_outputs):
            output_ids = ext_outputs[index]
        if output_ids is None:
            raise ValidationError("the response has no output token ids: request return_token_ids (or "
                                  "return_output_ids_in_sglext)", rule="missing_token_ids")
        prompt = prompt_ids
        for candidate in (choice.get("prompt_token_ids"), sglext.get("input_ids"), response.get("prompt_token_ids")):
            if prompt is None:
                prompt = candidate
        if prompt is None and isinstance(request.get("prompt"), list) and request["prompt"] \
                and all(isinstance(t, int) for t in request["prompt"]):
            prompt = request["prompt"]
        if prompt is None:
            raise ValidationError("the response has no prompt token ids: request return_token_ids (or "
                                  "return_input_ids_in_sglext)", rule="missing_token_ids")
        output = _ids(output_ids, "output_ids")
        values = _openai_logprobs(choice)
        meta = _obj(choice.get("meta_info"), "choices[i].meta_info")  # return_meta_info puts it here
        routes = sglext.get("routed_experts") if i == 0 else None
        if routes is None:
            routes = meta.get("routed_experts")
        finish = meta.get("finish_reason") or choice.get("finish_reason")
        if isinstance(finish, str) and choice.get("matched_stop") is not None:
            finish = {"type": finish, "matched": choice["matched_stop"]}
        spans = None
        if i == 0:
            spans = _spans(metadata.get("weight_versions", meta.get("weight_versions")),
                           metadata.get("weight_version", meta.get("weight_version")), len(output))
        events.append(_event(
            trajectory_id=trajectory_id, seq=seq + i, model_version=model_version, prompt_ids=prompt,
            output_ids=output, logprobs=None if values is None else _float_logprobs(values, "logprobs"),
            routes=routes, routes_start=routed_experts_start_len_of(request), layout=route_layout,
            finish_reason=finish, spans=spans, fields=fields,
        ))
    return events


def request_params_for_generate(body: Mapping, *, routes: bool) -> dict:
    """A native ``/generate`` body asking for what a record needs.

    ``return_logprob`` (the sampled tokens' logprobs), ``return_prompt_token_ids``
    when the prompt is text, and ``return_routed_experts`` when ``routes``
    (the proxy knows the route layout). What the caller set is kept.
    """
    out = dict(body)
    if out.get("return_logprob") is None:
        out["return_logprob"] = True
    if out.get("input_ids") is None and out.get("return_prompt_token_ids") is None:
        out["return_prompt_token_ids"] = True
    if routes and out.get("return_routed_experts") is None:
        out["return_routed_experts"] = True
    return out


def request_params_for_openai(body: Mapping, *, chat: bool, routes: bool) -> dict:
    """An OpenAI-endpoint body asking SGLang for token ids, sampled logprobs and (``routes``) routes.

    Completions: ``return_token_ids`` and ``logprobs: 0``. Chat:
    ``logprobs: true`` and the ids through ``sglext``
    (``return_input_ids_in_sglext``, ``return_output_ids_in_sglext``),
    which SGLang also sends when streaming (``return_token_ids`` it refuses
    there).
    """
    out = dict(body)
    if chat:
        if not out.get("logprobs"):
            out["logprobs"] = True
        out.setdefault("return_input_ids_in_sglext", True)
        out.setdefault("return_output_ids_in_sglext", True)
    else:
        out["return_token_ids"] = True
        if out.get("logprobs") is None:
            out["logprobs"] = 0
    if routes and out.get("return_routed_experts") is None:
        out["return_routed_experts"] = True
    return out


def _guarded_add(add: Any, chunk: Any) -> None:
    """Run an accumulator's ``_add``; a chunk not in SGLang's shape is a one-line ValidationError."""
    try:
        add(chunk)
    except ValidationError:
        raise
    except (TypeError, AttributeError, LookupError, ValueError) as e:
        raise ValidationError(f"a stream chunk is not in SGLang's shape ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})", rule="upstream_shape") from None


class GenerateStreamAccumulator:
    """Collects a streamed native ``/generate`` into the response :func:`generation_from_generate` reads.

    Feed each ``data:`` object to :meth:`add`. SGLang sends cumulative
    ``output_ids`` and ``meta_info["output_token_logprobs"]`` by default and
    deltas under ``--incremental-streaming-output``; ``completion_tokens`` and
    ``output_token_logprobs_length`` (always totals) tell which, so both are
    taken. Routes, finish reason and version spans come on the final chunk;
    the last value of each ``meta_info`` key is kept.
    """

    def __init__(self) -> None:
        self._ids: list = []
        self._logprobs: list = []
        self._meta: dict = {}
        self._prompt: Any = None
        self._chunks = 0
        self.error: Any = None

    @staticmethod
    def _merge(acc: list, chunk: Any, total: Any) -> list:
        chunk = list(chunk or [])
        if not isinstance(total, int) or isinstance(total, bool):
            return chunk if len(chunk) >= len(acc) else acc + chunk
        if len(chunk) == total:
            return chunk  # cumulative (or the first delta)
        return acc + chunk[: max(total - len(acc), 0)]  # a delta; an abort chunk re-sends the last token

    def add(self, chunk: Mapping) -> None:
        _guarded_add(self._add, chunk)

    def _add(self, chunk: Mapping) -> None:
        if isinstance(chunk, list):  # a batch: not recordable, keep the first for the error
            chunk = chunk[0] if len(chunk) == 1 else {"error": {"message": "a batch /generate is not recorded"}}
        if chunk.get("error") is not None:
            self.error = chunk["error"]
            return
        meta = chunk.get("meta_info")
        if not isinstance(meta, Mapping):
            raise ValidationError("a /generate stream chunk has no meta_info object", rule="missing_field")
        self._chunks += 1
        self._ids = self._merge(self._ids, chunk.get("output_ids"), meta.get("completion_tokens"))
        if meta.get("output_token_logprobs") is not None:
            self._logprobs = self._merge(self._logprobs, meta["output_token_logprobs"],
                                         meta.get("output_token_logprobs_length"))
        if chunk.get("prompt_token_ids") is not None:
            self._prompt = chunk["prompt_token_ids"]
        for key, value in meta.items():
            if value is not None:
                self._meta[key] = value
        if "finish_reason" in meta:
            self._meta["finish_reason"] = meta["finish_reason"]

    def finished(self) -> bool:
        """Whether the stream reached its end: SGLang's final chunk, the one with the finish reason (and the
        routes and version spans), arrived, or SGLang's error event. ``data: [DONE]`` alone is not an end."""
        return self.error is not None or self._meta.get("finish_reason") is not None

    def response(self) -> dict:
        if self.error is not None:
            message = self.error.get("message") if isinstance(self.error, Mapping) else self.error
            raise ValidationError(f"the stream ended with an error: {' '.join(str(message).split())[:500]}",
                                  rule="upstream_error")
        if not self._chunks:
            raise ValidationError("the stream carried no /generate answer", rule="missing_field")
        meta = dict(self._meta)
        if self._logprobs or "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = self._logprobs
        out: dict = {"output_ids": self._ids, "meta_info": meta}
        if self._prompt is not None:
            out["prompt_token_ids"] = self._prompt
        return out


class OpenAIStreamAccumulator(_OpenAIStreamAccumulator):
    """Collects SGLang's streamed OpenAI completions/chat chunks into a non-streaming-shaped response.

    Per choice: ``token_ids`` deltas (completions), logprobs
    (``token_logprobs`` or ``content[j].logprob``), ``finish_reason`` and
    ``matched_stop``; the first chunk's ``prompt_token_ids``; the last
    chunk's response-level ``sglext`` (routes, and a chat's ``input_ids`` /
    ``output_ids``). No ``metadata``: SGLang streams no weight versions.
    SGLang's error event ends the stream (refused, never recorded). The
    accumulation is the shared one (``trajstore.ingest._openai_stream``);
    this says how SGLang's chunks read.
    """

    engine = "SGLang"
    kept = ("finish_reason", "matched_stop")
    shape_rule = "upstream_shape"
    error_events = True

    def __init__(self) -> None:
        super().__init__()
        self._sglext: dict = {}

    def add_chunk(self, chunk: Mapping) -> None:
        if isinstance(chunk.get("sglext"), Mapping):
            self._sglext.update({k: v for k, v in chunk["sglext"].items() if v is not None})

    def logprobs_of(self, c: Mapping) -> tuple[list | None, list | None, bool]:
        lp = c.get("logprobs")
        if not lp:
            return None, None, False
        if "content" in lp:
            return list(map(_LOGPROB, lp.get("content") or [])), None, True
        return list(lp.get("token_logprobs") or []), None, False

    def finish_response(self, out: dict, chat: bool) -> dict:
        if self._sglext:
            out["sglext"] = self._sglext
        return out
