"""What every engine's proxy does alike with a call: the headers forwarded, the refusal of a call
the store did not take (``_NotRecorded``), and ``_UpstreamForwarder``, the base of each engine's
forwarder."""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
import json
import logging
from typing import Any, AsyncIterator, Callable, Mapping

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._http import HTTPError, error_response
from trajstore.ingest.proxy._metrics import _ProxyMetrics
from trajstore.ingest.proxy._record import Recorder, Tag, _int_or_none
from trajstore.ingest.proxy._sse import _passthrough, _sse_comments, _sse_event, _SSEData

log = logging.getLogger("trajstore.ingest.proxy")

# How long an idle upstream connection is kept for the next call (seconds).
KEEPALIVE_EXPIRY_S = 2.0

_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding"}
UNNAMED = "no X-Trajstore-Trajectory header and no trajstore.trajectory_id body field"
_MAX_NOTED_CLIENTS = 4096


def _forward_headers(headers: Any, *, authenticated: bool, upstream_api_key: str | None) -> dict:
    drop = _HOP_BY_HOP | ({"authorization"} if authenticated or upstream_api_key else set())
    out = {k: v for k, v in headers.items() if k.lower() not in drop and not k.lower().startswith("x-trajstore-")}
    out["Accept-Encoding"] = "identity"  # streamed bytes are parsed as SSE on the way through
    if upstream_api_key:
        out["Authorization"] = f"Bearer {upstream_api_key}"
    return out


def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, (TrajstoreError, ValueError)) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:500]


class _NotRecorded(Exception):
    """A call (or a label change) the engine answered but the store did not take: the harness's error.

    Its answer is an error status (the store's refusal: 409, 422 or 503, as
    the ingest service answers; 502 when the engine's answer cannot be read)
    with the reason in the OpenAI error shape, which OpenAI clients raise,
    plus trajstore's ``rule``, ``index`` and ``trajectory_id``.
    """

    def __init__(self, status: int, reason: str, *, rule: str, trajectory_id: str | None = None,
                 index: int | None = None, what: str = "call not recorded") -> None:
        super().__init__(reason)
        self.status, self.reason, self.rule, self.what = status, reason, rule, what
        self.trajectory_id, self.index = trajectory_id, index

    @classmethod
    def of(cls, e: BaseException, trajectory_id: str | None, **kwargs: Any) -> "_NotRecorded":
        """The refusal of the store's error ``e`` (409, 422, 503: the ingest service's statuses);
        502 for anything else (the engine's answer cannot be read)."""
        if isinstance(e, TrajstoreError):
            error = HTTPError.from_error(e, message=_one_line(e))
            body = error.body["error"]
            return cls(error.status, _one_line(e), rule=error.rule, trajectory_id=body["trajectory_id"] or trajectory_id,
                       index=body["index"], **kwargs)
        return cls.unreadable(e, trajectory_id, **kwargs)

    @classmethod
    def unreadable(cls, e: BaseException, trajectory_id: str | None, **kwargs: Any) -> "_NotRecorded":
        """The refusal of an engine's answer the adapter cannot record (502, a bad gateway)."""
        reason = _one_line(e) if isinstance(e, (TrajstoreError, ValueError)) else \
            f"cannot read the upstream's answer: {_one_line(e)}"
        return cls(502, reason, rule=getattr(e, "rule", None) or "upstream_response", trajectory_id=trajectory_id,
                   **kwargs)

    @property
    def message(self) -> str:
        return f"trajstore proxy: {self.what}: {self.reason}"

    def error(self) -> dict:
        return {"error": {"message": self.message, "type": "TrajstoreNotRecorded", "param": None,
                          "code": self.status, "rule": self.rule, "index": self.index,
                          "trajectory_id": self.trajectory_id}}

    def response(self) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.error(), status_code=self.status, headers={"X-Trajstore-Error": self.reason})


class _Unreadable(Exception):
    """The adapter could not make events of the engine's answer (``error`` says why)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _BadCall(Exception):
    def __init__(self, status: int, message: str, rule: str) -> None:
        super().__init__(message)
        self.status, self.rule = status, rule


def _token_ids(value: Any) -> bool:
    """Is ``value`` a non-empty list of token ids (ints, not bools)? Only then can a prompt continue a recording."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _UpstreamForwarder:
    """What every engine's proxy does alike: the upstream client and the headers forwarded, the 502 of
    an unreachable upstream, recording a call's answer (plain or streamed) and answering the harness,
    relaying the engine's control calls (mapping a label change's label), ``POST /trajstore/finish``.
    An engine's forwarder (``_vllm.VLLMForwarder``, ``_sglang.SGLangForwarder``) says which paths it
    records (``recorded``), how it reads and amends a call (``parse``), which adapters turn the answer
    into events (``events``) and which accumulator collects a stream (``accumulator``).

    ``pass_through``: a call the store cannot take (a finished trajectory
    reused, an answer the adapter cannot read) still gets the engine's
    answer, with ``X-Trajstore-Error``; by default the harness gets an
    error instead (:class:`_NotRecorded`). Either way it is counted.
    """

    #: the recorded POST paths -> the kind of call (``parse``, ``events`` and ``accumulator`` tell kinds apart)
    recorded: Mapping[str, str] = {}
    #: label-setting control endpoints -> the body field holding the new label
    label_fields: Mapping[str, str] = {}
    #: relayed paths whose call is idempotent (pause, resume, a label set to a value, a read): sent once
    #: more when the engine closes the connection without answering (a kept-alive connection the engine
    #: closed as the call went out); a weight transfer is never sent twice
    resend_safe: frozenset[str] = frozenset()

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None,
                 skip_recorded_routes: bool = True, pass_through: bool = False, metrics: Any = None) -> None:
        import httpx

        self.recorder, self.upstream = recorder, upstream
        self.model_version, self.num_experts = model_version, num_experts
        self.authenticated, self.upstream_api_key = authenticated, upstream_api_key
        self.skip_recorded_routes, self.pass_through = skip_recorded_routes, pass_through
        if metrics is None:
            from prometheus_client import CollectorRegistry

            metrics = _ProxyMetrics(CollectorRegistry())
        self.metrics = metrics
        # Idle connections are dropped after 2 s, before the engine's own keep-alive timeout (uvicorn's,
        # under vLLM and SGLang, is 5 s) can close one as a call goes out on it.
        self.client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._noted_clients: set = set()

    def headers(self, request: Any) -> dict:
        return _forward_headers(request.headers, authenticated=self.authenticated, upstream_api_key=self.upstream_api_key)

    def _unreachable(self, e: Exception) -> Any:
        return error_response(502, f"upstream {self.upstream} failed: {type(e).__name__}: {' '.join(str(e).split())}"[:500],
                              rule="upstream_unreachable")

    # What an engine's forwarder says about its calls.

    async def parse(self, request: Any, kind: str, body: dict) -> tuple[dict, Tag | None, Any]:
        """(the body to forward, the call's tag or None when unnamed, what ``events`` needs besides);
        raises _BadCall or ValidationError (a 400)."""
        raise NotImplementedError

    def events(self, kind: str, body: dict, tag: Tag, ctx: Any) -> Callable[[Any], Callable[[int], list[dict]]]:
        """response -> (seq -> the call's generation events)."""
        raise NotImplementedError

    def accumulator(self, kind: str) -> Any:
        """A new stream accumulator for a streamed call of ``kind`` (``add``, ``finished``, ``response``)."""
        raise NotImplementedError

    async def forward(self, request: Any, path: str) -> Any:
        """Forward a recorded path's call and record its answer (plain or streamed)."""
        import httpx
        from fastapi.responses import Response, StreamingResponse

        kind = self.recorded[path]
        try:
            body, tag, ctx = await self._parse(request, kind)
            headers = self.headers(request)
            if body.get("stream"):
                resp = await self.client.send(self.client.build_request("POST", path, json=body, headers=headers),
                                              stream=True)
                media_type = resp.headers.get("content-type")
                sse = "text/event-stream" in (media_type or "")
                if tag is None or resp.status_code != 200:
                    extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
                    return StreamingResponse(_passthrough(resp, sse), status_code=resp.status_code,
                                             media_type=media_type, headers=extra)
                recorded = self.recorded_stream(resp, tag, self.accumulator(kind), self.events(kind, body, tag, ctx), sse)
                return StreamingResponse(recorded, media_type=media_type)
            resp = await self.client.post(path, json=body, headers=headers)
            content = resp.content
        except _BadCall as e:
            return error_response(e.status, str(e), rule=e.rule)
        except httpx.HTTPError as e:  # refused, reset, timed out, cut mid-body, undecodable
            return self._unreachable(e)
        if tag is not None and resp.status_code == 200:
            return await self.answer(tag, resp, content, self.events(kind, body, tag, ctx))
        extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
        return Response(content, status_code=resp.status_code, headers=extra, media_type=resp.headers.get("content-type"))

    async def _parse(self, request: Any, kind: str) -> tuple[dict, Tag | None, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise _BadCall(400, f"body is not JSON ({e})", "malformed_json") from None
        if not isinstance(body, dict):
            raise _BadCall(400, "body must be a JSON object", "malformed_json")
        try:
            return await self.parse(request, kind, body)
        except ValidationError as e:
            raise _BadCall(400, e.reason, e.rule) from None

    async def ask_only_new_rows(self, tag: Tag, params: dict, field: str, prompt: Any,
                                check: Callable[[], Any]) -> None:
        """Only new route rows: set ``params[field]`` (the engine's prompt offset of the routes it returns)
        to the route rows ``tag``'s trajectory has recorded when ``prompt`` is token ids that continue
        them; the sample is the same as with every row sent. A caller's own value is checked
        (``check()``) and kept. An engine's ``parse`` calls this only when the prompt is known before
        the call (a chat prompt is rendered upstream: the proxy cannot tell whether it continues)."""
        if not self.skip_recorded_routes:
            return
        if params.get(field) is not None:
            check()  # the caller's choice, checked, kept
            return
        if not _token_ids(prompt):
            return
        try:
            start = await self.recorder.route_start(tag.trajectory_id, prompt)
        except TrajstoreError as e:  # the call still goes through, with every row
            log.warning("could not read %s's recorded routes: %s", tag.trajectory_id, e)
            return
        if start:
            params[field] = start

    def note_unrecorded(self, request: Any, reason: str) -> dict:
        """Log once per client (address, user agent) that its calls pass unrecorded, and why."""
        self.metrics.unnamed()
        client = (request.client.host if request.client else "?", request.headers.get("user-agent", ""))
        if client not in self._noted_clients and len(self._noted_clients) < _MAX_NOTED_CLIENTS:
            self._noted_clients.add(client)
            log.warning("calls from %s (%s) pass through unrecorded: %s", client[0], client[1] or "no user agent", reason)
        return {"X-Trajstore-Unrecorded": reason}

    def upstream_error(self, status: int) -> dict:
        self.metrics.call("upstream_error")
        return {"X-Trajstore-Unrecorded": f"the upstream answered {status}"}

    async def record(self, tag: Tag, data: Any, make: Callable[[Any], Callable[[int], list[dict]]]) -> int:
        """Record the call whose answer is ``data`` (bytes or decoded JSON); its seq. Raises _NotRecorded.

        Whatever the upstream sent, the record is whole (one atomic append)
        or absent: an answer the adapter cannot read is a refusal, never an
        exception that would break the harness's response.
        """
        def events(seq: int) -> list[dict]:
            try:
                return make(data)(seq)
            except (TrajstoreError, ValueError) as e:
                raise _Unreadable(e) from None
            except Exception as e:  # an answer shape the adapter does not expect: say so, keep serving
                log.warning("not recorded: cannot read the upstream's answer", exc_info=True)
                raise _Unreadable(e) from None

        try:
            if isinstance(data, (bytes, bytearray, str)):
                try:
                    data = json.loads(data)
                except ValueError as e:
                    raise _Unreadable(e) from None
            seq = await self.recorder.record(tag, events)
        except _Unreadable as e:  # the engine's answer is not one the adapter can record: a bad gateway
            refusal = _NotRecorded.unreadable(e.error, tag.trajectory_id)
        except TrajstoreError as e:  # the store's refusal, with the status the ingest service answers
            refusal = _NotRecorded.of(e, tag.trajectory_id)
        else:
            self.metrics.call("recorded")
            return seq
        self._refused(tag, refusal)
        raise refusal

    def _refused(self, tag: Tag, refusal: _NotRecorded) -> None:
        self.metrics.call("passed_through" if self.pass_through else "refused", refusal.rule)
        log.warning("%s: call not recorded%s: %s", tag.trajectory_id,
                    " (passed through)" if self.pass_through else "", refusal.reason)

    async def answer(self, tag: Tag, resp: Any, content: bytes,
                     make: Callable[[Any], Callable[[int], list[dict]]]) -> Any:
        """The harness's answer to a named call the upstream answered 200: the upstream's bytes with
        ``X-Trajstore-Seq`` once recorded, else the refusal (``pass_through``: the bytes, with
        ``X-Trajstore-Error``)."""
        from fastapi.responses import Response

        try:
            headers = {"X-Trajstore-Seq": str(await self.record(tag, content, make))}
        except _NotRecorded as e:
            if not self.pass_through:
                return e.response()
            headers = {"X-Trajstore-Error": e.reason}
        return Response(content, status_code=resp.status_code, headers=headers, media_type=resp.headers.get("content-type"))

    async def recorded_stream(self, resp: Any, tag: Tag, acc: Any, make: Callable[[Any], Callable[[int], list[dict]]],
                              sse_media: bool) -> AsyncIterator[bytes]:
        """The upstream's bytes as they come; the record once the stream has ended whole.

        ``acc``: the engine's stream accumulator (``add(chunk)``,
        ``finished()``, ``response()``). A stream is whole when it ended
        (every choice has its finish reason; ``[DONE]`` alone is not an end)
        and nothing in it was unreadable. Then the record is appended before
        the stream's end (its ``data: [DONE]``, held back until then) reaches
        the harness, which can rely on it; the comment ``: X-Trajstore-Seq:
        <seq>`` follows. A stream the upstream cut, or one that ended before
        its end, records nothing and gets an SSE ``data: {"error": ...}``
        event (vLLM's and SGLang's own shape for an error mid-stream, which
        an OpenAI client raises) before its ``[DONE]``. A whole stream the
        store refuses or that cannot be read gets such an event too, or,
        ``pass_through``, the comment ``: X-Trajstore-Error: ...`` after the
        stream as it came. SSE clients skip comments.
        """
        import httpx

        sse = _SSEData(hold_done=not self.pass_through)
        unreadable: str | None = None
        cut: str | None = None

        def take(objs: list) -> None:
            nonlocal unreadable
            for obj in objs:
                if unreadable is None:
                    try:  # a chunk the proxy cannot read must not cut the harness's stream
                        acc.add(obj)
                    except (ValueError, TypeError, AttributeError, LookupError) as e:
                        unreadable = f"a chunk cannot be read: {_one_line(e)}"

        try:
            async for chunk in resp.aiter_raw():
                objs, out = sse.take(chunk)
                take(objs)
                if out:
                    yield out
        except httpx.HTTPError as e:
            cut = f"the upstream stream broke off ({type(e).__name__}: {' '.join(str(e).split())})"
        finally:
            await resp.aclose()
        objs, before, after = sse.end()
        if before:
            yield before
        if cut is None:
            take(objs)  # a last data line without its newline still counts
            unreadable = unreadable or sse.bad
            # an unreadable stream that ended ([DONE]) is refused as unreadable, one that did not is cut
            if not acc.finished() and (unreadable is None or not sse.done):
                cut = "the upstream stream ended before its end" + (
                    " (no finish reason)" if sse.done else " (no finish reason, no [DONE])")
        if cut is not None:
            reason = f"{cut}: call not recorded"
            log.warning("%s: %s", tag.trajectory_id, reason)
            self.metrics.call("stream_cut", "stream_cut")
            if sse_media:
                yield _sse_event({"error": {"message": f"trajstore proxy: {reason}", "type": "UpstreamStreamCut",
                                            "param": None, "code": 502}})
            if after:
                yield after
            return
        refusal: _NotRecorded | None = None
        if unreadable is not None:
            refusal = _NotRecorded(502, unreadable, rule="upstream_response", trajectory_id=tag.trajectory_id)
        else:
            try:
                response = acc.response()
            except (TrajstoreError, ValueError) as e:  # e.g. the stream carried the engine's error event
                refusal = _NotRecorded.unreadable(e, tag.trajectory_id)
        if refusal is not None:
            self._refused(tag, refusal)
        else:
            try:
                headers = {"X-Trajstore-Seq": str(await self.record(tag, response, make))}
            except _NotRecorded as e:
                refusal = e
        if refusal is not None:
            if not self.pass_through:
                if sse_media:
                    yield _sse_event(refusal.error())
                if after:
                    yield after
                return
            headers = {"X-Trajstore-Error": f"not recorded: {refusal.reason}"}
        if after:
            yield after
        if sse_media:
            yield _sse_comments(headers)

    async def relay(self, request: Any, path: str) -> Any:
        """Forward a call as it is (method, query, body) and answer the upstream's bytes; nothing recorded.

        A label change (a path of ``label_fields``) that carries
        ``X-Trajstore-Model-Version`` also maps its label in the store (a
        ``version_label`` event) once the engine took it; when the store
        refuses the mapping the harness gets the refusal (the engine kept
        the label), or, ``pass_through``, the engine's answer with
        ``X-Trajstore-Error``.
        """
        import httpx
        from fastapi.responses import Response

        try:
            body = await request.body()
            query = request.url.query
            url = httpx.URL(path, query=query.encode("latin-1")) if query else path
            headers = self.headers(request)
            try:
                resp = await self.client.request(request.method, url, content=body, headers=headers)
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                if path not in self.resend_safe:
                    raise
                log.info("the engine closed %s %s without answering (%s); sent once more", request.method, path,
                         _one_line(e))
                resp = await self.client.request(request.method, url, content=body, headers=headers)
            content = resp.content
        except httpx.HTTPError as e:
            return self._unreachable(e)
        extra = {}
        if path in self.label_fields and resp.status_code == 200 and "x-trajstore-model-version" in request.headers:
            try:
                extra = await self._map_label(request.headers["x-trajstore-model-version"], body, self.label_fields[path])
            except _NotRecorded as e:
                if not self.pass_through:
                    return e.response()
                extra = {"X-Trajstore-Error": e.reason}
        return Response(content, status_code=resp.status_code, headers=extra, media_type=resp.headers.get("content-type"))

    async def _map_label(self, version: str, body: bytes, field: str) -> dict:
        from starlette.concurrency import run_in_threadpool

        label: Any = None
        try:
            label = json.loads(body).get(field)
            if not isinstance(label, str) or not label:
                raise ValidationError(f"the body has no {field} label to map", rule="version_label")
            event = {"type": "version_label", "label": label, "model_version": _int_or_none(version, "model_version")}
            await run_in_threadpool(self.recorder.store.append, [event])
        except (TrajstoreError, ValueError, AttributeError) as e:
            reason = f"label {label!r:.80} not mapped to model_version {version!r:.20}: {_one_line(e)}"
            status = HTTPError.from_error(e).status if isinstance(e, TrajstoreError) else 422
            refusal = _NotRecorded(status, reason, rule=getattr(e, "rule", None) or "version_label",
                                   what="the engine took the label change, the store did not map it")
            self.metrics.label("passed_through" if self.pass_through else "refused", refusal.rule)
            log.warning("%s", reason)
            raise refusal from None
        self.metrics.label("mapped")
        return {"X-Trajstore-Label": f"{label}={version}"}

    async def finish(self, request: Any) -> Any:
        try:
            body = await request.json()
            tid, status = body["trajectory_id"], body.get("status", "completed")
            await self.recorder.finish(tid, status, body.get("reward"))
        except ValidationError as e:
            return HTTPError.from_error(e, message=str(e)).response()
        except (ValueError, KeyError, TypeError) as e:
            return error_response(400, f'body must be {{"trajectory_id", "status", "reward"?}} ({e})', rule="malformed_body")
        return {"trajectory_id": tid, "status": status}
