"""A payload location (a local path or a filesystem URI) as a pyarrow filesystem.

``s3://`` locations take trajstore's own options in their query (timeouts,
retries: ``S3_DEFAULTS``; docs/deploy.md, "Object storage"); other URIs are
pyarrow's.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from trajstore.errors import StoreUnavailable, first_line
from trajstore.payload._deadline import DEFAULT_DEADLINE_S
from trajstore.payload._errors import payload_errors

__all__ = ["is_uri", "deadline_of", "filesystem_of", "join", "S3_DEFAULTS"]


def is_uri(location: str) -> bool:
    """A filesystem URI (``s3://...``, ``gs://...``), not a local path (``file://`` is local)."""
    scheme = urlparse(location).scheme
    return bool(scheme) and len(scheme) > 1 and scheme != "file"


# S3 options trajstore reads from an ``s3://`` location's query (docs/deploy.md,
# "Object storage"), with its defaults: an unresponsive server fails an append with
# StoreUnavailable in about 20 s, never hangs it (measured on a SIGSTOPped server: one
# attempt of an upload waits the 1 s of "Expect: 100-continue", about 5 s while curl's
# speed window still counts the bytes sent, then ``request_timeout``, which is curl's
# low-speed time: a transfer that moves bytes is never cut, however long it takes).
# ``deadline`` is trajstore's, not pyarrow's: whatever the number of requests and attempts
# in an append, it fails by then (``payload/_deadline.py``).
S3_DEFAULTS = {"connect_timeout": 2.0, "request_timeout": 3.0, "retries": 2, "deadline": DEFAULT_DEADLINE_S}
_S3_FLOAT = ("connect_timeout", "request_timeout", "deadline")
_S3_STR = ("region", "scheme", "endpoint_override", "access_key", "secret_key", "session_token", "role_arn",
           "tls_ca_file_path")
_S3_BOOL = ("anonymous", "force_virtual_addressing", "allow_bucket_creation", "background_writes",
            "allow_delayed_open")
# pyarrow options whose default trajstore changes (a value in the location's query wins):
# ``allow_delayed_open``: an object smaller than the upload part size is written with one
# PutObject on close instead of a multipart upload's three requests (create, part,
# complete), so a write that fails is one request that failed, and costs one timeout
_S3_BOOL_DEFAULTS = {"allow_delayed_open": True}


def _s3_filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """An ``S3FileSystem`` from ``s3://[KEY:SECRET@]bucket/path?option=value&...``: the
    options pyarrow's own URI parser knows, plus the timeouts and ``retries`` it
    refuses there (``S3_DEFAULTS``); an unknown option is refused by name."""
    from urllib.parse import parse_qsl, unquote

    parsed = urlparse(location)
    opts: dict[str, Any] = dict(_S3_BOOL_DEFAULTS)
    numbers = dict(S3_DEFAULTS)
    for key, value in parse_qsl(parsed.query, keep_blank_values=True):
        try:
            if key in _S3_FLOAT:
                numbers[key] = float(value)
            elif key == "retries":
                numbers[key] = int(value)
            elif key in _S3_STR:
                opts[key] = value
            elif key in _S3_BOOL:
                opts[key] = value.lower() in ("1", "true", "yes")
            else:
                raise ValueError(f"unknown option {key!r} (known: {', '.join(sorted((*_S3_FLOAT, 'retries', *_S3_STR, *_S3_BOOL)))})")
        except ValueError as e:
            raise StoreUnavailable(f"payload location {_no_secret(location)!r}: {key}={value!r}: {e}") from None
    if parsed.username:
        opts.setdefault("access_key", unquote(parsed.username))
        opts.setdefault("secret_key", unquote(parsed.password or ""))
    if not numbers["deadline"] > 0:
        raise StoreUnavailable(f"payload location {_no_secret(location)!r}: deadline must be more than 0")
    fs = pafs.S3FileSystem(connect_timeout=numbers["connect_timeout"], request_timeout=numbers["request_timeout"],
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max(1, numbers["retries"])),
                           **opts)
    return fs, f"{parsed.hostname or ''}{parsed.path}".rstrip("/")


def deadline_of(location: str) -> float:
    """The deadline of an append's requests to a remote location: its ``deadline=``
    (``s3://`` only, checked by ``filesystem_of``), else ``DEFAULT_DEADLINE_S``."""
    from urllib.parse import parse_qsl

    parsed = urlparse(location)
    given = dict(parse_qsl(parsed.query)).get("deadline") if parsed.scheme == "s3" else None
    return float(given) if given else DEFAULT_DEADLINE_S


def _no_secret(location: str) -> str:
    p = urlparse(location)
    if p.password is None:
        return location
    return location.replace(f":{p.password}@", ":***@", 1)


def filesystem_of(location: str) -> tuple[pafs.FileSystem, str, bool]:
    """``(filesystem, root path in it, is local)`` of a payload location; creates nothing."""
    if is_uri(location):
        try:
            with payload_errors("payload location", _no_secret(location)):
                if urlparse(location).scheme == "s3":
                    fs, root = _s3_filesystem(location)
                else:
                    fs, root = pafs.FileSystem.from_uri(location)
        except ValueError as e:  # a URI pyarrow cannot parse
            raise StoreUnavailable(f"payload location {_no_secret(location)!r}: {first_line(e)}") from None
        return fs, root, False
    parsed = urlparse(location)
    path = parsed.path if parsed.scheme == "file" else location
    return pafs.LocalFileSystem(), os.path.abspath(path), True


def join(root: str, name: str) -> str:
    """The path of file ``name`` under ``root``, in any pyarrow filesystem."""
    return f"{root.rstrip('/')}/{name}"
