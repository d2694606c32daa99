"""10,000 mutated events through ``store.append`` on both backends.

Each mutated event is stored or refused with a ValidationError naming it
(never TypeError, OverflowError, UnicodeEncodeError, a driver error, ...);
the store's counts change only by what was acknowledged; ``materialize``
works afterwards. See tests/fuzz_events.py for the mutations."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from fuzz_events import make_lineage_units, make_units, run_fuzz
from trajstore.errors import ValidationError
from trajstore.schema import events as events_table

NUM_MUTATED = 10_000


def _count_events(store) -> int:
    with store.log.read_engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(events_table)).scalar_one()


# 10,000 takes ~2.5 min per backend on a loaded 2-core machine (slow); 1,000 runs by default
@pytest.mark.parametrize("num_mutated", [
    pytest.param(NUM_MUTATED, marks=[pytest.mark.slow, pytest.mark.timeout(1800)]), 1_000])
def test_mutated_events_are_stored_or_refused(store, num_mutated):
    units = make_units(num_mutated, seed=1)
    stats = run_fuzz(lambda evs: store.append(evs).num_appended, units, refusal=ValidationError)
    assert stats.mutated_events == num_mutated
    # the mix is worth something only when both outcomes are common
    assert stats.refused_units > num_mutated // 5 and stats.accepted_units > num_mutated // 20, stats
    assert len(stats.rules) >= 15, stats.rules
    assert _count_events(store) == stats.appended_events
    metrics = store.materialize()
    assert metrics.num_samples_after > 0
    assert sum(1 for _ in store.samples()) == metrics.num_samples_after
    print(f"\n{stats.accepted_units} accepted, {stats.refused_units} refused in {stats.appends} appends; "
          f"rules: {dict(stats.rules.most_common())}")


@pytest.mark.parametrize("seed", [2, 3])
def test_mutated_units_appended_one_by_one(store, seed):
    """Without batching: each unit stored whole or refused whole, the count exact."""
    units = make_units(300, seed=seed)
    alone = []
    for events, _ in units:
        try:
            store.append(events)
            alone.append(True)
        except ValidationError:
            alone.append(False)
    assert 0 < sum(alone) < len(units)
    assert _count_events(store) == sum(len(ev) for (ev, _), ok in zip(units, alone) if ok)


@pytest.mark.parametrize("num_units", [400])
def test_mutated_lineage_events_are_stored_or_refused(store, num_units):
    """train_step and sample_annotation events mutated like the others: each stored
    or refused with a ValidationError naming it; the lineage tables hold exactly
    what was acknowledged."""
    from fuzz_events import CONFIG
    from trajstore.demo._simulate import trajectory_events

    store.append([ev for i in range(12) for ev in trajectory_events(CONFIG, i)])
    store.materialize()
    samples = [(s.trajectory_id, s.sample_index, len(s.response_ids)) for s in store.samples()]
    assert len(samples) >= 12
    before = _count_events(store)
    units = make_lineage_units(num_units, samples, seed=5)
    stats = run_fuzz(lambda evs: store.append(evs).num_appended, units, batch_units=8, refusal=ValidationError)
    assert stats.refused_units > num_units // 5 and stats.accepted_units > num_units // 20, stats
    assert len(stats.rules) >= 8 and {"unknown_sample", "length_mismatch", "unknown_field"} <= set(stats.rules), \
        stats.rules
    assert _count_events(store) - before == stats.appended_events
    with store.log.read_engine.connect() as conn:
        from sqlalchemy import text

        steps = conn.execute(text("SELECT count(*) FROM lineage_steps")).scalar_one()
        notes = conn.execute(text("SELECT count(*) FROM lineage_annotations")).scalar_one()
        views = [conn.execute(text(f"SELECT count(*) FROM {v}")).scalar_one()
                 for v in ("train_steps", "sample_consumption", "train_rollout_mismatch",
                           "train_rollout_mismatch_by_version")]
    assert steps + notes == stats.appended_events and views[0] == steps
    print(f"\n{stats.accepted_units} accepted, {stats.refused_units} refused; rules: {dict(stats.rules.most_common())}")
