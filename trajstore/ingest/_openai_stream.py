"""The stream accumulator of OpenAI completions and chat: the logic vLLM's and SGLang's streams share.

An engine's adapter module subclasses :class:`OpenAIStreamAccumulator`
(``trajstore.ingest.vllm.OpenAIStreamAccumulator``,
``trajstore.ingest.sglang.OpenAIStreamAccumulator``) and says only what is
its own: how a choice's logprobs read, which choice keys to keep, its
response-level fields, whether it sends an error event mid-stream.
"""

from __future__ import annotations

from typing import Any, Mapping

from trajstore.errors import ValidationError

__all__ = ["OpenAIStreamAccumulator"]


class OpenAIStreamAccumulator:
    """Collects the chunks of a streamed (SSE) OpenAI completions or chat response into one
    non-streaming-shaped response.

    Feed each decoded ``data:`` object to :meth:`add`; :meth:`finished` says
    whether the stream reached its end; :meth:`response` returns the dict the
    engine's ``generations_from_openai`` reads. Per choice (by ``index``):
    ``token_ids`` and logprob deltas appended, ``prompt_token_ids``, and the
    keys of ``kept`` from whichever chunk carries them (the final one). A chunk
    not in the engine's shape is a one-line ValidationError (``shape_rule``).
    """

    #: the engine, as error messages name it
    engine = "the engine"
    #: choice keys kept from whichever chunk carries them
    kept: tuple[str, ...] = ("finish_reason",)
    #: the rule of a chunk not in the engine's shape
    shape_rule = "upstream_response"
    #: whether the engine ends a stream with an error event (``{"error": ...}``) the record must refuse
    error_events = False

    def __init__(self) -> None:
        self._choices: dict[int, dict] = {}
        self.error: Any = None

    def add(self, chunk: Mapping) -> None:
        """Take one ``data:`` object; ValidationError when it is not in a chunk's shape."""
        try:
            self._add(chunk)
        except ValidationError:
            raise
        except (TypeError, AttributeError, LookupError, ValueError) as e:
            raise ValidationError(f"a stream chunk is not in {self.engine}'s shape ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:200]})", rule=self.shape_rule) from None

    def _add(self, chunk: Mapping) -> None:
        if not isinstance(chunk, Mapping):
            raise ValidationError(f"a stream chunk must be an object, got {type(chunk).__name__}", rule=self.shape_rule)
        if self.error_events and (chunk.get("error") is not None or chunk.get("object") == "error"):
            self.error = chunk.get("error", chunk)
            return
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise ValidationError(f"a chunk's choices must be a list, got {type(choices).__name__}", rule=self.shape_rule)
        self.add_chunk(chunk)
        for c in choices:
            if not isinstance(c, Mapping):
                raise ValidationError(f"a chunk's choice must be an object, got {type(c).__name__}", rule=self.shape_rule)
            self._add_choice(c)

    def _add_choice(self, c: Mapping) -> None:
        index = c.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValidationError(f"a chunk's choice index must be an integer >= 0, got {index!r:.40}",
                                  rule=self.shape_rule)
        acc = self._choices.setdefault(index, {"token_ids": [], "logprobs": [], "tokens": [], "has_logprobs": False,
                                               "chat": False, "content": False})
        acc["chat"] = acc["chat"] or "delta" in c
        if c.get("prompt_token_ids") is not None:
            acc["prompt_token_ids"] = self._list(c["prompt_token_ids"], "prompt_token_ids")
        acc["token_ids"].extend(self._list(c.get("token_ids") or [], "token_ids"))
        values, names, content = self.logprobs_of(c)
        acc["content"] = acc["content"] or content
        if values is not None:
            acc["has_logprobs"] = True
            acc["logprobs"].extend(values)
            acc["tokens"].extend(names or [])
        for key in self.kept:
            if c.get(key) is not None:
                acc[key] = c[key]

    def _list(self, value: Any, field: str) -> list:
        if not isinstance(value, list):
            raise ValidationError(f"{field} must be a list, got {type(value).__name__}", rule=self.shape_rule)
        return value

    def finished(self) -> bool:
        """Whether the stream reached its end: at least one choice, each with its finish reason, or
        the engine's error event. ``data: [DONE]`` alone is not an end."""
        return self.error is not None or (bool(self._choices) and all(
            acc.get("finish_reason") is not None for acc in self._choices.values()))

    def response(self) -> dict:
        """The non-streaming-shaped response; ValidationError (``upstream_error``) when the stream
        carried the engine's error event."""
        if self.error is not None:
            message = self.error.get("message") if isinstance(self.error, Mapping) else self.error
            raise ValidationError(f"the stream ended with an error: {' '.join(str(message).split())[:500]}",
                                  rule="upstream_error")
        chat = any(acc["chat"] for acc in self._choices.values())
        out: dict = {"choices": [self.choice(i, acc, chat) for i, acc in sorted(self._choices.items())]}
        return self.finish_response(out, chat)

    def choice(self, index: int, acc: dict, chat: bool) -> dict:
        """One choice of the response from what was accumulated for it."""
        choice: dict = {"index": index, "finish_reason": acc.get("finish_reason")}
        if acc["token_ids"]:
            choice["token_ids"] = acc["token_ids"]
        for key in ("prompt_token_ids", *self.kept):
            if key in acc and key != "finish_reason":
                choice[key] = acc[key]
        if acc["has_logprobs"]:
            choice["logprobs"] = self.logprobs_field(acc)
        return choice

    # What an engine says about its own chunks.

    def logprobs_of(self, c: Mapping) -> tuple[list | None, list | None, bool]:
        """(a choice chunk's logprob values or None, their token names or None, whether they came as
        ``logprobs.content``)."""
        raise NotImplementedError

    def logprobs_field(self, acc: dict) -> dict:
        """The response choice's ``logprobs`` from the accumulated values."""
        if acc["content"]:
            return {"content": [{"logprob": v} for v in acc["logprobs"]]}
        return {"token_logprobs": acc["logprobs"]}

    def add_chunk(self, chunk: Mapping) -> None:
        """Take a chunk's response-level fields (none by default)."""

    def finish_response(self, out: dict, chat: bool) -> dict:
        """Add the response-level fields to ``out`` (none by default)."""
        return out
