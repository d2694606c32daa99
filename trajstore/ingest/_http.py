"""What the two HTTP edges (the ingest service, the recording proxy) answer alike.

One error body, ``{"error": {"index", "trajectory_id", "rule", "message"}}``
(``index`` and ``trajectory_id`` are null when no event is at fault), one
status per library error, one bearer-token check, one rule for starting without a token, the
command-line flags both servers take. FastAPI is imported only
when a response is built, so importing this module needs no extra.
"""

from __future__ import annotations

import hmac
import os
import argparse
from typing import Any

from trajstore.errors import ConflictError, StoreUnavailable, ValidationError

__all__ = ["HTTPError", "UNAUTHORIZED", "add_server_arguments", "bearer_ok", "error_body", "error_response", "server_token"]

UNAUTHORIZED = "missing or wrong bearer token"


def error_body(message: str, *, rule: str, index: int | None = None, trajectory_id: str | None = None) -> dict:
    """The JSON body of an error answer."""
    return {"error": {"index": index, "trajectory_id": trajectory_id, "rule": rule, "message": message}}


class HTTPError(Exception):
    """An error answer: ``status`` plus its ``body`` (``error_body``)."""

    def __init__(self, status: int, message: str, *, rule: str, index: int | None = None,
                 trajectory_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.rule = rule
        self.body = error_body(message, rule=rule, index=index, trajectory_id=trajectory_id)

    @classmethod
    def from_error(cls, e: BaseException, *, message: str | None = None) -> "HTTPError":
        """409 for a conflict, 422 for another refusal, 503 when the store is
        unreachable (retry), 500 for anything else. ``message`` replaces the
        error's own reason."""
        if isinstance(e, ValidationError):
            status = 409 if isinstance(e, ConflictError) else 422
            return cls(status, e.reason if message is None else message, rule=e.rule, index=e.index,
                       trajectory_id=e.trajectory_id)
        if isinstance(e, StoreUnavailable):
            return cls(503, str(e) if message is None else message, rule="store_unavailable")
        return cls(500, f"{type(e).__name__}: {e}" if message is None else message, rule="internal")

    def response(self) -> Any:
        """The FastAPI response (401s name the scheme in ``WWW-Authenticate``)."""
        from fastapi.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def error_response(status: int, message: str, *, rule: str) -> Any:
    """The FastAPI response of an error no event is at fault for."""
    return HTTPError(status, message, rule=rule).response()


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (always true without a token)."""
    if token is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def server_token(token: str | None, *, insecure_no_auth: bool) -> str | None:
    """The token a server requires: ``token``, else ``$TRAJSTORE_TOKEN``; ValueError when there is
    none, unless the operator chose to run open (``insecure_no_auth``: then None)."""
    token = token or os.environ.get("TRAJSTORE_TOKEN") or None
    if token is None and not insecure_no_auth:
        raise ValueError("no token: pass --token or set $TRAJSTORE_TOKEN (or --insecure-no-auth to run open)")
    return token


def add_server_arguments(parser: argparse.ArgumentParser, *, port: int, token_help: str, open_help: str) -> None:
    """``--host``, ``--port``, ``--token``, ``--insecure-no-auth``, ``--log-level``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"port (default {port})")
    parser.add_argument("--token", default=None, help=f"{token_help} (default $TRAJSTORE_TOKEN)")
    parser.add_argument("--insecure-no-auth", action="store_true", help=open_help)
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
