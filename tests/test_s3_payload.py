"""The payload on a real S3-compatible server (``moto_server``, started here on a
loopback port): the whole pipeline ingest -> materialize -> SampleReader -> gc on
both backends, options passed through to pyarrow's S3FileSystem, an unresponsive
server failing instead of hanging, and the recorded location free of credentials.

Faults: moto keeps its objects in the memory of its process, so a server that is
stopped and started again must keep that process. ``StoppableS3`` runs moto's
server (``ThreadedMotoServer``) in a child process that closes its listening port
on "stop" (connections refused, as from a stopped server) and opens it again on
"start", its objects kept; SIGSTOP of that process is a hung server (connections
accepted by the kernel, never answered)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import pytest

import trajstore
from trajstore.cli import main
from trajstore.errors import PayloadLocationError, StoreUnavailable
from tests.helpers import finished, free_port, gen, moto_s3, started

BUCKET = "trajstore-test"


@pytest.fixture(scope="module")
def s3_endpoint() -> str:
    with moto_s3(BUCKET, os.environ.get("TRAJSTORE_MOTO_LOG", os.devnull)) as endpoint:
        yield endpoint


_SERVER = r"""
import sys
from moto.server import ThreadedMotoServer

host, port = sys.argv[1], int(sys.argv[2])
server = ThreadedMotoServer(host, port, verbose=False)
server.start()
print("start", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stop":
        server.stop()
        server._server.server_close()  # the port closed: connections are refused
    elif cmd == "start":
        server = ThreadedMotoServer(host, port, verbose=False)  # the same process: the objects are kept
        server.start()
    print(cmd, flush=True)
"""


class StoppableS3:
    """A moto S3 server in a child process that can be stopped and started (its
    objects kept) and hung (SIGSTOP) and resumed (SIGCONT)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, "127.0.0.1", str(self.port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "start"
        pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http",
                          allow_bucket_creation=True).create_dir(BUCKET)

    def _say(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == cmd

    def stop(self) -> None:
        self._say("stop")

    def start(self) -> None:
        self._say("start")

    def hang(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def stoppable_s3(s3_endpoint):  # (s3_endpoint: the credentials in the environment)
    server = StoppableS3()
    try:
        yield server
    finally:
        server.close()


def _objects(endpoint: str, prefix: str, *, marker: bool = False) -> list[str]:
    """The objects under ``prefix``; the store's marker only with ``marker``."""
    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http")
    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.File
                  and (marker or i.base_name != "trajstore-store.json"))


def trajectory(tid: str) -> list[dict]:
    return [started(tid, num_experts=8),
            gen(tid, 0, [1, 2, 3], [4, 5], version=1, routed_experts=[[[1, 2]]] * 4),
            gen(tid, 1, [1, 2, 3, 4, 5, 6], [7], version=2, routed_experts=[[[3, 4]]] * 6),
            finished(tid)]


def test_pipeline_on_s3(store_url, s3_endpoint, tmp_path, capsys):
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    location = (f"s3://testing:testing@{BUCKET}/{prefix}?endpoint_override={s3_endpoint}&scheme=http"
                f"&request_timeout=10&connect_timeout=5&retries=2")
    store = trajstore.connect(store_url, payload=location)
    ids = [f"t{i}" for i in range(12)]
    for tid in ids:
        store.append(trajectory(tid))  # one append each: one log segment each
    store.close()
    assert len([n for n in _objects(s3_endpoint, prefix) if n.startswith("events-")]) == 12
    # every later command finds the payload in the store: no --payload
    assert main(["--store", store_url, "payload", "show"]) == 0
    recorded = capsys.readouterr().out.strip()
    assert recorded == f"s3://{BUCKET}/{prefix}?endpoint_override={s3_endpoint.replace(':', '%3A')}&scheme=http"
    assert "testing" not in recorded and "timeout" not in recorded
    assert main(["--store", store_url, "materialize"]) == 0
    capsys.readouterr()
    readers = [trajstore.SampleReader(store_url, rank=r, world_size=2, batch_size=2) for r in range(2)]
    seen = [[s.trajectory_id for batch in rd for s in batch] for rd in readers]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == sorted(ids)
    # GC right away (grace 0): the retired log segments go, one copy (the sample segments) stays
    assert main(["--store", store_url, "gc", "--grace-s", "0"]) == 0
    assert "removed 12 payload file(s)" in capsys.readouterr().out
    left = _objects(s3_endpoint, prefix)
    assert left and all(n.startswith("samples-") for n in left)
    s = trajstore.connect(store_url)
    got = {x.trajectory_id: x for x in s.samples()}
    assert sorted(got) == sorted(ids) and list(got["t0"].prompt_ids) + list(got["t0"].response_ids) == [1, 2, 3, 4, 5, 6, 7]
    s.close()


def test_unknown_s3_option_is_refused_by_name(s3_endpoint, tmp_path):
    with pytest.raises(StoreUnavailable, match="request_timout"):
        trajstore.connect(f"sqlite:///{tmp_path}/s.db",
                          payload=f"s3://{BUCKET}/x?endpoint_override={s3_endpoint}&scheme=http&request_timout=3")


def test_an_unresponsive_object_store_fails_instead_of_hanging(tmp_path):
    """A server that accepts connections and never answers: with request_timeout=1 and
    one attempt the open fails with StoreUnavailable (before: an append hung > 100 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # accepted, never answered
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store = trajstore.connect(
                f"sqlite:///{tmp_path}/s.db",
                payload=f"s3://{BUCKET}/x?endpoint_override=127.0.0.1:{port}&scheme=http&request_timeout=1"
                        "&connect_timeout=1&retries=1")
            store.append(trajectory("a"))
        assert time.monotonic() - t0 < 60  # bounded by the timeouts, not by the server
    finally:
        stop.set()
        t.join(5)
        listener.close()
        for c in held:
            c.close()


# An append during an outage fails within this: the append's deadline (25 s by default,
# payload/_deadline.py) whatever its requests and their attempts; about 20 s on a hung
# server (pyarrow's timeouts; 57.6 s seen in a loaded full suite before the deadline),
# about 2 s on a stopped one. Before the defaults: no error for > 100 s.
OUTAGE_BOUND_S = 30


class _Pauses:
    """What an append that outlives its bound was doing, for the failure's message: a ticker
    thread notes every pause of more than 0.5 s in its 10 ms sleeps (the whole process stalled,
    or one thread held the GIL that long), and ``stack_at`` takes a thread's stack at a time."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.seen: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.01):
            now = time.monotonic()
            if now - last > 0.5:
                self.seen.append((round(last - self.t0, 1), round(now - last, 1)))
            last = now

    def stack_at(self, at_s: float) -> tuple[threading.Timer, list[str]]:
        """A timer (started) that takes the calling thread's stack ``at_s`` from now."""
        import traceback

        ident, taken = threading.get_ident(), []

        def take() -> None:
            frame = sys._current_frames().get(ident)
            taken.append("".join(traceback.format_stack(frame)) if frame else "(ended)")

        timer = threading.Timer(at_s, take)
        timer.daemon = True
        timer.start()
        return timer, taken

    def close(self) -> None:
        self._stop.set()
        self._ticker.join(5)


def _outage_and_back(store_url: str, server: StoppableS3, fault: str, options: str = "",
                     bound_s: float = OUTAGE_BOUND_S) -> None:
    """Appends before, during and after an outage of the object store, with the
    default options (no timeout in the location) and ``options``: during it every append
    (two at once) raises StoreUnavailable within ``bound_s``, never a driver or OS error; after
    it every acknowledged append reads back and, once GC has run, the store's objects are
    exactly the segments its index names, every one whole."""
    from sqlalchemy import select

    from trajstore.schema import segments

    prefix = f"run-{uuid.uuid4().hex[:8]}"
    store = trajstore.connect(store_url, payload=f"s3://{BUCKET}/{prefix}?endpoint_override={server.endpoint}"
                                                 f"&scheme=http{options}")
    acknowledged = []
    for i in range(3):
        store.append(trajectory(f"before{i}"))
        acknowledged.append(f"before{i}")

    def append_during(i: int) -> None:
        # an append still running 2 s before the bound (past its deadline): its stack then
        timer, stack = pauses.stack_at(bound_s - 2)
        t0 = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable) as err:
                store.append(trajectory(f"during{i}"))
        finally:
            timer.cancel()
        took = time.monotonic() - t0
        assert took < bound_s, (f"{fault}: the append failed after {took:.1f} s; the process's pauses "
                                f"(at s, for s): {pauses.seen}; its stack at {bound_s - 2:g} s:\n{''.join(stack)}")
        assert "payload" in str(err.value) and "\n" not in str(err.value)

    server.hang() if fault == "hang" else server.stop()
    pauses = _Pauses()
    try:
        # Two appends at once (two writers of one store): each waits out the default
        # timeouts on its own (about 20 s on a hung server), so together they take one wait.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(append_during, range(2)))
        for i in range(2):
            assert store.trajectory_state(f"during{i}") is None  # nothing of it in the index
    finally:
        pauses.close()
        server.resume() if fault == "hang" else server.start()
    for i in range(2):
        store.append(trajectory(f"during{i}"))  # the retry, once the store is back
        acknowledged.append(f"during{i}")
        store.append(trajectory(f"after{i}"))
        acknowledged.append(f"after{i}")
    for tid in acknowledged:
        gens = store.load_generations(tid)
        assert [list(g.output_ids) for g in gens] == [[4, 5], [7]]
    time.sleep(1.1)  # GC's grace is whole seconds of the object store's clock
    store.collect_garbage(grace_s=0)
    with store.log.read_engine.connect() as conn:
        named = sorted(conn.execute(select(segments.c.name)).scalars())
    assert _objects(server.endpoint, prefix) == named
    assert len(named) == len(acknowledged)
    for tid in acknowledged:  # every one whole, read again after the GC
        assert len(store.load_generations(tid)) == 2
    store.close()


def test_a_hung_object_store_fails_appends_within_30_s_and_loses_nothing(store_url, stoppable_s3):
    """SIGSTOP of the server (before: no error for > 100 s with the default options)."""
    _outage_and_back(store_url, stoppable_s3, "hang")


def test_an_append_past_its_deadline_fails_then_and_what_it_wrote_late_is_deleted(store_url, stoppable_s3):
    """``deadline=3``: a hung server fails each append at 3 s, before pyarrow's own
    timeouts (about 20 s); the uploads left running finish or fail after, and the GC
    (which waits for them) leaves exactly the segments the index names."""
    _outage_and_back(store_url, stoppable_s3, "hang", "&deadline=3", bound_s=8)


def test_the_deadline_holds_with_the_processs_arrow_io_threads_all_taken(stoppable_s3, tmp_path):
    """pyarrow runs an upload on its process-wide I/O pool (8 threads): with 12 uploads of
    another filesystem hung on a server that never answers (what other code of the process,
    or an earlier test, can leave behind), an append on a hung server still fails at its
    ``deadline=3`` (the deadline's waits are on trajstore's own threads)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])  # accepted, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db", payload=f"s3://{BUCKET}/p-{uuid.uuid4().hex[:8]}"
                              f"?endpoint_override={stoppable_s3.endpoint}&scheme=http&deadline=3")
    store.append(trajectory("before"))
    other = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{listener.getsockname()[1]}", scheme="http",
                              connect_timeout=30, request_timeout=30,
                              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))

    def upload(i: int) -> None:
        with contextlib.suppress(OSError), other.open_output_stream(f"b/hog{i}") as out:
            out.write(b"x" * 100)

    hogs = [threading.Thread(target=upload, args=(i,), daemon=True) for i in range(12)]
    for h in hogs:
        h.start()
    try:
        deadline = time.monotonic() + 10
        while len(held) < 8 and time.monotonic() < deadline:  # the pool's threads wait on the server
            time.sleep(0.05)
        assert len(held) >= 8, len(held)
        stoppable_s3.hang()
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="within the 3 s deadline"):
                store.append(trajectory("during"))
            took = time.monotonic() - t0
        finally:
            stoppable_s3.resume()
        assert took < 4.5, took
    finally:
        listener.close()
        for c in held:
            c.close()  # the hung uploads fail now
        for h in hogs:
            h.join(30)
    store.append(trajectory("during"))  # the retry, once the store is back
    assert [list(g.output_ids) for g in store.load_generations("during")] == [[4, 5], [7]]
    store.close()


def test_every_request_of_one_append_shares_its_deadline(stoppable_s3, tmp_path):
    """Two segment writes in one append's block on a hung server with ``deadline=2``: the
    second has what the first left of the 2 s, not 2 s of its own (nor pyarrow's
    timeouts x attempts: about 20 s each)."""
    import pyarrow as pa

    from trajstore.payload import PayloadStore

    payload = PayloadStore(f"s3://{BUCKET}/p-{uuid.uuid4().hex[:8]}?endpoint_override={stoppable_s3.endpoint}"
                           "&scheme=http&deadline=2")
    table = pa.table({"x": [1, 2, 3]})
    payload.write("events-ok.arrow", table)  # no append under way: no deadline, the server answers
    stoppable_s3.hang()
    try:
        t0 = time.monotonic()
        errors = []
        with payload.deadline():
            for name in ("events-a.arrow", "events-b.arrow"):
                with pytest.raises(StoreUnavailable, match="within the 2 s deadline") as err:
                    payload.write(name, table)
                errors.append((time.monotonic() - t0, str(err.value)))
        assert errors[0][0] < 4 and errors[1][0] < 4, errors
    finally:
        stoppable_s3.resume()
    payload.collect_garbage({"events-ok.arrow"}, grace_s=3600)  # waits for the two writes left running
    names = [n for n, _ in payload.list_names()]
    assert names == ["events-ok.arrow"], names  # finished late: deleted by themselves


def test_a_stopped_object_store_fails_appends_with_store_unavailable_and_loses_nothing(store_url, stoppable_s3):
    """The server's port closed (before: a raw OSError from the cleanup's delete, which
    masked the StoreUnavailable of the write), then open again with its objects."""
    _outage_and_back(store_url, stoppable_s3, "stop")


def test_object_store_defaults_and_given_options_win():
    """Defaults that fail fast (timeouts, two attempts, one PutObject per small object);
    every one of them yields to a value given in the location's query."""
    from trajstore.payload._filesystem import filesystem_of

    def options(location: str) -> dict:
        fs, _, local = filesystem_of(location)
        assert not local
        return fs.__reduce__()[1][0]

    base = "s3://b/x?endpoint_override=127.0.0.1:1&scheme=http"
    got = options(base)
    assert (got["connect_timeout"], got["request_timeout"], got["allow_delayed_open"]) == (2.0, 3.0, True)
    got = options(base + "&connect_timeout=10&request_timeout=60&retries=5&allow_delayed_open=false")
    assert (got["connect_timeout"], got["request_timeout"], got["allow_delayed_open"]) == (10.0, 60.0, False)


def test_the_payload_marker_on_s3(store_url, stoppable_s3):
    """On an object store too: the marker is written with the store, re-written for a
    store that lost it while its segments are there, checked at every open (the
    server down: StoreUnavailable, not a driver error), and a prefix that is empty
    (another bucket, an emptied one) is refused with nothing written there."""
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    location = f"s3://{BUCKET}/{prefix}?endpoint_override={stoppable_s3.endpoint}&scheme=http"
    store = trajstore.connect(store_url, payload=location)
    store.append(trajectory("a"))
    store.close()
    assert "trajstore-store.json" in _objects(stoppable_s3.endpoint, prefix, marker=True)
    fs = pafs.S3FileSystem(endpoint_override=stoppable_s3.endpoint, scheme="http")
    fs.delete_file(f"{BUCKET}/{prefix}/trajstore-store.json")  # a store made before markers
    trajstore.connect(store_url).close()
    assert "trajstore-store.json" in _objects(stoppable_s3.endpoint, prefix, marker=True)
    stoppable_s3.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            trajstore.connect(store_url)
        assert time.monotonic() - t0 < 30 and "\n" not in str(err.value)
    finally:
        stoppable_s3.start()
    fs.delete_dir_contents(f"{BUCKET}/{prefix}")
    with pytest.raises(PayloadLocationError, match=prefix) as err:
        trajstore.connect(store_url)
    assert "\n" not in str(err.value)
    with pytest.raises(PayloadLocationError, match=prefix) as err:  # credentials given: never shown
        trajstore.connect(store_url, payload=location.replace("s3://", "s3://testing:secret-value@"))
    assert "secret-value" not in str(err.value)
    assert _objects(stoppable_s3.endpoint, prefix, marker=True) == []  # nothing created there


def _gets(log_path, start: int, kind: str) -> int:
    """GetObject requests in moto's access log after byte ``start`` for objects named ``kind-*``."""
    import re

    with open(log_path, errors="replace") as f:
        f.seek(start)
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    return sum(1 for path in re.findall(r'"GET (/\S*) HTTP', text)
               if "list-type" not in path and path.split("?", 1)[0].rsplit("/", 1)[-1].startswith(f"{kind}-"))


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "ranged"])
def test_the_materializer_reads_a_log_segment_in_one_request(store_url, s3_endpoint, tmp_path, monkeypatch, whole):
    """A log segment holds one engine call per record batch: an object at most
    ``WHOLE_READ_BYTES`` is fetched whole in one GET, not its footer and then each
    call's batch (two requests plus one per call). The ranged path a larger
    segment takes gives the same samples."""
    import trajstore.payload._store as payload_store

    log = tmp_path / "moto.log"
    with moto_s3(BUCKET, log) as endpoint:
        if not whole:
            monkeypatch.setattr(payload_store, "WHOLE_READ_BYTES", 0)
        prefix = f"run-{uuid.uuid4().hex[:8]}"
        # a GET slower than the default 3 s request timeout (moto on a loaded machine) is
        # sent again by the S3 client, and would count twice: a timeout no test reaches
        store = trajstore.connect(store_url, payload=f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}"
                                                     f"&scheme=http&request_timeout=120")
        ids = [f"t{i}" for i in range(20)]
        store.append([e for tid in ids for e in trajectory(tid)])  # one append: one log segment of 40 calls
        start = log.stat().st_size
        assert store.materialize().num_trajectories == 20
        gets = _gets(log, start, "events")
        got = {s.trajectory_id: s for s in store.samples()}
        store.close()
    assert gets == (1 if whole else 2 + 40)
    local = trajstore.connect(f"sqlite:///{tmp_path}/local.db", payload=str(tmp_path / "payload"))
    local.append([e for tid in ids for e in trajectory(tid)])
    local.materialize()
    want = {s.trajectory_id: s for s in local.samples()}
    local.close()
    assert sorted(got) == sorted(want) == sorted(ids)
    assert all(got[t].equals(want[t]) for t in ids)


def test_what_a_remote_arrow_segment_read_fetches_whole():
    """Whole when cheaper than the footer's two requests plus one per row, each
    request counted as ``REQUEST_BYTES``; a small sample segment (one record
    batch) always; nothing over ``WHOLE_READ_BYTES``."""
    from trajstore.payload._format import SegmentKind
    from trajstore.payload._store import REQUEST_BYTES, WHOLE_READ_BYTES, _read_whole

    mib = REQUEST_BYTES
    assert _read_whole(SegmentKind.EVENTS, 5 * mib, rows=16)  # the materializer: most of a group commit's calls
    assert not _read_whole(SegmentKind.EVENTS, 5 * mib, rows=1)  # one call of it (a trace): footer + one batch
    assert _read_whole(SegmentKind.EVENTS, 3 * mib, rows=1)
    assert _read_whole(SegmentKind.SAMPLES, WHOLE_READ_BYTES, rows=1)
    assert not _read_whole(SegmentKind.SAMPLES, WHOLE_READ_BYTES + 1, rows=1)
    assert not _read_whole(SegmentKind.EVENTS, WHOLE_READ_BYTES + 1, rows=10_000)
