"""One name per meaning: the old keyword names still work for one
release, with a DeprecationWarning, and mean exactly what the new ones do."""

from __future__ import annotations

import json

import pytest

import trajstore
from trajstore.cli import main
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.materializer import Materializer

CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2, seed=1)


@pytest.fixture
def filled(tmp_path):
    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db")
    for i in range(5):
        store.append(trajectory_events(CFG, i))
    yield store
    store.close()


def test_materializer_batch_size_is_max_trajectories(filled):
    with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use max_trajectories="):
        old = Materializer(filled, batch_size=2)
    assert old.max_trajectories == 2
    assert old.run(max_steps=1).num_trajectories == 2  # one step folds at most two trajectories
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        Materializer(filled, batch_size=2, max_trajectories=3)


def test_cli_materialize_batch_size_still_works(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/s.db"
    with trajstore.connect(url) as store:
        for i in range(3):
            store.append(trajectory_events(CFG, i))
    assert main(["--store", url, "materialize", "--batch-size", "1"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["num_trajectories"] == 3
    assert "--batch-size is deprecated; use --max-trajectories" in out.err
    assert main(["--store", url, "materialize", "--max-trajectories", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["num_trajectories"] == 0


def test_store_samples_batch_size_is_page_rows(filled):
    filled.materialize()
    new = [s.trajectory_id for s in filled.samples(page_rows=2)]
    with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use page_rows="):
        old = filled.samples(batch_size=2)
    assert [s.trajectory_id for s in old] == new and len(new) >= 5


def test_writer_batch_size_is_max_batch_events(tmp_path):
    from trajstore.ingest.client import Writer

    with trajstore.connect(f"sqlite:///{tmp_path}/w.db") as store:
        with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use max_batch_events="):
            writer = Writer(store, batch_size=3, flush_interval_s=30.0)
        with writer:
            assert writer.max_batch_events == 3
            for ev in trajectory_events(CFG, 0):
                writer.put(ev)
        assert store.log.head_position() == len(trajectory_events(CFG, 0))


@pytest.fixture
def folded(filled):
    filled.materialize()
    return filled


def test_reader_current_version_is_current_model_version(folded):
    from trajstore.reader import SampleReader

    with pytest.warns(DeprecationWarning, match="current_version= is deprecated; use current_model_version="):
        reader = SampleReader(folded, batch_size=2, current_version=3)
    assert reader.current_model_version == 3
    with pytest.warns(DeprecationWarning, match="use current_model_version"):
        reader.current_version = 4
    assert reader.current_model_version == 4
    with pytest.warns(DeprecationWarning, match="use current_model_version"):
        assert reader.current_version == 4
    state = reader.state_dict()
    assert state["format_version"] == 1 and state["current_model_version"] == 4
    assert "version" not in state and "current_version" not in state


def test_a_state_saved_before_the_renames_still_loads(folded):
    from trajstore.reader import SampleReader

    state = _state_after_one_batch(folded)
    new = SampleReader(folded, batch_size=2)
    new.load_state_dict(state)
    rest = [s.trajectory_id for batch in new for s in batch]
    # what the reader of the previous release saved: "version" and "current_version"
    old = json.loads(json.dumps(state))
    old["version"] = old.pop("format_version")
    old["current_version"] = old.pop("current_model_version")
    resumed = SampleReader(folded, batch_size=2)
    resumed.load_state_dict(old)
    assert resumed.current_model_version == 7 and resumed.state_dict() == state
    assert [s.trajectory_id for batch in resumed for s in batch] == rest and rest


def _state_after_one_batch(store):
    from trajstore.reader import SampleReader

    reader = SampleReader(store, batch_size=2, current_model_version=7)
    next(reader)
    return reader.state_dict()


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(format_version=2), "format version 2 is not the supported 1"),
    (lambda s: s.pop("format_version"), "lacks 'format_version'"),
    (lambda s: s.update(current_model_version="5"), "current_model_version must be an integer"),
    (lambda s: s.pop("current_model_version"), "lacks 'current_model_version'"),
])
def test_bad_renamed_state_keys_are_refused(folded, change, message):
    from trajstore.errors import ResumeStateError
    from trajstore.reader import SampleReader

    state = _state_after_one_batch(folded)
    change(state)
    with pytest.raises(ResumeStateError, match=message):
        SampleReader(folded, batch_size=2).load_state_dict(state)


def test_sample_dataset_current_version_is_current_model_version(folded):
    pytest.importorskip("torch")
    from trajstore.train.collate import SampleDataset

    with pytest.warns(DeprecationWarning, match="current_version= is deprecated; use current_model_version="):
        old = SampleDataset(folded, batch_size=2, max_staleness=0, current_version=0)
    new = SampleDataset(folded, batch_size=2, max_staleness=0, current_model_version=0)
    assert old.current_model_version == new.current_model_version == 0
    # the policy is passed on the same way under either name (every sample is stale against 100)
    with pytest.warns(DeprecationWarning):
        stale_old = SampleDataset(folded, batch_size=2, max_staleness=0, current_version=100)
    stale_new = SampleDataset(folded, batch_size=2, max_staleness=0, current_model_version=100)
    assert len(list(stale_old)) == len(list(stale_new)) == 0
    assert len(list(SampleDataset(folded, batch_size=2))) > 0
