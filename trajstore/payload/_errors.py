"""The one error boundary of the payload seam: what the filesystem, pyarrow or S3 raised, as a trajstore error.

Every payload operation that touches a disk or an object store runs inside
``payload_errors(what, where)``, the context manager that maps what came up
from below to the error tree (``trajstore.errors``), in one line naming what
was being done and where (``"<what> <where!r>: <reason>"``):

* ``OSError`` (a local disk's, or pyarrow's ``ArrowIOError``, or an S3 error:
  pyarrow's ``S3FileSystem`` raises those as ``OSError``) -> ``StoreUnavailable``
  (the storage cannot be used now; retry), its reason tagged for the cases an
  operator acts on: ``ENOSPC``/``EDQUOT`` "disk full", ``EACCES``/``EPERM``
  "permission denied", ``EROFS`` "read-only filesystem";
* a file that is not there (``ENOENT``): with ``missing="<noun>"``, where a
  file the index names is read, ``PayloadMissingError("<noun> <where!r> is
  missing")``; with ``absent_ok=True`` nothing at all (a delete of a file
  already gone: the block is left, the caller goes on); else as any ``OSError``;
* bytes pyarrow cannot decode (``ArrowInvalid`` and pyarrow's other non-I/O
  errors; with ``corrupt=`` also the ``KeyError``/``TypeError``/``ValueError``
  of a segment's missing or malformed metadata) -> with ``corrupt="<noun>"``,
  ``CorruptStoreError("<noun> <where!r> is unreadable: <reason>")``; else
  ``StoreUnavailable`` as above. pyarrow reports a malformed IPC stream as an
  ``OSError`` too ("Invalid IPC stream"): where the body only decodes bytes
  already in memory (``in_memory=True``: a memory map, an object read whole),
  no I/O can fail, and an ``OSError`` there is such bytes (``CorruptStoreError``);
* botocore's errors (the payload GC's batch deletes through boto3,
  ``_bulk_delete.py``) -> ``StoreUnavailable``.

Nothing outside ``payload/`` catches ``OSError``, pyarrow's or botocore's
errors by hand (``tests/test_layout.py`` checks it; its allow-list names the
few local edges, a socket or a user's own file, that do, and why). Trajstore's
own errors pass through as they are.
"""

from __future__ import annotations

import contextlib
import errno
from typing import Iterator

import pyarrow as pa

from trajstore.errors import CorruptStoreError, PayloadMissingError, StoreUnavailable, TrajstoreError, first_line

__all__ = ["payload_error", "payload_errors"]

# errno -> the tag an operator acts on
_TAGS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk full",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only filesystem",
}

# what a segment's bytes or metadata raise when they cannot be decoded (besides pyarrow's own)
_DECODING = (KeyError, TypeError, ValueError)


def _botocore_errors() -> tuple[type[BaseException], ...]:
    """botocore's bases (its own errors and a service's answers), where the ``s3`` extra is installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)


def _reason(e: BaseException) -> str:
    line = first_line(e) or type(e).__name__
    tag = _TAGS.get(getattr(e, "errno", None) or 0)
    return f"{tag} ({line})" if tag and tag not in line.lower() else line


def payload_error(e: BaseException, what: str, where: str, *, missing: str | None = None,
                  corrupt: str | None = None, in_memory: bool = False) -> BaseException:
    """The trajstore error for ``e``, raised while ``what`` ran on ``where`` (module
    doc); ``e`` itself when it is no error of the payload seam."""
    if isinstance(e, TrajstoreError):
        return e
    if missing is not None and isinstance(e, FileNotFoundError):
        return PayloadMissingError(f"{missing} {where!r} is missing")
    if isinstance(e, OSError) and not (in_memory and corrupt is not None):
        return StoreUnavailable(f"{what} {where!r}: {_reason(e)}")  # the disk's, pyarrow's, S3's through pyarrow
    decoding = isinstance(e, (OSError, pa.ArrowException)) or (corrupt is not None and isinstance(e, _DECODING))
    if decoding:
        if corrupt is not None:
            return CorruptStoreError(f"{corrupt} {where!r} is unreadable: {first_line(e) or type(e).__name__}")
        return StoreUnavailable(f"{what} {where!r}: {_reason(e)}")
    if isinstance(e, _botocore_errors()):
        return StoreUnavailable(f"{what} {where!r}: {_reason(e)}")
    return e


@contextlib.contextmanager
def payload_errors(what: str, where: str, *, missing: str | None = None, corrupt: str | None = None,
                   in_memory: bool = False, absent_ok: bool = False) -> Iterator[None]:
    """Run the body with what the filesystem, pyarrow or botocore raise in it
    mapped to a trajstore error naming ``what`` and ``where`` (module doc).
    ``missing``/``corrupt``: the noun of a file the index names ("payload
    segment"), for ``PayloadMissingError``/``CorruptStoreError``; ``in_memory``: the
    body only decodes bytes already read (an ``OSError`` is pyarrow's refusal of
    them, with ``corrupt``: ``CorruptStoreError``); ``absent_ok``:
    a file not there ends the block quietly (a delete of one already gone).
    Anything else passes through as it is."""
    try:
        yield
    except TrajstoreError:
        raise
    except Exception as e:
        if absent_ok and isinstance(e, FileNotFoundError):
            return
        error = payload_error(e, what, where, missing=missing, corrupt=corrupt, in_memory=in_memory)
        if error is e:
            raise
        raise error from None
