"""What a read token cannot do through a real `trajstore replay` process, on both backends:
write anything but lineage (each event checked), send an unbounded put (refused by the
middleware before the body is read, and when the body holds more than declared),
record another owner's run, or squat the highest attempt of a step."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest

from trajstore.demo._simulate import trajectory_events
from trajstore.errors import ValidationError
from trajstore.replay import ReplayReader, ReplayStore

from replay_procs import READ_TOKEN
from test_reader import CFG

OTHER_TOKEN = "other-read-token-55555"


@pytest.fixture
def folded(store):
    for i in range(8):
        store.append(trajectory_events(CFG, i))
    store.materialize()
    return store


@pytest.fixture
def folded_steps(folded):
    """``folded``, and the same trajectories folded step-wise (projection ``steps``)."""
    folded.create_projection("steps", merge="none")
    folded.materialize(projection="steps")
    return folded


def _keys(store, n: int) -> list[list]:
    rows = next(store.materialized.iter_sample_rows(where={}, after=None, page_rows=n))
    return [[r["trajectory_id"], r["sample_index"]] for r in rows]


def _step(run: str, step: int, samples, **extra) -> dict:
    return {"type": "train_step", "run": run, "step": step, "rank": 0, "world_size": 1, "policy_version": 0,
            "samples": samples, **extra}


def _put(location: str, texts: list[str], *, token: str = READ_TOKEN, declared: tuple[int, int] | None = None,
         batches: int = 1) -> bytes:
    """A raw DoPut of ``texts`` (the event column) in ``batches`` messages, declaring
    ``declared`` (bytes, rows) or nothing."""
    column = pa.array(texts, pa.string())
    table = pa.table({"event": column})
    headers = [(b"authorization", f"Bearer {token}".encode())]
    if declared is not None:
        headers += [(b"x-trajstore-put-bytes", str(declared[0]).encode()),
                    (b"x-trajstore-put-rows", str(declared[1]).encode())]
    client = fl.connect(location)
    try:
        writer, meta = client.do_put(fl.FlightDescriptor.for_path("events"), table.schema,
                                     fl.FlightCallOptions(headers=headers, timeout=60))
        per = max(1, -(-table.num_rows // batches))
        for start in range(0, table.num_rows, per):
            writer.write_table(table.slice(start, per))
        writer.done_writing()
        answer = meta.read()
        writer.close()
        return answer.to_pybytes()
    finally:
        client.close()


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_every_event_of_a_read_tokens_put_is_checked(folded, replay_servers):
    """A put whose offender has no type (or a non-lineage type after a valid step) is
    refused by the role check, naming the event: not passed on to the store."""
    server = replay_servers(folded)
    store = ReplayStore(server.location, token=READ_TOKEN)
    before = folded.log.count_events(after_position=0)
    good = _step("mine", 0, _keys(folded, 2))
    for offender in ({"run": "mine"}, {"type": None}, {"type": "trajectory_started", "trajectory_id": "x"}):
        with pytest.raises(ValidationError, match=r"a read token cannot write .* events \(event 1;") as e:
            store.append([good, offender])
        assert e.value.rule == "unauthorized"
    assert folded.log.count_events(after_position=0) == before
    assert store.append([good]).num_appended == 1  # the step alone is lineage: recorded
    store.close()


def test_a_read_tokens_put_is_bounded_before_its_body_is_read(folded, replay_servers):
    """Undeclared or over the bound: refused by the middleware, one line, the server's
    memory untouched by the body; declared small but larger: refused as it is read;
    a train_step naming more samples than the bound: refused; nothing stored."""
    server = replay_servers(folded, "--max-lineage-put-bytes", "1048576", "--max-lineage-put-rows", "100")
    before = folded.log.count_events(after_position=0)
    step = json.dumps(_step("mine", 0, _keys(folded, 2)))
    with pytest.raises(fl.FlightServerError, match="must declare its size"):
        _put(server.location, [step])
    # 96 MiB of events declared as what they are: refused before the body is read
    big = ["x" * (1 << 20)] * 96
    peak = _peak_rss(server.proc.pid)
    with pytest.raises(fl.FlightError, match=r"over this server's bound \(100 events, 1048576 bytes"):
        _put(server.location, big, declared=(96 << 20, 96), batches=96)
    grew = _peak_rss(server.proc.pid) - peak
    assert grew < 24 << 20, f"the server's peak memory grew by {grew >> 20} MiB on a refused put"
    # declared small, sent larger: refused once the body holds more than it declared
    with pytest.raises(fl.FlightError, match="holds more than it declared"):
        _put(server.location, [step] + ["y" * 4096] * 50, declared=(len(step), 1), batches=51)
    too_many = json.dumps(_step("mine", 0, [["t", i] for i in range(101)]))
    with pytest.raises(fl.FlightServerError, match="a train_step of 101 samples is over this server's bound of 100"):
        _put(server.location, [too_many], declared=(len(too_many), 1))
    assert folded.log.count_events(after_position=0) == before
    # the client declares its puts: a step records as before; over the bound, one line with its rule
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=2)
    next(reader)
    assert reader.record_step(0, run="mine", policy_version=0).num_samples == 2
    with pytest.raises(ValidationError) as e:
        reader.store.append([_step("mine", 1, [], metrics={"pad": float(i)}) for i in range(101)])
    assert e.value.rule == "lineage_put_size" and "\n" not in str(e.value)
    reader.close()
    assert server.proc.poll() is None


def test_a_steps_export_is_what_it_trained_on_or_refused_after_its_projection_was_created_again(
        store, folded_steps, replay_servers, tmp_path, capsys):
    """Steps recorded through a replay server from a projection (one without annotations:
    the one-round-trip path; one with: the checked path) keep the projection's identity;
    exported, they are exactly the samples trained on. Once the projection was dropped and
    created again, the export refuses in one line (exit 1) instead of exporting the new
    fold's samples of the same keys; a step of the default samples still exports."""
    import pyarrow.parquet as pq
    from sqlalchemy import select

    from trajstore.cli import main
    from trajstore.schema import lineage_steps

    server = replay_servers(store)
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=3, projection="steps")
    trained = []
    for step in range(2):
        batch = next(reader)
        trained.append([(s.trajectory_id, s.sample_index) for s in batch])
        notes = None if step == 0 else {(s.trajectory_id, s.sample_index):
                                        {"trainer_logprobs": np.zeros(len(s.response_ids), np.float32)} for s in batch}
        reader.record_step(step, run="r", policy_version=0, annotations=notes)
    default = ReplayReader(server.location, token=READ_TOKEN, batch_size=2)
    plain = [(s.trajectory_id, s.sample_index) for s in next(default)]
    default.record_step(0, run="plain", policy_version=0)
    reader.close()
    default.close()
    token = store.materialized.projection("steps").token
    with store.log.read_engine.connect() as conn:
        assert conn.execute(select(lineage_steps.c.step, lineage_steps.c.projection_token)
                            .where(lineage_steps.c.run == "r").order_by(lineage_steps.c.step)).all() == \
            [(0, token), (1, token)]
    base = ["--store", store.url, "--payload", store.payload.location, "export"]

    def exported(run: str, step: int, name: str) -> list:
        assert main([*base, str(tmp_path / name), "--run", run, "--step", str(step)]) == 0
        table = pq.read_table(tmp_path / name)
        return list(zip(table.column("trajectory_id").to_pylist(), table.column("sample_index").to_pylist()))

    assert exported("r", 0, "before0") == trained[0] and exported("r", 1, "before1") == trained[1]
    store.drop_projection("steps")
    store.create_projection("steps", merge="prefix")  # the same keys exist again: other samples
    store.materialize(projection="steps")
    capsys.readouterr()
    for step in range(2):
        assert main([*base, str(tmp_path / f"after{step}"), "--run", "r", "--step", str(step)]) == 1
        err = capsys.readouterr().err.strip()
        assert "trained on projection 'steps' as it was before it was dropped and created again" in err, err
        assert "\n" not in err and not (tmp_path / f"after{step}").exists()
    assert exported("plain", 0, "plain") == plain


def test_a_read_token_records_only_its_own_runs_and_takes_attempts_in_order(folded, replay_servers):
    """Two teams' read tokens on one server: the first to record a run owns it; the
    other cannot supersede its steps (attempt 7) nor record it at all, nor record a run
    a trainer recorded with the store's login. Within its own run a token cannot squat
    attempt 2**31-1: the victim's redo and next step still record."""
    from sqlalchemy import text

    from trajstore.reader import SampleReader

    server = replay_servers(folded, "--token", OTHER_TOKEN)
    victim = ReplayReader(server.location, token=READ_TOKEN, batch_size=2)
    first = [(s.trajectory_id, s.sample_index) for s in next(victim)]
    assert victim.record_step(0, run="victim", policy_version=0).attempt == 0
    attacker = ReplayStore(server.location, token=OTHER_TOKEN)
    keys = [list(k) for k in _keys(folded, 4)[2:]]
    for event in (_step("victim", 0, keys, attempt=7), _step("victim", 1, keys),
                  _step("victim", 0, keys, attempt=(1 << 31) - 1)):
        with pytest.raises(ValidationError, match="run 'victim' is recorded by another read token") as e:
            attacker.append([event])
        assert e.value.rule == "unauthorized"
    local = SampleReader(folded, batch_size=2)
    next(local)
    local.record_step(0, run="by-login", policy_version=0)
    local.close()
    with pytest.raises(ValidationError, match="run 'by-login' was recorded without a read token"):
        attacker.append([_step("by-login", 0, keys, attempt=1)])
    # its own run: attempts in order only
    assert attacker.append([_step("mine", 0, keys)]).num_appended == 1
    for attempt in ((1 << 31) - 1, 2):
        with pytest.raises(ValidationError, match=f"attempt {attempt} of step 0 of run 'mine', rank 0 skips attempts"):
            attacker.append([_step("mine", 0, keys, attempt=attempt)])
    assert attacker.append([_step("mine", 0, keys, attempt=1, metrics={"loss": 1.0})]).num_appended == 1
    attacker.close()
    with folded.log.read_engine.connect() as conn:
        got = conn.execute(text("SELECT trajectory_id, sample_index FROM sample_consumption WHERE run = 'victim' "
                                "ORDER BY ordinal")).all()
    assert [tuple(r) for r in got] == first, "the victim's step 0 was superseded"
    # the victim records on: its next step, and a redo of step 0 at the next attempt
    second = next(victim)
    assert victim.record_step(1, run="victim", policy_version=0).attempt == 0
    victim._lineage_recorder().handed_out(second)
    redo = victim.record_step(0, run="victim", policy_version=0, metrics={"loss": 2.0})
    assert (redo.attempt, redo.replayed) == (1, False)
    victim.close()


def test_a_replay_reader_of_a_projection_created_again_raises_through_a_real_server(store, folded_steps,
                                                                                 replay_servers):
    """Through a `trajstore replay` process: a reader mid-epoch on a projection dropped and
    created again raises ``ProjectionChangedError`` (never the old fold's and the new one's
    samples mixed); a request carrying the old token is refused by the server itself; a new reader
    reads the new projection."""
    from trajstore.errors import ProjectionChangedError
    from trajstore.replay import _protocol as proto

    server = replay_servers(store)
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=2, page_rows=2, prefetch=False,
                          projection="steps")
    next(reader)
    old = reader.state_dict()["projection_token"]
    store.drop_projection("steps")
    store.create_projection("steps", merge="prefix")
    store.materialize(projection="steps")
    with pytest.raises(ProjectionChangedError, match="dropped and created again"):
        for _ in reader:
            pass
    reader.close()
    client = fl.connect(server.location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ_TOKEN}".encode())])
    ticket = proto.encode(proto.ROWS, where={}, after=None, page_rows=10, projection="steps", projection_token=old)
    with pytest.raises(fl.FlightServerError, match="projection changed: projection 'steps' was dropped and created"):
        client.do_get(fl.Ticket(ticket), opts).read_all()
    client.close()
    fresh = ReplayReader(server.location, token=READ_TOKEN, batch_size=2, projection="steps")
    assert fresh.state_dict()["projection_token"] == store.materialized.projection("steps").token != old
    assert len(next(fresh)) == 2
    fresh.close()
