"""The one bearer-token rule every trajstore server applies (the HTTP servers through
``trajstore.ingest._http.BearerAuth``, the replay server's Flight middleware).

``bearer_token`` reads the token out of an ``Authorization`` value (scheme
``Bearer``, any case; the token with its surrounding blanks stripped);
``same_token`` compares a given token with an accepted one in constant time,
so the answer's timing does not tell how much of a guess was right.
"""

from __future__ import annotations

import hmac

__all__ = ["bearer_token", "same_token"]


def bearer_token(value: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value; None for no value, another scheme or no token."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = (value or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def same_token(given: str | None, token: str) -> bool:
    """Whether ``given`` is ``token``, compared in constant time (None is never it)."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())
