"""One table maps library errors to HTTP statuses (``trajstore.ingest._http.ERROR_STATUS``):
the server's answer for an error, read back by the client, is that error again."""

from __future__ import annotations

import json

import pytest

from trajstore.errors import (CommitUnknownError, ConflictError, ContentionError, StoreUnavailable, TrajstoreError,
                              ValidationError)
from trajstore.ingest._http import ERROR_STATUS, HTTPError, error_class, error_status
from trajstore.ingest.sinks import error_from_response

ERRORS = [
    ValidationError("seq must start at 0", index=2, trajectory_id="t", rule="seq_order"),
    ConflictError("event e1 differs from the stored one", index=0, trajectory_id="t", rule="event_id_conflict"),
    StoreUnavailable("database restarting"),
    ContentionError("busy"),
    CommitUnknownError("connection lost during COMMIT"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_answered_and_read_back_is_the_same_kind_of_error(error):
    answer = HTTPError.from_error(error)
    back = error_from_response(answer.status, json.dumps(answer.body).encode())
    kind = next(cls for cls, _ in ERROR_STATUS if isinstance(error, cls))
    assert type(back) is kind
    if isinstance(error, ValidationError):
        assert (back.index, back.trajectory_id, back.rule) == (error.index, error.trajectory_id, error.rule)


def test_the_statuses():
    assert [error_status(e) for e in ERRORS] == [422, 409, 503, 503, 503]
    assert error_status(RuntimeError("bug")) == HTTPError.from_error(RuntimeError("bug")).status == 500
    assert {s: error_class(s) for s in (400, 409, 413, 422, 429, 502, 503, 504)} == {
        400: ValidationError, 409: ConflictError, 413: ValidationError, 422: ValidationError,
        429: StoreUnavailable, 502: StoreUnavailable, 503: StoreUnavailable, 504: StoreUnavailable}
    for status in (401, 403, 404, 500):
        assert error_class(status) is None
        back = error_from_response(status, b'{"error": {"message": "no"}}')
        assert type(back) is TrajstoreError and back.http_status == status
