"""The recording proxy and the rollout ledger (docs/reference.md "Rollout ledger"), over real
loopback HTTP in front of a fake vLLM server: the harness's ledger headers start the
trajectory in its group, and after a crash (a new proxy, a new Store on the same database)
the continued prompt is recorded at the plan's next seq and folds into the same sample."""

from __future__ import annotations

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

import trajstore  # noqa: E402
from openai_upstream import make_upstream, render_chat, serve_in_thread  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402


def _headers(tid: str, version: int, **ledger: str) -> dict:
    return {"X-Trajstore-Trajectory": tid, "X-Trajstore-Model-Version": str(version), "X-Trajstore-Group": "g",
            "X-Trajstore-Run": "run-1", "X-Trajstore-Prompt": "gsm8k/7", "X-Trajstore-Epoch": "2",
            "X-Trajstore-Group-Size": "1", **ledger}


def test_a_trajectory_continued_through_a_restarted_proxy_is_one_sample(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    upstream = make_upstream()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with serve_in_thread(upstream) as upstream_url:
        first = trajstore.connect(store_url, payload=payload)
        with serve_in_thread(make_proxy_app(first, upstream_url)) as proxy:
            resp = httpx.post(f"{proxy}/v1/chat/completions", json={"model": "fake", "messages": messages},
                              headers=_headers("ep", 3))
            assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers
            out1 = resp.json()["choices"][0]
        first.close()  # the driver, its proxy and its store handle are gone

        again = trajstore.connect(store_url, payload=payload)
        plan = again.rollout_state("run-1")
        assert plan.dispatched == {("gsm8k/7", 2)}
        (group,) = plan.open
        (tail,) = group.running
        p1 = render_chat(messages)
        assert tail.next_seq == 1 and tail.last_version == 3
        assert tail.tokens.tolist() == p1 + out1["token_ids"]

        messages = messages + [out1["message"], {"role": "user", "content": "go on"}]
        with serve_in_thread(make_proxy_app(again, upstream_url)) as proxy:
            resp = httpx.post(f"{proxy}/v1/chat/completions", json={"model": "fake", "messages": messages},
                              headers=_headers("ep", 4))
            assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers
            assert resp.headers["x-trajstore-seq"] == str(tail.next_seq)
            out2 = resp.json()["choices"][0]
            p2 = render_chat(messages)
            assert p2[:len(tail.tokens)] == tail.tokens.tolist()  # the continued prompt starts with the tail
            # a header that disagrees with the group is refused, never recorded in another group
            bad = httpx.post(f"{proxy}/v1/chat/completions", json={"model": "fake", "messages": messages},
                             headers=_headers("other", 4, **{"X-Trajstore-Group-Size": "4"}))
            assert "group_mismatch" in bad.headers.get("x-trajstore-error", "")
            done = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "ep", "status": "completed"})
            assert done.status_code == 200
        assert [g.group_id for g in again.rollout_state("run-1").whole] == ["g"]
        again.materialize()
        (sample,) = [s for s in again.samples() if s.trajectory_id == "ep"]
        delta = len(p2) - len(p1 + out1["token_ids"])
        assert sample.response_ids.tolist() == out1["token_ids"] + p2[len(p1 + out1["token_ids"]):] + out2["token_ids"]
        versions = [3] * len(out1["token_ids"]) + [-1] * delta + [4] * len(out2["token_ids"])
        np.testing.assert_array_equal(sample.token_model_versions, versions)
        again.close()
