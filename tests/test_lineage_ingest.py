"""Training lineage events through every way in: the Writer (to a store and to the
HTTP ingest service, JSON and Arrow bodies), the service's own responses, and
``trajstore ingest``; on both backends."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sqlalchemy import text

from trajstore.cli import main
from trajstore.errors import ValidationError
from trajstore.ingest.client import Writer
from trajstore.lineage import read_annotations
from tests.helpers import finished, gen, started
from tests.test_lineage import note, step

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402

TOKEN = "t0ken"


def sql(store, query):
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query)).all()]


def materialized(store, ids=("a", "b")):
    store.append([e for tid in ids for e in (started(tid), gen(tid, 0, [1, 2], [3, 4, 5], version=1,
                                                                  logprobs=[-0.5, -0.5, -0.5]), finished(tid))])
    store.materialize()


@pytest.fixture
def service(store):
    with serve_in_thread(make_app(store, token=TOKEN, max_body_bytes=1 << 20)) as url:
        yield url


@pytest.mark.parametrize("body", ["json", "arrow"])
def test_the_writer_sends_lineage_to_the_service(store, service, body):
    materialized(store)
    lp = np.array([-0.25, -0.5, -1.0], np.float32)
    with Writer(service, token=TOKEN, body=body, flush_interval_s=0.01) as w:
        w.extend([step(samples=[("a", 0), ("b", 0)], metrics={"loss": 0.5}),
                  note("a", 0, trainer_logprobs=lp, advantages=np.ones(3, np.float32), entropy=lp * -1),
                  note("b", 0, advantages=0.5),
                  step(step=2, samples=[("zz", 0)]),  # refused: only it fails
                  step(step=3, samples=[("b", 0)])])
        with pytest.raises(ValidationError) as e:
            w.flush()
        assert e.value.rule == "unknown_sample" and w.errors == []
    assert sql(store, "SELECT step, num_samples FROM train_steps ORDER BY step") == [(1, 2), (3, 1)]
    got = {a.trajectory_id: a for a in read_annotations(store, run="r", step=1)}
    assert np.array_equal(got["a"].trainer_logprobs, lp) and np.array_equal(got["a"].entropy, -lp)
    assert got["b"].advantages == 0.5
    # the writer gave them no event_id: their key is their identity (a replay from another writer is a no-op)
    assert sql(store, "SELECT count(*) FROM events WHERE type IN ('train_step', 'sample_annotation') "
                      "AND event_id IS NOT NULL") == [(0,)]
    with Writer(service, token=TOKEN, body=body) as w:
        w.put(step(samples=[("a", 0), ("b", 0)], metrics={"loss": 0.5}))
        w.flush()
    assert sql(store, "SELECT count(*) FROM events WHERE type = 'train_step'") == [(2,)]


@pytest.mark.parametrize("body", ["json", "arrow"])
def test_the_service_refuses_a_bad_lineage_event_and_stores_nothing(store, service, body):
    from trajstore.ingest.sinks import BODY_FORMATS

    materialized(store, ["a"])
    content_type, encode = BODY_FORMATS[body]
    head = store.log.head_position()
    for events, rule in (([step(), note(trainer_logprobs=np.zeros(2, np.float32))], "length_mismatch"),
                         ([step(samples=[("a", 0)], bogus=1)], "unknown_field"),
                         ([step(samples=[("nope", 3)])], "unknown_sample")):
        resp = httpx.post(f"{service}/v1/events", content=encode(events),
                          headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
        assert resp.status_code in (400, 409, 422), resp.text
        assert rule in resp.text
    assert store.log.head_position() == head
    resp = httpx.post(f"{service}/v1/events", content=encode([step(), note(trainer_logprobs=np.zeros(3, np.float32))]),
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
    assert resp.status_code == 200, resp.text
    assert sql(store, "SELECT tokens_compared FROM train_rollout_mismatch") == [(3,)]


def test_the_writer_to_a_store_url(store, store_url):
    materialized(store, ["a"])
    with Writer(store_url) as w:
        w.put(step(samples=[("a", 0)]))
        w.put(note("a", 0, trainer_logprobs=np.zeros(3, np.float32)))
    assert sql(store, "SELECT trajectory_id FROM sample_consumption") == [("a",)]


def test_trajstore_ingest_takes_lineage_and_stores_nothing_of_a_bad_file(store, store_url, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("TRAJSTORE_PAYLOAD_DIR", str(tmp_path / "payload"))
    materialized(store, ["a", "b"])
    good = [step(samples=[["a", 0]]), note("a", 0, trainer_logprobs=[-0.5, -0.25, -0.5]),
            step(step=2, samples=[["b", 0]], attempt=1)]
    path = tmp_path / "lineage.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in good))
    head = store.log.head_position()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(e) + "\n" for e in good + [step(step=3, samples=[["c", 0]])]))
    assert main(["--store", store_url, "ingest", str(bad)]) != 0
    assert "unknown_sample" in capsys.readouterr().err
    assert store.log.head_position() == head
    # a conflict with a recorded key is found before anything is stored, too
    conflict = tmp_path / "conflict.jsonl"
    conflict.write_text("".join(json.dumps(e) + "\n" for e in good + [dict(good[0], event_id="again")]))
    assert main(["--store", store_url, "ingest", str(conflict)]) != 0
    assert store.log.head_position() == head
    assert main(["--store", store_url, "ingest", str(path)]) == 0
    assert main(["--store", store_url, "ingest", str(path)]) == 0  # a retry: no-op
    assert "appended 0 events (3 already stored)" in capsys.readouterr().out
    assert sql(store, "SELECT step, attempt, trajectory_id FROM sample_consumption ORDER BY step") == [
        (1, 0, "a"), (2, 1, "b")]
