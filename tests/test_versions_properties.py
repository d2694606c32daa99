"""SPEC "Versions", property: on random span streams, with each label mapped
before, between or after the calls that use it (and materializations at random
points), the store's samples equal the fold of the same calls spelt as
``token_model_versions``, each trajectory folded exactly once, on SQLite and
PostgreSQL."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajstore.events import parse_event
from trajstore.fold import fold
from tests.helpers import finished, started

NUM_LABELS = 4  # label i of an example stands for version 2 * i + 1


@st.composite
def call_spans(draw, n_out: int, labels: list[str]) -> tuple[list[dict], int | None, list[int]]:
    """Spans over ``n_out`` tokens, their per-token versions, and the model_version
    the call sends (the value of its "default" spans; None when it has none)."""
    cuts = sorted(draw(st.lists(st.integers(1, n_out - 1), max_size=2, unique=True))) if n_out > 1 else []
    bounds = [0] + cuts + [n_out]
    versions = sorted(draw(st.lists(st.integers(0, 8), min_size=len(bounds) - 1, max_size=len(bounds) - 1)))
    default = None
    spans, per_token = [], []
    for (a, b), v in zip(itertools.pairwise(bounds), versions):
        if v % 2:  # odd: a mapped label, or the version in decimal
            name = labels[(v - 1) // 2] if draw(st.integers(0, 3)) else str(v)
        elif default in (None, v) and draw(st.booleans()):  # even: "default" (one value per call), or decimal
            name, default = "default", v
        else:
            name = str(v)
        spans.append({"version": name, "start": a, "end": b})
        per_token += [v] * (b - a)
    return spans, default, per_token


@st.composite
def streams(draw, tag: str) -> tuple[list[tuple[str, object]], dict[str, list[dict]]]:
    """Steps (``("append", [events])``, ``("materialize", None)``) and each
    trajectory's calls spelt with ``token_model_versions``."""
    labels = [f"{tag}-ckpt-{i}" for i in range(NUM_LABELS)]  # the label map is store-wide: new ones per example
    steps: list[tuple[str, object]] = []
    spelt: dict[str, list[dict]] = {}
    for t in range(draw(st.integers(1, 3))):
        tid = f"{tag}-{t}"
        steps.append(("append", [started(tid)]))
        seq_tokens: list[int] = []
        calls = []
        for seq in range(draw(st.integers(1, 3))):
            if seq_tokens and draw(st.booleans()):
                prompt = seq_tokens + draw(st.lists(st.integers(0, 9), max_size=2))  # merged
            else:
                prompt = draw(st.lists(st.integers(10, 19), min_size=1, max_size=3))  # a sample of its own
            output = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
            spans, default, per_token = draw(call_spans(len(output), labels))
            ev = {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt,
                  "output_ids": output, "weight_versions": spans}
            if default is not None:
                ev["model_version"] = default
            steps.append(("append", [ev]))
            calls.append({k: v for k, v in ev.items() if k not in ("weight_versions", "model_version")}
                         | {"token_model_versions": per_token})
            seq_tokens = prompt + output
        steps.append(("append", [finished(tid)]))
        spelt[tid] = calls
    # each label mapped at a random point: before, between or after its calls (or never used)
    for i, name in enumerate(labels):
        at = draw(st.integers(0, len(steps)))
        steps.insert(at, ("append", [{"type": "version_label", "label": name, "model_version": 2 * i + 1}]))
    for _ in range(draw(st.integers(0, 3))):
        steps.insert(draw(st.integers(0, len(steps))), ("materialize", None))
    return steps, spelt


def test_held_calls_fold_like_the_same_calls_sent_per_token(store):
    examples = itertools.count()

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
              database=None)
    @given(st.data())
    def check(data):
        steps, spelt = data.draw(streams(f"x{next(examples)}"))
        for kind, events in steps:
            if kind == "materialize":
                assert store.materialize().num_unfoldable == 0
            else:
                store.append(events)
        stats = store.materialize()
        assert (stats.num_unfoldable, stats.num_held_back) == (0, 0)
        got: dict[str, list] = {}
        for s in store.samples(trajectory_ids=list(spelt)):
            got.setdefault(s.trajectory_id, []).append(s)
        assert got.keys() == spelt.keys()  # every trajectory folded
        for tid, calls in spelt.items():
            want = fold([parse_event(c) for c in calls], trajectory_id=tid, status="completed").samples
            assert len(got[tid]) == len(want)  # exactly once
            for a, b in zip(got[tid], want):
                assert a.equals(b), (tid, a.sample_index, a.token_model_versions, b.token_model_versions)
        assert store.materialize().num_trajectories == 0

    check()
    assert store.materialized.unfoldable_trajectories()["count"] == 0
