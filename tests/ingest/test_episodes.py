"""The recorder the verl and SkyRL hooks share (``trajstore.ingest._episodes``), and SkyRL's
recording client as Ray or a worker process would ship it: pickled before it writes, each
process opening its own Writer."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np

import trajstore
from trajstore.ingest._episodes import EpisodeRecorder
from trajstore.ingest.skyrl import RecordingInferenceClient


class Engine:
    """An inference-engine client answering as SkyRL's ``InferenceEngineInterface.generate``."""

    weight_version = 4

    async def generate(self, input_batch, model=None):
        n = len(input_batch["prompt_token_ids"])
        return {"responses": ["ab"] * n, "stop_reasons": ["stop"] * n, "response_ids": [[7, 8]] * n,
                "response_logprobs": [[-0.5, -0.25]] * n, "rollout_expert_indices": None}


def test_a_pickled_recorder_opens_its_own_writer_and_records(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    trajstore.connect(store_url, payload=payload).close()
    recorder = EpisodeRecorder(store_url, writer_options={"flush_interval_s": 0.01})
    copy = pickle.loads(pickle.dumps(recorder))
    assert copy._writer is None and copy.open_ids() == []
    copy.call("e-1", [1, 2, 3], np.array([4, 5]), model_version=-1, group_id="g", logprobs=[],
              finish_reason="completed")
    copy.call("e-1", [1, 2, 3, 4, 5, 6], [9], model_version=2, logprobs=[-0.1])
    assert copy.open_ids("e-") == ["e-1"]
    assert copy.finish("e-1", reward=1) and not copy.finish("e-2")  # an episode without a call writes nothing
    copy.close()
    with trajstore.connect(store_url, payload=payload) as store:
        store.materialize()
        (s,) = store.samples()
    assert (s.trajectory_id, s.group_id, s.reward) == ("e-1", "g", 1.0)
    assert s.prompt_ids.tolist() == [1, 2, 3] and s.response_ids.tolist() == [4, 5, 6, 9]
    assert s.loss_mask.tolist() == [1, 1, 0, 1]
    assert s.token_model_versions.tolist() == [0, 0, -1, 2]  # a negative step is recorded as version 0
    assert s.logprobs_mask.tolist() == [False, False, False, True]  # verl's empty list: no logprobs


def test_skyrls_recording_client_survives_pickling_and_names_trajectories_by_session(tmp_path):
    store_url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(store_url).close()
    client = pickle.loads(pickle.dumps(RecordingInferenceClient(Engine(), store_url, run="r")))
    assert client.weight_version == 4  # everything else is the wrapped client's
    out = asyncio.run(client.generate({"prompt_token_ids": [[1, 2], [3]], "session_ids": ["uid_a_0", "uid_a_1"]}))
    assert out["response_ids"] == [[7, 8], [7, 8]]
    asyncio.run(client.generate({"prompt_token_ids": [[5]]}))  # no session: not recorded (one warning)
    assert sorted(client.recorder.open_ids()) == ["r-uid_a_0", "r-uid_a_1"]
    assert client.group_id("uid_a_1") == "r-uid_a" and client.group_id("no-repetition") is None
    for tid in client.recorder.open_ids():
        client.recorder.finish(tid, reward=0.5)
    client.recorder.close()
    with trajstore.connect(store_url) as store:
        store.materialize()
        samples = sorted(store.samples(), key=lambda s: s.trajectory_id)
    assert [(s.trajectory_id, s.group_id, s.max_model_version) for s in samples] == [
        ("r-uid_a_0", "r-uid_a", 4), ("r-uid_a_1", "r-uid_a", 4)]
    assert [s.finish_reason for s in samples] == ["stop", "stop"]
