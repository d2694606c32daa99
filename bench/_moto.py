"""A loopback ``moto_server`` (S3) for the benchmarks, and its request log read by kind.

Import it from a bench script run as ``python bench/X.py`` (its folder is on
``sys.path``): ``from _moto import MotoS3, s3_requests``.

The server logs one line per request (werkzeug's access log: method, path and
query, status); ``s3_requests`` reads the lines written after an offset and
names each request by its S3 operation, so every client of the server
(services, workers, the bench's own listings) is counted in one place.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

__all__ = ["MotoS3", "key_kind", "s3_operation", "s3_requests"]

_LINE = re.compile(r'"([A-Z]+) (/\S*) HTTP')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class MotoS3:
    """``moto_server`` (this interpreter's, the ``dev`` extra) on a free loopback
    port, logging to ``log_path``; ``bucket`` created. Sets the dummy AWS
    credentials in ``os.environ`` (children started afterwards inherit them)."""

    def __init__(self, workdir: str | Path, bucket: str = "bench") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.bucket = bucket
        self.log_path = Path(workdir) / "moto.log"
        self._log = open(self.log_path, "w")
        exe = str(Path(sys.executable).parent / "moto_server")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            self.close()
            raise RuntimeError("moto_server did not start")
        self.client().create_bucket(Bucket=bucket)

    def uri(self, prefix: str) -> str:
        """The payload URI of ``prefix`` in the bucket (pyarrow's S3 filesystem)."""
        return f"s3://{self.bucket}/{prefix}?endpoint_override={self.endpoint}&scheme=http"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://{self.endpoint}", region_name="us-east-1")

    def log_offset(self) -> int:
        self._log.flush()
        return self.log_path.stat().st_size

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def s3_operation(method: str, path: str) -> str:
    """The S3 operation of one request line (path with its query string)."""
    bucket_only = path.split("?", 1)[0].strip("/").count("/") == 0
    if method == "PUT":
        return "UploadPart" if "partNumber=" in path else "CreateBucket" if bucket_only else "PutObject"
    if method == "POST":
        if "?delete" in path:
            return "DeleteObjects"
        if "?uploads" in path:
            return "CreateMultipartUpload"
        if "uploadId=" in path:
            return "CompleteMultipartUpload"
        return "POST"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId=" in path else "DeleteBucket" if bucket_only else "DeleteObject"
    if method == "HEAD":
        return "HeadBucket" if bucket_only else "HeadObject"
    if method == "GET":
        return "ListObjects" if bucket_only or "list-type" in path else "GetObject"
    return method


def s3_requests(log_path: str | Path, start: int = 0) -> tuple[Counter, Counter]:
    """(requests by operation, objects made by kind) in the log from byte ``start``.
    An object is made by a ``PutObject`` or a ``CompleteMultipartUpload``; its
    kind is ``key_kind`` of its key, with ``+multipart`` for the latter."""
    with open(log_path, errors="replace") as f:
        f.seek(start)
        lines = _LINE.findall(_ANSI.sub("", f.read()))
    ops: Counter = Counter()
    made: Counter = Counter()
    for method, path in lines:
        op = s3_operation(method, path)
        ops[op] += 1
        if op in ("PutObject", "CompleteMultipartUpload"):
            kind = key_kind(path.split("?", 1)[0])
            made[kind if op == "PutObject" else f"{kind}+multipart"] += 1
    return ops, made


def key_kind(key: str) -> str:
    """``events`` (a log segment), ``samples`` (a sample segment) or ``other`` (a
    marker, a probe, a directory placeholder): the file name up to its first ``-``."""
    name = key.rsplit("/", 1)[-1]
    kind = name.split("-", 1)[0]
    return kind if kind in ("events", "samples") else "other"
