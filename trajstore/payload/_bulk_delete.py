"""Deleting many segment files at once: the payload GC's deletes.

A local disk: one ``unlink`` per file. S3: one ``DeleteObjects`` request per
up to 1,000 keys through boto3 (the ``s3`` extra): pyarrow's ``S3FileSystem``
deletes one object per request (``delete_file``), and deletes many keys at once
only as a whole directory. Without boto3 the deletes fall back to pyarrow's,
one request per object, in parallel. The S3 client is built from the same
``s3://`` location and options as pyarrow's (``_filesystem.py``): endpoint,
scheme, region, credentials, timeouts, retries."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence
from urllib.parse import parse_qsl, unquote, urlparse

from trajstore.errors import StoreUnavailable, first_line
from trajstore.payload._errors import payload_errors
from trajstore.payload._filesystem import S3_DEFAULTS

log = logging.getLogger(__name__)

__all__ = ["MAX_KEYS", "s3_batch_deleter"]

MAX_KEYS = 1000  # S3's limit of keys per DeleteObjects request


def s3_batch_deleter(location: str, root: str) -> Callable[[Sequence[str]], list[str]] | None:
    """A function deleting the objects ``root/name`` of ``names`` with one
    ``DeleteObjects`` per 1,000 (returns the names deleted or already gone),
    or None when boto3 is not installed (the caller deletes one by one)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        log.info("boto3 not installed (the s3 extra): payload GC deletes one object per request")
        return None
    parsed = urlparse(location)
    q = dict(parse_qsl(parsed.query, keep_blank_values=True))
    numbers = {**S3_DEFAULTS, **{k: float(q[k]) for k in ("connect_timeout", "request_timeout") if k in q}}
    retries = int(q.get("retries", S3_DEFAULTS["retries"]))
    kw: dict[str, Any] = {}
    if q.get("endpoint_override"):
        endpoint = q["endpoint_override"]
        if "://" not in endpoint:
            endpoint = f"{q.get('scheme', 'https')}://{endpoint}"
        kw["endpoint_url"] = endpoint
    region = q.get("region") or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
    if parsed.username:
        kw["aws_access_key_id"] = unquote(parsed.username)
        kw["aws_secret_access_key"] = unquote(parsed.password or "")
    if q.get("access_key"):
        kw["aws_access_key_id"] = q["access_key"]
        kw["aws_secret_access_key"] = q.get("secret_key", "")
    if q.get("session_token"):
        kw["aws_session_token"] = q["session_token"]
    if q.get("tls_ca_file_path"):
        kw["verify"] = q["tls_ca_file_path"]
    addressing = "virtual" if q.get("force_virtual_addressing", "").lower() in ("1", "true", "yes") else "path"
    config = Config(connect_timeout=numbers["connect_timeout"], read_timeout=max(numbers["request_timeout"], 10.0),
                    retries={"max_attempts": max(1, retries), "mode": "standard"},
                    s3={"addressing_style": addressing})
    try:
        with payload_errors("cannot make an S3 client for", str(parsed.hostname)):
            client = boto3.session.Session().client("s3", region_name=region, config=config, **kw)
    except ValueError as e:  # an endpoint URL botocore refuses
        raise StoreUnavailable(f"cannot make an S3 client for {parsed.hostname!r}: {first_line(e)}") from None
    bucket, _, prefix = root.partition("/")

    def delete(names: Sequence[str]) -> list[str]:
        done: list[str] = []
        for i in range(0, len(names), MAX_KEYS):
            part = names[i:i + MAX_KEYS]
            keys = {f"{prefix}/{n}" if prefix else n: n for n in part}
            # (botocore wraps urllib3's errors in its own: all mean "not deleted now")
            with payload_errors(f"cannot delete {len(part)} payload object(s) in", f"s3://{bucket}/{prefix}"):
                reply = client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys],
                                                                     "Quiet": True})
            failed = {err.get("Key") for err in reply.get("Errors", ()) if err.get("Code") != "NoSuchKey"}
            for err in reply.get("Errors", ())[:3]:
                if err.get("Code") != "NoSuchKey":
                    log.warning("payload object %r not deleted: %s %s", err.get("Key"), err.get("Code"),
                                err.get("Message"))
            done.extend(n for k, n in keys.items() if k not in failed)
        return done

    return delete
