"""The replay service with real processes: `trajstore replay` servers on loopback, read by
``ReplayReader`` (and ``ReplayDataset``) in the test process.

* the same batches, byte for byte, and the same states as ``SampleReader``;
* ranks x epochs read every sample exactly once through servers killed -9 and
  restarted mid-stream ("missing", "duplicate", "incorrect order" by name);
* tokens: missing, wrong, read-only writing; malformed tickets; a stalled
  client does not stall another;
* follow mode against a writer process; the rate limiter's wait, logged once and
  in the metrics.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest

import trajstore
from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.materializer import Materializer
from trajstore.reader import ReaderConfig, SampleReader
from trajstore.replay import ReplayReader, ReplayStore
from trajstore.replay import _protocol as proto
from trajstore.demo._simulate import trajectory_events

from replay_procs import READ_TOKEN, WRITE_TOKEN, ReplayProcess, free_port
from test_reader import (CFG, GROUP_SIZE, assert_resumed, fill, flat, follow_while_another_process_writes, keys,
                         shuffled)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "samples": {"batch_size": 4},
    "groups-tokens": {"max_tokens_per_batch": 160, "keep_groups": True, "group_size": GROUP_SIZE},
    "filters": {"batch_size": 5, "status": ["completed", "aborted"], "drop_finish_reasons": ["length"],
                "mask_finish_reasons": ["abort"]},
    "stale": {"batch_size": 6, "keep_groups": True, "group_size": GROUP_SIZE, "max_staleness": 1,
              "current_model_version": 4},
}
FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "logprobs_mask", "token_model_versions",
          "token_rewards", "routed_experts", "routed_experts_mask")
SCALARS = ("trajectory_id", "group_id", "sample_index", "is_last_step", "status", "finish_reason", "reward",
           "min_model_version", "max_model_version")


@pytest.fixture(scope="module")
def filled(module_store_url, tmp_path_factory):
    """A filled store on each backend (for what the backend matters to): built once per module
    and shared by the tests that only read it (readers' leases aside). A test that writes takes
    ``filled_own``."""
    s = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("filled") / "payload"))
    fill(s, shuffled())
    yield s
    s.close()


@pytest.fixture
def filled_own(store):
    """``filled`` for a test that writes to it: a store of the test's own."""
    fill(store, shuffled())
    return store


@pytest.fixture(scope="module")
def filled_server(filled, tmp_path_factory):
    """One server over ``filled`` per backend, for the tests that only read through it (never
    killed, no flags of their own)."""
    server = ReplayProcess(filled.url, filled.payload.location, tmp_path_factory.mktemp("replay-filled"))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def filled_sqlite(tmp_path_factory, migrated_template):
    """A filled SQLite store (for what only the server's front matters to): built once per
    module and shared by the tests that only read it. A test that writes takes
    ``filled_sqlite_own``."""
    tmp_path = tmp_path_factory.mktemp("filled-sqlite")
    s = trajstore.connect(migrated_template.sqlite_copy(tmp_path / "store.db"), payload=str(tmp_path / "payload"))
    fill(s, shuffled())
    yield s
    s.close()


@pytest.fixture(scope="module")
def sqlite_server(filled_sqlite, tmp_path_factory):
    """One server over ``filled_sqlite`` (its metrics on), for the tests that only ask it questions:
    never killed, no flags of their own, its counters read as differences. A test that kills a
    server, starts one with flags, leaves streams open or counts from zero starts its own
    (``replay_servers``)."""
    server = ReplayProcess(filled_sqlite.url, filled_sqlite.payload.location, tmp_path_factory.mktemp("replay-shared"),
                           metrics_port=free_port())
    yield server.start()
    server.stop()


@pytest.fixture
def filled_sqlite_own(tmp_path, migrated_template):
    """``filled_sqlite`` for a test that writes to it: a store of the test's own."""
    s = trajstore.connect(migrated_template.sqlite_copy(tmp_path / "store.db"), payload=str(tmp_path / "payload"))
    fill(s, shuffled())
    yield s
    s.close()


def same_batch(a, b) -> None:
    assert [(s.trajectory_id, s.sample_index) for s in a] == [(s.trajectory_id, s.sample_index) for s in b]
    for x, y in zip(a, b):
        for name in SCALARS:
            assert getattr(x, name) == getattr(y, name), name
        for name in FIELDS:
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), name
            if u is not None:
                assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), name


def lockstep(readers, max_steps=None, pause_s=0.0):
    """(batches per step per rank, states per step) of readers read in lockstep;
    ``pause_s`` between steps stands for the trainer's compute."""
    steps, states = [], []
    while max_steps is None or len(steps) < max_steps:
        time.sleep(pause_s)
        batches = [next(r, None) for r in readers]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks disagree on the number of steps"
        steps.append(batches)
        states.append([r.state_dict() for r in readers])
    return steps, states


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batches_and_states_equal_sample_readers(filled, filled_server, name):
    config = dict(CONFIGS[name])
    server = filled_server
    for world_size in (1, 2, 3):
        local, local_states = lockstep([SampleReader(filled, rank=r, world_size=world_size, **config)
                                        for r in range(world_size)])
        remote_readers = [ReplayReader(server.location, token=READ_TOKEN, rank=r, world_size=world_size, **config)
                          for r in range(world_size)]
        remote, remote_states = lockstep(remote_readers)
        assert len(local) == len(remote) > 0
        for a, b in zip(local, remote):
            for x, y in zip(a, b):
                same_batch(x, y)
        assert local_states == remote_states
        for r in remote_readers:
            r.close()
    # a state saved by a SampleReader resumes in a ReplayReader and the reverse
    local = SampleReader(filled, **config)
    first = next(local)
    remote = ReplayReader(server.location, token=READ_TOKEN, **config)
    remote.load_state_dict(json.loads(json.dumps(local.state_dict())))
    rest_remote = list(remote)
    assert [keys(b) for b in rest_remote] == [keys(b) for b in local]
    back = SampleReader(filled, **config)
    back.load_state_dict(ReplayReader(server.location, token=READ_TOKEN, **config).state_dict())
    assert keys(next(back)) == keys(first)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collated_batches_under_a_stateful_dataloader_equal_sample_dataset(filled_sqlite, sqlite_server, num_workers):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    import torch

    from trajstore.replay.dataset import ReplayDataset
    from trajstore.train.collate import SampleDataset

    server = sqlite_server
    config = {"batch_size": 4, "keep_groups": True, "group_size": GROUP_SIZE}

    def run(dataset, state=None, stop=None):
        # workers start from a fresh interpreter: gRPC (this process's earlier replay clients) is not fork-safe
        loader = torchdata.StatefulDataLoader(dataset, batch_size=None, num_workers=num_workers,
                                              multiprocessing_context="forkserver" if num_workers else None)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for i, batch in enumerate(loader):
            out.append(batch)
            if stop is not None and i + 1 == stop:
                return out, loader.state_dict()
        return out, loader.state_dict()

    local, _ = run(SampleDataset(filled_sqlite.url, payload=filled_sqlite.payload.location, rank=1, world_size=2, **config))
    remote_head, state = run(ReplayDataset(server.location, token=READ_TOKEN, rank=1, world_size=2, **config), stop=3)
    remote_tail, _ = run(ReplayDataset(server.location, token=READ_TOKEN, rank=1, world_size=2, **config), state)
    remote = remote_head + remote_tail
    assert len(remote) == len(local) > 3
    for a, b in zip(local, remote):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k


def test_ranks_and_epochs_read_every_sample_once_through_servers_killed_and_restarted(filled, replay_servers):
    """Two servers; while two ranks read two epochs in lockstep a thread kills -9 one
    server and restarts it, then the other, again and again; mid-epoch the ranks
    also save their state and new readers (another world size) resume from it."""
    a, b = replay_servers(filled), replay_servers(filled)
    locations = [a.location, b.location]
    config = {"batch_size": 2, "keep_groups": True, "group_size": GROUP_SIZE // 2, "page_rows": 16}
    reference = flat([[keys(batch)] for batch in SampleReader(filled, **config)])
    assert len(reference) > 40
    stop = threading.Event()
    kills = Counter()
    failed: list[BaseException] = []

    def chaos() -> None:
        victims = [a, b]
        k = 0
        try:
            while not stop.wait(0.25):
                victim = victims[k % 2]
                victim.kill9()
                kills[victim.port] += 1
                stop.wait(0.3)
                victim.start()
                k += 1
        except BaseException as e:  # reported by the test, not lost in the thread
            failed.append(e)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        for epoch in range(2):
            readers = [ReplayReader(locations, token=READ_TOKEN, rank=r, world_size=2, retry_timeout_s=60, **config)
                       for r in range(2)]
            before, _ = lockstep(readers, max_steps=5, pause_s=0.15)
            state = json.loads(json.dumps(readers[0].state_dict()))
            resumed = [ReplayReader(locations[::-1], token=READ_TOKEN, rank=r, world_size=3, retry_timeout_s=60,
                                    **config) for r in range(3)]
            for r in resumed:
                r.load_state_dict(state)
            after, _ = lockstep(resumed, pause_s=0.15)
            for r in readers + resumed:
                r.close()
            assert_resumed([[keys(x) for x in step] for step in before],
                           [[keys(x) for x in step] for step in after], reference)
            # the resumed part is exactly what local readers resumed from the same state give
            local = [SampleReader(filled, rank=r, world_size=3, **config) for r in range(3)]
            for r in local:
                r.load_state_dict(state)
            local_after, _ = lockstep(local)
            assert [[keys(x) for x in step] for step in after] == [[keys(x) for x in step] for step in local_after]
    finally:
        stop.set()
        thread.join()
    assert not failed, f"killing or restarting a server failed: {failed[0]!r}"
    assert kills[a.port] and kills[b.port], f"the servers were not both killed while reading: {dict(kills)}"


def test_a_cut_stream_is_never_half_used(filled_sqlite, replay_servers, sqlite_server):
    """A server killed while its answers are being streamed: the reader retries on the
    next one and its batches are whole and correct."""
    config = {"batch_size": 8}
    server = replay_servers(filled_sqlite)
    spare = sqlite_server  # never killed
    reader = ReplayReader([server.location, spare.location], token=READ_TOKEN, **config)
    first = next(reader)
    server.kill9()
    rest = list(reader)
    local = list(SampleReader(filled_sqlite, **config))
    for x, y in zip(local, [first] + rest):
        same_batch(x, y)
    assert len(local) == 1 + len(rest)


def test_no_server_answers_is_store_unavailable_after_the_retry_time(filled_sqlite):
    # retry_timeout_s: one request's retries over the servers; unavailable_timeout_s: the reader's window
    reader = ReplayReader(f"grpc://127.0.0.1:{free_port()}", token=READ_TOKEN, retry_timeout_s=1.0,
                          unavailable_timeout_s=1.0, batch_size=4)
    with pytest.raises(StoreUnavailable, match=r"unavailable_timeout_s=1\).*no replay server answered"):
        next(reader)
    assert reader.stats.unavailable_waits == 1


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_reads_nothing(filled_sqlite, sqlite_server, token, monkeypatch):
    monkeypatch.delenv("TRAJSTORE_REPLAY_TOKEN", raising=False)
    server = sqlite_server
    with pytest.raises(ValidationError, match="missing or wrong bearer token") as e:
        next(ReplayReader(server.location, token=token, batch_size=4))
    assert e.value.rule == "unauthorized"
    client = fl.connect(server.location)
    headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
    opts = fl.FlightCallOptions(headers=headers)
    for call in (lambda: client.do_get(fl.Ticket(proto.encode(proto.ROWS, where={}, after=None, page_rows=10)),
                                       opts).read_all(),
                 lambda: list(client.do_action(fl.Action(proto.HELLO, proto.encode(proto.HELLO)), opts)),
                 lambda: list(client.list_actions(opts))):
        with pytest.raises(fl.FlightUnauthenticatedError):
            call()


def _events_table(events) -> pa.Table:
    # arrays as nested lists, one of the wire format's ARRAY encodings
    return pa.table({"event": pa.array([json.dumps(e, default=lambda a: a.tolist()) for e in events], pa.string())})


def test_a_read_only_token_cannot_write_and_the_write_token_can(filled_sqlite_own, replay_servers):
    filled_sqlite = filled_sqlite_own  # it writes: a store of its own
    server = replay_servers(filled_sqlite)
    before = filled_sqlite.log.count_events(after_position=0)
    table = _events_table(trajectory_events(CFG, 1000))
    desc = fl.FlightDescriptor.for_path("events")
    client = fl.connect(server.location)

    def put(token: str) -> bytes:
        size = sum(len(e.encode()) for e in table.column("event").to_pylist())
        opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode()),
                                             (b"x-trajstore-put-bytes", str(size).encode()),
                                             (b"x-trajstore-put-rows", str(table.num_rows).encode())])
        writer, meta = client.do_put(desc, table.schema, opts)
        writer.write_table(table)
        writer.done_writing()
        answer = meta.read()
        writer.close()
        return answer.to_pybytes()

    with pytest.raises(fl.FlightUnauthorizedError, match="a read token cannot write"):
        put(READ_TOKEN)
    for method in ("do_exchange",):
        opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
        with pytest.raises(fl.FlightUnauthorizedError):
            w, r = client.do_exchange(desc, opts)
            w.begin(table.schema)
            w.write_table(table)
            w.done_writing()
            r.read_all()
    assert filled_sqlite.log.count_events(after_position=0) == before, "a read token wrote"
    answer = json.loads(put(WRITE_TOKEN))
    assert answer["num_appended"] == table.num_rows
    assert filled_sqlite.log.count_events(after_position=0) == before + table.num_rows


MALFORMED = [
    (b"", "not JSON"),
    (b"\xff\xfe garbage", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"v": 99, "kind": "rows"}).encode(), "protocol version"),
    (json.dumps({"v": 1, "kind": "drop_tables"}).encode(), "kind"),
    (proto.encode(proto.ROWS, where={"sql": "1=1"}, after=None, page_rows=10), "unknown keys"),
    (proto.encode(proto.ROWS, where={}, after=[1], page_rows=10), "after"),
    (proto.encode(proto.ROWS, where={}, after=None, page_rows=10**9), "page_rows"),
    (proto.encode(proto.ROWS, where={"status": 5}, after=None, page_rows=10), "where.status"),
    (proto.encode(proto.SAMPLES, segment="../../store.db", rows=[0]), "segment"),
    (proto.encode(proto.SAMPLES, segment="/etc/passwd", rows=[0]), "segment"),
    (proto.encode(proto.SAMPLES, segment="samples-x.arrow", rows=[-1]), "rows"),
    (proto.encode(proto.SAMPLES, segment="samples-x.arrow", rows=[]), "rows"),
    (b"{" * 100_000, "not JSON"),
    (b"x" * (proto.MAX_TICKET_BYTES + 1), "byte limit"),
]


def test_malformed_tickets_get_a_clear_error_and_the_server_keeps_serving(filled_sqlite, sqlite_server):
    server = sqlite_server
    client = fl.connect(server.location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    for ticket, words in MALFORMED:
        with pytest.raises(fl.FlightServerError) as e:
            client.do_get(fl.Ticket(ticket), opts).read_all()
        text = proto.message(e.value)
        assert text.startswith(proto.INVALID) and words in text, (ticket[:40], text)
        assert "Traceback" not in str(e.value)
    # a missing segment of the right shape: the store's own error, one line
    with pytest.raises(fl.FlightServerError, match="corrupt store: payload segment .* is missing"):
        client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment="samples-none.arrow", rows=[0])), opts).read_all()
    # rows past the end of a real segment: one line, the server keeps serving
    segment = next(filled_sqlite.materialized.iter_sample_rows(where={}, after=None, page_rows=1))[0]["segment"]
    with pytest.raises(fl.FlightServerError) as e:
        client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=segment, rows=[0, 10**6])), opts).read_all()
    assert "Traceback" not in str(e.value) and "\n" not in proto.message(e.value)
    for action, body in (("drop", b"{}"), (proto.WATERMARK, b"nope"), (proto.COUNT_EVENTS, proto.encode(proto.COUNT_EVENTS))):
        with pytest.raises(fl.FlightServerError, match=proto.INVALID):
            list(client.do_action(fl.Action(action, body), opts))
    # the client maps them to ValidationError naming the server
    store = ReplayStore(server.location, token=READ_TOKEN)
    with pytest.raises(ValidationError, match="refused reading"):
        store.payload.read_rows("../x.arrow", [0])
    assert server.proc.poll() is None
    assert store.hello() == {"protocol": proto.VERSION}
    got = [s for batch in ReplayReader(store, batch_size=4) for s in batch]
    assert len(got) == sum(len(b) for b in SampleReader(filled_sqlite, batch_size=4))


def test_a_stalled_client_does_not_stall_another(filled_sqlite, replay_servers):
    """Eight clients open streams of every sample and read none of them; meanwhile
    another reader reads the whole store, twice."""
    server = replay_servers(filled_sqlite)
    rows = [r for page in filled_sqlite.materialized.iter_sample_rows(where={}, after=None, page_rows=10_000) for r in page]
    by_segment: dict[str, list[int]] = {}
    for r in rows:
        by_segment.setdefault(r["segment"], []).append(r["segment_row"])
    segment, seg_rows = max(by_segment.items(), key=lambda kv: len(kv[1]))
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    stalled = []
    for _ in range(8):
        client = fl.connect(server.location)
        stream = client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=segment, rows=seg_rows)), opts)
        stalled.append((client, stream))  # opened, never read
    expected = [keys(b) for b in SampleReader(filled_sqlite, batch_size=4)]
    done = []

    def read() -> None:
        for _ in range(2):
            done.append([keys(b) for b in ReplayReader(server.location, token=READ_TOKEN, batch_size=4)])

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "a reader was stalled by clients that stopped reading"
    assert done == [expected, expected]
    # the stalled streams are still good once read
    table = stalled[0][1].read_all()
    assert table.num_rows == len(seg_rows)


def test_follow_mode_reads_every_sample_once_while_a_process_writes(store, replay_servers):
    server = replay_servers(store)
    config = {"batch_size": 8, "keep_groups": True, "group_size": GROUP_SIZE}
    reader, steps = follow_while_another_process_writes(
        store, lambda: ReplayReader(server.location, token=READ_TOKEN, follow=True, timeout_s=20.0,
                                    poll_interval_s=0.05, **config),
        env={**os.environ, "PYTHONPATH": ROOT})
    steps = [[step] for step in steps]
    assert reader.stats.polls > 0, "the reader never had to wait: the test did not exercise following"
    reference = flat([[keys(b)] for b in SampleReader(store, **config)])
    assert len(reference) >= 32
    assert_resumed(steps, [], reference)


def test_samples_per_insert_holds_a_second_epoch_until_rollouts_insert_more(filled_sqlite_own, replay_servers):
    filled_sqlite = filled_sqlite_own  # it writes: a store of its own
    server = replay_servers(filled_sqlite, "--samples-per-insert", "1", "--hold-s", "0.5", metrics=True)
    config = {"batch_size": 4}
    first = [s for b in ReplayReader(server.location, token=READ_TOKEN, **config) for s in b]
    assert len(first) == filled_sqlite.materialized.count_samples()
    got: list = []
    second = ReplayReader(server.location, token=READ_TOKEN, **config)
    t = threading.Thread(target=lambda: got.append(next(second)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while 'trajstore_replay_wait_seconds_total{reason="samples_per_insert"}' not in server.metrics():
        assert time.monotonic() < deadline, "the second epoch was never held"
        time.sleep(0.1)
    time.sleep(1.5)  # several hold periods: still one log line for the wait
    assert not got, "the limiter let a second epoch through with nothing inserted"
    assert server.log().count("holding sample requests (samples_per_insert") == 1, server.log()
    m = Materializer(filled_sqlite)
    for i in range(100, 104):
        filled_sqlite.append(trajectory_events(CFG, i))
    m.run()
    t.join(timeout=60)
    assert got and len(got[0]) == 4
    text = server.metrics()
    assert 'trajstore_replay_requests_total{method="do_get",outcome="unavailable"}' in text
    assert "process_cpu_seconds_total" in text


def test_max_staleness_holds_a_learner_ahead_of_the_rollouts(filled_sqlite_own, replay_servers):
    filled_sqlite = filled_sqlite_own  # it writes: a store of its own
    server = replay_servers(filled_sqlite, "--max-staleness", "2", "--hold-s", "0.3", metrics=True)
    newest = max(s.max_model_version for b in SampleReader(filled_sqlite, batch_size=100) for s in b)
    # within the bound: served
    assert next(ReplayReader(server.location, token=READ_TOKEN, batch_size=4, current_model_version=newest + 2))
    got: list = []
    ahead = ReplayReader(server.location, token=READ_TOKEN, batch_size=4, current_model_version=newest + 3)
    t = threading.Thread(target=lambda: got.append(next(ahead)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "holding sample requests (max_staleness" not in server.log():
        assert time.monotonic() < deadline, "the learner ahead of the rollouts was never held"
        time.sleep(0.1)
    assert not got
    filled_sqlite.append(trajectory_events(CFG, 200, version=newest + 1))
    Materializer(filled_sqlite).run()
    t.join(timeout=60)
    assert got, "the learner stayed held after a fresh rollout arrived"


def test_the_cli_refuses_to_start_without_a_token(filled_sqlite, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_REPLAY_TOKEN"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "trajstore.cli", "replay", "--store", filled_sqlite.url, "--payload",
                          filled_sqlite.payload.location, "--port", "0"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["error: no token: pass --token or set $TRAJSTORE_REPLAY_TOKEN "
                                               "(or --insecure-no-auth to run open)"]


def test_ranks_spread_over_the_servers(filled_sqlite, replay_servers):
    servers = [replay_servers(filled_sqlite, metrics=True) for _ in range(2)]
    locations = [s.location for s in servers]
    readers = [ReplayReader(locations, token=READ_TOKEN, rank=r, world_size=2, batch_size=4) for r in range(2)]
    steps, _ = lockstep(readers)
    local, _ = lockstep([SampleReader(filled_sqlite, rank=r, world_size=2, batch_size=4) for r in range(2)])
    assert [[keys(b) for b in step] for step in steps] == [[keys(b) for b in step] for step in local]
    served = []
    for s in servers:
        m = re.search(r"^trajstore_replay_samples_served_total (\S+)$", s.metrics(), re.M)
        served.append(float(m.group(1)))
    assert served[0] > 0 and served[1] > 0, f"samples served per server: {served}"
    assert sum(served) == sum(len(b) for step in local for b in step)


def test_a_busy_port_is_one_line(filled_sqlite, sqlite_server):
    server = sqlite_server
    out = subprocess.run([sys.executable, "-m", "trajstore.cli", "replay", "--store", filled_sqlite.url, "--payload",
                          filled_sqlite.payload.location, "--port", str(server.port), "--token", READ_TOKEN],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot listen on grpc+tcp://127.0.0.1:{server.port} (is the port in use?)"), last
    assert "Traceback" not in out.stderr


def test_tls(filled_sqlite, replay_servers, sqlite_server, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = replay_servers(filled_sqlite, "--host", "localhost", "--tls-cert", str(cert), "--tls-key", str(key))
    assert "listening on grpc+tls://localhost:" in server.log()
    with ReplayReader(server.location, token=READ_TOKEN, tls_root_certs=cert.read_bytes(), batch_size=4) as reader:
        got = list(reader)
    local = list(SampleReader(filled_sqlite, batch_size=4))
    assert len(got) == len(local) > 0
    for a, b in zip(local, got):
        same_batch(a, b)
    # A client that does not trust the certificate, names a host the certificate does not,
    # or speaks TLS to a plaintext server reads nothing, and is told so at once: a refused
    # handshake is no outage to wait out (it was retried for retry_timeout_s, then waited
    # out for unavailable_timeout_s).
    port = server.location.rsplit(":", 1)[1]
    plain_port = sqlite_server.location.rsplit(":", 1)[1]
    for location, roots, why in [(server.location, None, "certificate verify failed"),
                                 (f"grpc+tls://127.0.0.1:{port}", cert.read_bytes(), "127.0.0.1 is not in peer"),
                                 (f"grpc+tls://localhost:{plain_port}", cert.read_bytes(), "wrong version number")]:
        start = time.monotonic()
        with ReplayReader(location, token=READ_TOKEN, tls_root_certs=roots, batch_size=4) as reader, \
                pytest.raises(ValidationError, match=f"replay server {re.escape(location)} failed the TLS handshake "
                                                     f"for .*{why}") as refused:
            next(reader)
        assert refused.value.rule == "replay_tls"
        assert time.monotonic() - start < 5, time.monotonic() - start


def test_every_answer_announces_its_row_count(filled_sqlite, sqlite_server):
    """What lets the reader tell a stream cut short from a short answer."""
    server = sqlite_server
    client = fl.connect(server.location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    rows = client.do_get(fl.Ticket(proto.encode(proto.ROWS, where={}, after=None, page_rows=7)), opts).read_all()
    assert rows.num_rows == 7 and proto.complete(rows)
    first = rows.to_pylist()[0]
    part = client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=first["segment"], rows=[first["segment_row"]])),
                         opts).read_all()
    assert part.num_rows == 1 and proto.complete(part)
    assert not proto.complete(part.slice(0, 0))


def test_the_metrics_count_the_ipc_bytes_and_the_tokens_sent(filled_sqlite, sqlite_server):
    """``payload_bytes_served`` is the bytes of the Arrow IPC messages sent (what the
    client receives, before gRPC's framing) and ``tokens_served`` their prompt and
    response tokens, for answers of contiguous and scattered rows."""
    import pyarrow.ipc as ipc

    server = sqlite_server
    client = fl.connect(server.location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    rows = next(filled_sqlite.materialized.iter_sample_rows(where={}, after=None, page_rows=10_000))
    segment = Counter(r["segment"] for r in rows).most_common(1)[0][0]
    numbers = sorted(r["segment_row"] for r in rows if r["segment"] == segment)
    assert len(numbers) >= 4

    def served() -> tuple[float, float]:
        text = server.metrics()
        return tuple(float(re.search(rf"^trajstore_replay_{name}_total (\S+)$", text, re.M).group(1))
                     for name in ("payload_bytes_served", "tokens_served"))

    sent = tokens = 0
    before = served()
    for wanted in (numbers[:3], numbers[::2]):
        table = client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=segment, rows=wanted)), opts).read_all()
        sent += sum(ipc.get_record_batch_size(b) for b in table.to_batches())
        tokens += sum(len(p) + len(r) for p, r in zip(table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist()))
    after = served()
    assert (after[0] - before[0], after[1] - before[1]) == (sent, tokens)


def test_a_fail_over_never_closes_a_client_another_call_is_using(filled_sqlite, sqlite_server):
    """Parallel fetches share one Flight client; when one of them fails over, the others
    are still inside their calls on it. Closing it under them crashed the process
    (a segfault in ``do_get``); it is closed when its last call ends."""
    server = sqlite_server
    store = ReplayStore(server.location, token=READ_TOKEN)
    inside, go = threading.Event(), threading.Event()
    answers: list = []

    def slow_hello(client, options):
        inside.set()
        assert go.wait(30)
        results = list(client.do_action(fl.Action(proto.HELLO, proto.encode(proto.HELLO)), options))
        return json.loads(results[0].body.to_pybytes())

    def caller():
        try:
            answers.append(store._conn.call("hello", slow_hello))
        except BaseException as e:  # reported below
            answers.append(e)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert inside.wait(30)
        store._conn._fail_over(0)  # what a sibling fetch does when its own call fails
        assert store._conn._client is None
    finally:
        go.set()
        thread.join(30)
    assert isinstance(answers[0], dict) and answers[0]["protocol"], answers
    assert store.hello()["protocol"]  # the next call connects afresh
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.hello()


def test_closing_a_reader_mid_prefetch_returns_and_leaves_no_fetch_running(filled_sqlite, sqlite_server):
    """A reader closed while its prefetch fetches: close() returns and no fetch thread
    outlives it (threads left running crashed a later test's process)."""
    server = sqlite_server
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=4, streams=4)
    assert next(reader)
    ahead = next(iter(reader._pipelines))
    assert len(ahead.threads) > 1  # the next batches are fetched ahead, in threads of their own
    reader.close()
    alive = [t.name for t in ahead.threads if t.is_alive()]
    assert not alive, alive


def test_a_reader_config_argument_is_deprecated_as_for_sample_reader(filled_sqlite, sqlite_server):
    server = sqlite_server
    config = ReaderConfig(batch_size=4)
    with pytest.warns(DeprecationWarning, match=r"ReplayReader\(\.\.\., config\) is deprecated; pass the settings "
                                                r"as keywords") as caught:
        old = ReplayReader(server.location, config, token=READ_TOKEN, page_rows=5)
    assert caught[0].filename == os.path.abspath(__file__)
    new = ReplayReader(server.location, token=READ_TOKEN, batch_size=4, page_rows=5)
    try:
        assert old.config == new.config == ReaderConfig(batch_size=4, page_rows=5)
        assert [keys(b) for b in old] == [keys(b) for b in new]
        assert old.state_dict() == new.state_dict()
    finally:
        old.close()
        new.close()


def test_bad_rows_and_deep_nesting_are_invalid_requests_that_disclose_no_path(filled_sqlite, sqlite_server):
    """Rows past a segment's end and deeply nested JSON are the request's fault:
    "invalid request" (the client raises ValidationError, not CorruptStoreError), and
    no answer names where the server keeps the payload."""
    from trajstore.errors import CorruptStoreError
    from sqlalchemy import select
    from trajstore.schema import segments

    server = sqlite_server
    client = fl.connect(server.location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    segment = next(filled_sqlite.materialized.iter_sample_rows(where={}, after=None, page_rows=1))[0]["segment"]
    with filled_sqlite.log.read_engine.connect() as conn:
        n = conn.execute(select(segments.c.num_rows).where(segments.c.name == segment)).scalar_one()
    payload_dir = str(filled_sqlite.payload.location)
    tickets = [(proto.encode(proto.SAMPLES, segment=segment, rows=[n]), "past the end"),
               (proto.encode(proto.SAMPLES, segment=segment, rows=[0, 10**6]), "past the end"),
               (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
               (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply")]
    for ticket, words in tickets:
        with pytest.raises(fl.FlightServerError) as e:
            client.do_get(fl.Ticket(ticket), opts).read_all()
        text = proto.message(e.value)
        assert text.startswith(proto.INVALID) and words in text, (ticket[:30], text)
        assert payload_dir not in str(e.value) and "RecursionError" not in str(e.value)
    # a segment the index does not name: still one line, and no path either
    with pytest.raises(fl.FlightServerError) as e:
        client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment="samples-none.arrow", rows=[0])), opts).read_all()
    assert payload_dir not in str(e.value) and "samples-none.arrow" in str(e.value)
    store = ReplayStore(server.location, token=READ_TOKEN, retry_timeout_s=5)
    try:
        with pytest.raises(ValidationError, match="past the end") as v:
            store.payload.read_rows(segment, [n])
        assert not isinstance(v.value, CorruptStoreError) and v.value.rule == "replay_request"
        assert store.hello() == {"protocol": proto.VERSION}  # still serving
    finally:
        store.close()


def test_a_denied_get_schema_is_one_trajstore_error_not_an_os_error(filled_sqlite, sqlite_server):
    """pyarrow's client reports a refused GetSchema as a bare OSError; the replay client
    must not take it for an outage (retrying until retry_timeout_s) but say it was refused."""
    server = sqlite_server
    for token in (READ_TOKEN, "wrong-token"):
        store = ReplayStore(server.location, token=token, retry_timeout_s=30)
        try:
            t0 = time.monotonic()
            with pytest.raises(ValidationError, match="refused reading the schema") as e:
                store._conn.call("reading the schema",
                                 lambda c, o: c.get_schema(fl.FlightDescriptor.for_path("samples"), o))
            assert e.value.rule == "unauthorized" and time.monotonic() - t0 < 10
        finally:
            store.close()


def test_a_wait_is_logged_once_not_once_per_parallel_stream(filled_sqlite_own, replay_servers, caplog):
    filled_sqlite = filled_sqlite_own  # it writes: a store of its own
    server = replay_servers(filled_sqlite, "--max-staleness", "0", "--hold-s", "0.2")
    newest = max(s.max_model_version for b in SampleReader(filled_sqlite, batch_size=100) for s in b)
    got: list = []
    ahead = ReplayReader(server.location, token=READ_TOKEN, batch_size=16, streams=4,
                         current_model_version=newest + 1)
    caplog.set_level("WARNING", logger="trajstore.replay.client")
    t = threading.Thread(target=lambda: got.append(next(ahead)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "holding sample requests (max_staleness" not in server.log():
        assert time.monotonic() < deadline, "the reader was never held"
        time.sleep(0.1)
    time.sleep(1.5)  # several holds of every stream
    assert not got
    filled_sqlite.append(trajectory_events(CFG, 300, version=newest + 1))
    Materializer(filled_sqlite).run()
    t.join(timeout=60)
    assert got
    waits = [r for r in caplog.records if "replay reader waits: server" in r.getMessage()]
    assert len(waits) == 1, [r.getMessage() for r in waits]
    ahead.close()
def test_a_trainer_records_lineage_through_the_replay_reader(filled_own, replay_servers):
    """``ReplayReader.record_step`` with the read token: the step lands in the store
    as through SampleReader; a replay is a no-op, a redo takes the next attempt; the
    read token still writes nothing but lineage; the store's refusals keep their rule."""
    from sqlalchemy import text

    filled = filled_own  # it writes: a store of its own

    server = replay_servers(filled)
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=4)
    batch = next(reader)
    done = reader.record_step(0, run="remote", policy_version=3, metrics={"loss": 0.5},
                              annotations={(s.trajectory_id, s.sample_index):
                                           {"trainer_logprobs": np.zeros(len(s.response_ids), np.float32)}
                                           for s in batch[:2]})
    assert (done.attempt, done.num_samples, done.num_annotations, done.replayed) == (0, 4, 2, False)
    with filled.log.read_engine.connect() as conn:
        got = conn.execute(text("SELECT trajectory_id, sample_index FROM sample_consumption WHERE run = 'remote' "
                                "ORDER BY ordinal")).all()
        assert [tuple(r) for r in got] == [(s.trajectory_id, s.sample_index) for s in batch]
        assert conn.execute(text("SELECT count(*) FROM train_rollout_mismatch WHERE run = 'remote'")).scalar() == 2
    keys = [(s.trajectory_id, s.sample_index) for s in batch]
    recorder = reader._lineage_recorder()
    assert recorder.record(0, run="remote", policy_version=3, metrics={"loss": 0.5}, samples=keys,
                           annotations={k: {"trainer_logprobs": np.zeros(len(s.response_ids), np.float32)}
                                        for k, s in zip(keys[:2], batch)}).replayed
    redo = recorder.record(0, run="remote", policy_version=3, metrics={"loss": 0.7}, samples=keys)
    assert (redo.attempt, redo.replayed) == (1, False)
    with pytest.raises(ValidationError) as e:
        reader.store.append([{"type": "train_step", "run": "remote", "step": 1, "rank": 0, "world_size": 1,
                              "policy_version": 0, "samples": [["no-such-trajectory", 0]]}])
    assert e.value.rule == "unknown_sample" and e.value.index == 0
    before = filled.log.count_events(after_position=0)
    with pytest.raises(ValidationError, match="a read token cannot write 'trajectory_started'"):
        reader.store.append([{"type": "train_step", "run": "remote", "step": 2, "rank": 0, "world_size": 1,
                              "policy_version": 0, "samples": []},
                             {"type": "trajectory_started", "trajectory_id": "sneaked"}])
    assert filled.log.count_events(after_position=0) == before
    reader.close()


def test_a_reader_fetches_a_batch_in_one_request_and_streams_batches_at_once(filled, filled_server):
    """The payload of a batch is one request per segment it spans (not split into
    smaller ones), and the reader keeps ``streams`` of them in flight: with every
    answer held 0.2 s on arrival, four are under way at once and an epoch takes
    less than the sum of the holds, and the batches are the local reader's."""
    server = filled_server
    config = {"batch_size": 3, "page_rows": 1000}
    local = [keys(b) for b in SampleReader(filled, **config)]
    where = {(r["trajectory_id"], r["sample_index"]): r["segment"]
             for page in filled.materialized.iter_sample_rows(where={}, after=None, page_rows=10_000) for r in page}
    reader = ReplayReader(server.location, token=READ_TOKEN, streams=4, **config)
    payload, fetched, at_once, now = reader.store.payload, [], [0], [0]
    lock = threading.Lock()
    fetch = payload._fetch

    def held(name, wanted):
        with lock:
            now[0] += 1
            at_once[0] = max(at_once[0], now[0])
        try:
            table = fetch(name, wanted)
            time.sleep(0.2)
            fetched.append(len(wanted))
            return table
        finally:
            with lock:
                now[0] -= 1

    payload._fetch = held
    try:
        t0 = time.monotonic()
        got = [keys(b) for b in reader]
        took = time.monotonic() - t0
    finally:
        reader.close()
    assert got == local
    asked = sum(len({where[k] for k in batch}) for batch in local)  # (batch, segment) pairs
    assert len(fetched) == asked and sum(fetched) == sum(map(len, local)), (fetched, asked)
    assert 4 <= at_once[0] <= 4 * 2, at_once  # 4 steps, each of up to 2 segments (read_threads=2)
    assert took < 0.2 * asked, (took, asked)  # one at a time: at least 0.2 s each


def test_a_reader_loads_its_read_ahead_on_streams_threads_not_one_per_batch(filled_sqlite, sqlite_server):
    """The read-ahead's loads run on ``streams`` threads kept for the iteration (a
    thread started per batch cost a thread start and a cold stack each), and the
    batches are the local reader's."""
    server = sqlite_server
    local = [keys(b) for b in SampleReader(filled_sqlite, batch_size=2)]
    reader = ReplayReader(server.location, token=READ_TOKEN, streams=3, batch_size=2)
    load, threads = reader._load, set()

    def counted(units):
        threads.add(threading.get_native_id())
        return load(units)

    reader._load = counted
    try:
        got = [keys(b) for b in reader]
    finally:
        reader.close()
    assert got == local and len(local) >= 12
    assert 1 <= len(threads) <= 3, len(threads)


def test_the_server_maps_a_segment_once_for_many_requests(filled):
    """The server keeps the segments it serves open: ten requests for rows of one
    segment map it once (a map per request cost page faults and an munmap each)."""
    from trajstore.replay._server import ReplayServer

    rows = next(filled.materialized.iter_sample_rows(where={}, after=None, page_rows=10_000))
    segment = rows[0]["segment"]
    mine = [r["segment_row"] for r in rows if r["segment"] == segment]
    mapped = []
    map_segment = filled.payload._map
    filled.payload._map = lambda name: mapped.append(name) or map_segment(name)
    server = ReplayServer(filled, "grpc://127.0.0.1:0", tokens=None)
    threading.Thread(target=server.serve, daemon=True).start()
    client = fl.connect(f"grpc://127.0.0.1:{server.port}")
    try:
        for i in range(10):
            part = mine[i % len(mine):][:2]
            table = client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=segment, rows=part))).read_all()
            assert table.num_rows == len(part)
            direct = filled.payload.read_rows(segment, part)
            assert table.column("prompt_ids").to_pylist() == [
                direct.table.column("prompt_ids")[direct.index[r]].as_py() for r in part]
        assert mapped.count(segment) == 1 + 10, mapped  # once by the server; once per direct read above
    finally:
        client.close()
        server.shutdown()
        filled.payload._map = map_segment
