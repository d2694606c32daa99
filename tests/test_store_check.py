"""Store.check / Store.checker: admission without writing (the dry run
``trajstore ingest`` validates a file with), on both backends."""

from __future__ import annotations

import pytest

from trajstore.errors import ConflictError, ValidationError
from tests.helpers import finished, gen, snapshot, started


def test_check_writes_nothing_and_predicts_the_append(store):
    batch = [started("a"), gen("a", 0, [1, 2], [3, 4]), gen("a", 1, [1, 2, 3, 4, 5], [6]), finished("a")]
    before = snapshot(store)
    predicted = store.check(batch)
    assert snapshot(store) == before
    assert (predicted.num_appended, predicted.num_duplicates, predicted.last_position) == (4, 0, None)
    done = store.append(batch)
    assert (done.num_appended, done.num_duplicates) == (predicted.num_appended, predicted.num_duplicates)
    again = store.check(batch + [started("b")])  # a retry is all duplicates; the new event is not
    assert (again.num_appended, again.num_duplicates, again.duplicate_indices) == (1, 4, (0, 1, 2, 3))


@pytest.mark.parametrize("batch, rule, index", [
    ([started("a"), gen("a", 1, [1], [2])], "seq_gap", 1),
    ([gen("a", 0, [1], [2])], "unknown_trajectory", 0),
    ([started("a"), started("a", group_id="other")], None, 1),
])
def test_check_refuses_what_append_refuses(store, batch, rule, index):
    before = snapshot(store)
    with pytest.raises(ValidationError) as checked:
        store.check(batch)
    with pytest.raises(ValidationError) as appended:
        store.append(batch)
    assert snapshot(store) == before
    assert type(checked.value) is type(appended.value) and str(checked.value) == str(appended.value)
    assert checked.value.index == index and (rule is None or checked.value.rule == rule)


def test_checker_threads_state_through_batches(store):
    store.append([started("a")])
    checker = store.checker()
    assert checker.check([gen("a", 0, [1], [2])]).num_appended == 1
    assert checker.check([gen("a", 1, [1, 2, 3], [4]), finished("a")]).num_appended == 2
    with pytest.raises(ValidationError) as info:  # checked alone, seq 1 comes before seq 0
        store.check([gen("a", 1, [1, 2, 3], [4])])
    assert info.value.index == 0
    with pytest.raises(ConflictError):  # same identity as an earlier batch, other content
        checker.check([gen("a", 0, [9], [9])])
    assert snapshot(store)["counts"]["events"] == 1
