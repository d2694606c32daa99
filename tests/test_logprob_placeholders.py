"""SPEC: a logprob at or below -9999.0 is the engine's placeholder for none. It is
stored as missing (``logprobs_mask`` false, ``rollout_logprobs`` 0.0) and counted
per event in the index."""

from __future__ import annotations

import numpy as np
from sqlalchemy import text

from trajstore.events import parse_event
from trajstore.fold import fold
from helpers import finished, gen, started


def test_the_fold_stores_placeholders_as_missing():
    gens = [parse_event(gen("t", 0, [1], [2, 3, 4], logprobs=[-0.5, -9999.0, -1e6])),
            parse_event(gen("t", 1, [1, 2, 3, 4, 5], [6, 7], logprobs=[-9998.9, -9999.0]))]
    [s] = fold(gens, trajectory_id="t").samples
    np.testing.assert_array_equal(s.logprobs_mask, [True, False, False, False, True, False])
    np.testing.assert_array_equal(s.rollout_logprobs, np.array([-0.5, 0, 0, 0, -9998.9, 0], np.float32))
    assert s.rollout_logprobs.dtype == np.float32


def test_the_store_counts_them_per_event_and_a_refold_agrees(store):
    store.append([started("a"),
                  gen("a", 0, [1], [2, 3, 4], logprobs=[-0.5, -9999.0, -9999.0]),
                  gen("a", 1, [1, 2, 3, 4, 5], [6], logprobs=[-0.25]),
                  gen("a", 2, [1, 2, 3, 4, 5, 6], [7]),  # no logprobs at all
                  gen("a", 3, [1, 2, 3, 4, 5, 6, 7], [8], logprobs=[-20000.0]),
                  finished("a")])
    with store.log.read_engine.connect() as conn:
        per_event = conn.execute(text("SELECT seq, num_placeholder_logprobs FROM generation_events "
                                      "ORDER BY seq")).all()
        per_trajectory = conn.execute(text("SELECT num_placeholder_logprobs FROM trajectory_summary")).scalar_one()
    assert [tuple(r) for r in per_event] == [(0, 2), (1, 0), (2, None), (3, 1)]
    assert per_trajectory == 3
    store.materialize()
    [s] = store.samples()
    np.testing.assert_array_equal(s.logprobs_mask, [True, False, False, False, True, False, False])
    np.testing.assert_array_equal(s.rollout_logprobs, np.array([-0.5, 0, 0, 0, -0.25, 0, 0], np.float32))
    # the events now read from the sample row: rebuilt, they fold to the same sample
    [again] = fold(store.load_generations("a"), trajectory_id="a").samples
    assert again.equals(s)
