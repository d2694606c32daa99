"""docs/reference.md is kept in step with the code: its event field tables are
exactly what the parser accepts, its sample fields are ``Sample``'s, every
refusal rule it names is one the code raises (and the reverse), and every
worked example in it gives, through the store on both backends, exactly the
samples and metrics it states."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from trajstore.errors import ValidationError
from trajstore.events import _FIELDS
from trajstore.sample import FIELDS as SAMPLE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
SPEC_EXAMPLES = {"M1", "M2", "M3", "M4", "M5", "R1", "A1", "A2"}


def _section(heading: str) -> str:
    """The text under ``heading`` (a whole line), up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    start = REFERENCE.index("\n" + heading + "\n") + len(heading) + 2
    stop = re.compile(r"^#{1,%d} " % level, re.M).search(REFERENCE, start)
    return REFERENCE[start : stop.start() if stop else len(REFERENCE)]


def _first_column(section: str) -> list[str]:
    """The backticked names in the first column of the section's first table."""
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([a-z_0-9]+)`", line.split("|")[1])
    return names


@pytest.mark.parametrize("event_type", sorted(_FIELDS))
def test_each_event_types_table_names_exactly_the_accepted_fields(event_type):
    documented = _first_column(_section(f"### `{event_type}`"))
    assert len(documented) == len(set(documented))
    assert set(documented) == set(_FIELDS[event_type])


def test_the_sample_fields_table_is_the_sample_record():
    assert set(_first_column(_section("## Sample fields"))) == set(SAMPLE_FIELDS)


def _source_rules() -> set[str]:
    src = "".join((ROOT / "trajstore" / f).read_text() for f in (
        "events/__init__.py", "events/_fields.py", "events/_parse.py", "events/_lineage.py", "events/_wire.py",
        "_append/admission.py", "fold.py", "errors.py", "lineage/_admission.py", "events/_ledger.py",
        "rollout/_ledger.py"))
    literal = set(re.findall(r'rule="([a-z_0-9]+)"', src)) | set(re.findall(r'"(seq_gap|seq_taken)"', src))
    return literal | {"conflict"}


def test_every_refusal_rule_is_documented_and_raised():
    documented = set(_first_column(_section("### Validation")))
    raised = _source_rules()
    # rules named after a field (rule=key) are raised by the typed-field checks
    by_field = {"seq", "num_experts", "reward", "label", "token_model_versions", "model_version", "group_id",
                "event_id", "finish_reason", "trajectory_id", "step", "world_size", "policy_version", "attempt",
                "sample_index", "projection", "run", "prompt_id", "epoch", "reason"}
    assert documented - raised - by_field == set()
    # fold_policy refuses a projection's definition (docs/projections.md), never an appended event
    assert raised - documented - {"url", "conflict", "fold_policy"} == set()


def _examples() -> list[dict]:
    blocks = re.findall(r"```json\n(.*?)```", _section("## Worked examples"), re.S)
    return [json.loads(b) for b in blocks]


def test_the_spec_worked_examples_are_all_there():
    names = [e["example"] for e in _examples()]
    assert len(names) == len(set(names))
    assert SPEC_EXAMPLES <= set(names)


def _events(example: dict, tid: str = "t") -> list[dict]:
    out = [{"type": "trajectory_started", "trajectory_id": tid}]
    for seq, c in enumerate(example["calls"]):
        call = {"type": "generation", "trajectory_id": tid, "seq": seq, **c}
        if not {"model_version", "token_model_versions", "weight_versions"} & call.keys():
            call["model_version"] = 0
        out.append(call)
    return out + [{"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]


@pytest.mark.parametrize("example", _examples(), ids=lambda e: e["example"])
def test_worked_example(store, example):
    events = _events(example)
    if "refused" in example:
        with pytest.raises(ValidationError) as e:
            store.append(events)
        assert e.value.rule == example["refused"]
        assert store.log.head_position() == 0
        return
    if "labels_before" in example:
        store.append([{"type": "version_label", "label": k, "model_version": v}
                      for k, v in example["labels_before"].items()])
    store.append(events)
    if "labels_after" in example:
        held = store.materialize()
        assert (held.num_trajectories, held.num_held_back) == (0, 1)
        store.append([{"type": "version_label", "label": k, "model_version": v}
                      for k, v in example["labels_after"].items()])
    stats = store.materialize()
    samples = list(store.samples())
    assert len(samples) == len(example["samples"])
    for got, want in zip(samples, example["samples"]):
        for name, value in want.items():
            have = getattr(got, name)
            if isinstance(have, np.ndarray):
                np.testing.assert_allclose(have.astype(np.float64), np.asarray(value, np.float64), rtol=1e-6,
                                           err_msg=f"{example['example']} {name}")
            else:
                assert have == value, (example["example"], name)
    for name, value in example.get("metrics", {}).items():
        assert getattr(stats, name) == pytest.approx(value), (example["example"], name)
    if "drift" in example:
        with store.log.read_engine.connect() as conn:
            got = conn.execute(text("SELECT route_rows_resent, route_rows_drifted FROM generation_events "
                                    "ORDER BY seq")).all()
        assert [list(r) for r in got] == example["drift"]
