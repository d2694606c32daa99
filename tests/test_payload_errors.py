"""The payload seam's one error boundary (``trajstore.payload._errors``): what the
disk, pyarrow or S3 (botocore) raise reaches a caller as a one-line trajstore
error naming what was done and where, never as the library's own exception."""

from __future__ import annotations

import os
import socket

import pyarrow as pa
import pytest

from trajstore.errors import CorruptStoreError, PayloadMissingError, StoreUnavailable, TrajstoreError
from trajstore.payload import PayloadStore
from trajstore.payload._errors import payload_errors


def _table() -> pa.Table:
    return pa.table({"x": pa.array([1, 2, 3], pa.int64())})


def test_a_full_disk_is_store_unavailable_tagged_disk_full(tmp_path):
    # /dev/full: every write gets the kernel's ENOSPC, here through the segment writer itself
    store = PayloadStore(str(tmp_path))
    os.symlink("/dev/full", tmp_path / "events-full.arrow")
    with pytest.raises(StoreUnavailable) as got:
        store.write("events-full.arrow", _table())
    text = str(got.value)
    assert text.startswith(f"cannot write payload segment {str(tmp_path / 'events-full.arrow')!r}: disk full (")
    assert "\n" not in text and type(got.value) is StoreUnavailable


def test_a_missing_segment_is_payload_missing_and_a_delete_of_one_is_done(tmp_path):
    store = PayloadStore(str(tmp_path))
    with pytest.raises(PayloadMissingError, match=r"payload segment '.*events-gone\.arrow' is missing$"):
        store.read_rows("events-gone.arrow", [0])
    store.delete("events-gone.arrow")  # already gone: nothing to do, no error
    store.write("events-here.arrow", _table())
    store.delete("events-here.arrow")
    assert not (tmp_path / "events-here.arrow").exists()


@pytest.mark.parametrize("name", ["events-bad.arrow", "samples-bad.parquet"])
def test_bytes_pyarrow_cannot_decode_are_a_corrupt_store_naming_the_file(tmp_path, name):
    store = PayloadStore(str(tmp_path))
    (tmp_path / name).write_bytes(b"ARROW1\x00\x00" + os.urandom(200))
    with pytest.raises(CorruptStoreError) as got:
        store.read_rows(name, [0])
    assert str(got.value).startswith(f"payload segment {str(tmp_path / name)!r} is unreadable: ")
    assert "\n" not in str(got.value)


def test_the_boundary_maps_each_family_and_lets_everything_else_through(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(PayloadMissingError, match="^thing .* is missing$"):
        with payload_errors("cannot open", missing, missing="thing"):
            open(missing, "rb")
    with pytest.raises(StoreUnavailable, match=r"^cannot open '.*nothing': \[Errno 2\]"):
        with payload_errors("cannot open", missing):  # no noun: an I/O error like any other
            open(missing, "rb")
    reached = []
    with payload_errors("cannot delete", missing, absent_ok=True):
        os.unlink(missing)
        reached.append("not here")
    assert reached == []  # the block ended at the missing file, quietly
    with pytest.raises(CorruptStoreError, match="^segment 'x' is unreadable: "):
        with payload_errors("cannot read", "x", corrupt="segment"):
            pa.ipc.open_file(pa.py_buffer(b"\xff" * 64))  # ArrowInvalid: not an Arrow file
    with pytest.raises(CorruptStoreError, match="^segment 'x' is unreadable: Invalid IPC "):
        with payload_errors("cannot read", "x", corrupt="segment", in_memory=True):
            pa.ipc.open_stream(pa.py_buffer(b"\xff" * 64))  # pyarrow's OSError for bytes in memory
    with pytest.raises(StoreUnavailable, match="^cannot read 'x': "):
        with payload_errors("cannot read", "x", corrupt="segment"):  # the body may do I/O: an I/O error
            pa.ipc.open_stream(pa.py_buffer(b"\xff" * 64))
    with pytest.raises(ZeroDivisionError):  # a bug is no storage error
        with payload_errors("cannot read", "x", corrupt="segment"):
            1 / 0
    mine = TrajstoreError("already one of ours")
    with pytest.raises(TrajstoreError) as got:
        with payload_errors("cannot read", "x"):
            raise mine
    assert got.value is mine


def test_botocore_errors_of_the_batch_deletes_are_store_unavailable():
    pytest.importorskip("boto3")
    from trajstore.payload._bulk_delete import s3_batch_deleter

    with socket.socket() as s:  # a port nothing listens on: botocore's EndpointConnectionError
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    location = (f"s3://bucket/prefix?endpoint_override=127.0.0.1:{port}&scheme=http&retries=0"
                "&connect_timeout=0.5&request_timeout=0.5&access_key=k&secret_key=s")
    delete = s3_batch_deleter(location, "bucket/prefix")
    assert delete is not None
    with pytest.raises(StoreUnavailable, match=r"^cannot delete 2 payload object\(s\) in 's3://bucket/prefix': "):
        delete(["a.arrow", "b.arrow"])


def test_the_inspection_reads_of_segments_go_through_the_boundary(tmp_path):
    # trajstore trace / track / rebuild read segments without a PayloadStore: the same errors
    from trajstore.inspect._panels_tokens import _read_samples
    from trajstore.inspect._trace import read_segment_rows

    with pytest.raises(PayloadMissingError, match=r"^payload segment '.*samples-gone\.arrow' is missing$"):
        read_segment_rows(str(tmp_path), "samples-gone.arrow", [0])
    (tmp_path / "samples-bad.arrow").write_bytes(os.urandom(300))
    with pytest.raises(CorruptStoreError, match=r"^payload segment '.*samples-bad\.arrow' is unreadable: "):
        read_segment_rows(str(tmp_path), "samples-bad.arrow", [0])
    with pytest.raises(CorruptStoreError, match=r"^payload segment '.*samples-bad\.arrow' is unreadable: "):
        _read_samples(str(tmp_path), [(0, 0, "samples-bad.arrow", 0)])
