"""SPEC "Versions" in the store, on both backends: the engine's ``weight_versions``
spans, the label map that ``version_label`` events fill, and trajectories held
back (visibly) until the labels they use are mapped."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import text

from trajstore.errors import ConflictError, ValidationError
from tests.helpers import finished, started


def spans(*triples):
    return [{"version": v, "start": a, "end": b} for v, a, b in triples]


def call(tid, seq, prompt, output, **kw):
    return {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": list(prompt),
            "output_ids": list(output), **kw}


def label(name, version, **kw):
    return {"type": "version_label", "label": name, "model_version": version, **kw}


def sql(store, query):
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query)).all()]


def versions_of(store):
    return {(s.trajectory_id, s.sample_index): (s.token_model_versions.tolist(), s.min_model_version,
                                                 s.max_model_version) for s in store.samples()}


def test_default_and_decimal_labels_resolve_as_they_arrive(store):
    store.append([
        started("a"),
        call("a", 0, [1], [2, 3, 4], model_version=3, weight_versions=spans(("default", 0, 2), ("7", 2, 3))),
        call("a", 1, [1, 2, 3, 4, 5], [6, 7], weight_versions=spans((8, 0, 1), ("9", 1, 2))),
        finished("a"),
    ])
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_held_back) == (1, 0)
    assert versions_of(store) == {("a", 0): ([3, 3, 7, -1, 8, 9], 3, 9)}
    # the spans stay as sent, labels verbatim (a string stays a string, an int an int)
    rows = sql(store, "SELECT seq, model_version, min_model_version, unresolved_label FROM generation_events "
                      "ORDER BY seq")
    assert rows == [(0, 7, 3, None), (1, 9, 8, None)]
    [(raw,)] = sql(store, "SELECT weight_versions FROM events WHERE seq = 1 AND type = 'generation'")
    import json
    assert (json.loads(raw) if isinstance(raw, str) else raw) == spans((8, 0, 1), ("9", 1, 2))


@pytest.mark.parametrize("event, rule", [
    (call("a", 0, [1], [2, 3], weight_versions=spans(("default", 0, 2))), "weight_versions"),  # no model_version
    (call("a", 0, [1], [2, 3], weight_versions=spans(("9", 0, 1), ("8", 1, 2))), "weight_versions"),  # goes back
    (call("a", 0, [1], [2, 3], weight_versions=spans(("9", 0, 1))), "weight_versions"),  # does not tile
    (call("a", 0, [1], [2, 3], weight_versions=spans(("-1", 0, 2))), "weight_versions"),  # negative
    (call("a", 0, [1], [2, 3], weight_versions=spans((True, 0, 2))), "weight_versions"),
    (call("a", 0, [1], [2, 3], weight_versions=[{"version": "x", "start": 0, "end": 2, "v": 1}]),
     "weight_versions"),
    (call("a", 0, [1], [], weight_versions=[]), "missing_field"),  # nothing says the version
    (call("a", 0, [1], [2]), "missing_field"),
    (label("7", 7), "version_label"),  # a decimal label is its own version
    (label("default", 1), "version_label"),
])
def test_bad_versions_are_refused_with_a_rule(store, event, rule):
    with pytest.raises(ValidationError) as e:
        store.append([started("a"), event])
    assert e.value.rule == rule and e.value.index == 1
    assert "\n" not in str(e.value)
    assert store.log.head_position() == 0


def test_token_model_versions_win_over_spans(store):
    store.append([started("a"), call("a", 0, [1], [2, 3], token_model_versions=[4, 5],
                                     weight_versions=spans(("step-x", 0, 2))), finished("a")])
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("a", 0): ([4, 5], 4, 5)}


def test_a_label_mapped_first_resolves_at_admission(store):
    store.append([label("step-42", 42)])
    store.append([started("a"), call("a", 0, [1], [2, 3], weight_versions=spans(("step-42", 0, 2))), finished("a")])
    assert sql(store, "SELECT model_version, unresolved_label FROM generation_events") == [(42, None)]
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("a", 0): ([42, 42], 42, 42)}


def test_a_label_mapped_later_holds_the_trajectory_back_visibly_then_folds_once(store):
    store.append([started("a"), call("a", 0, [1], [2, 3, 4], model_version=5,
                                     weight_versions=spans(("default", 0, 1), ("step-6", 1, 3))), finished("a"),
                  started("b"), call("b", 0, [1], [2], model_version=1), finished("b")])
    assert store.log.count_events(after_position=0, types=["generation"]) == 2  # stored, never dropped
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_held_back) == (1, 1)
    assert [s.trajectory_id for s in store.samples()] == ["b"]
    assert sql(store, "SELECT trajectory_id, unresolved_label, is_held_back FROM trajectory_summary "
                      "ORDER BY trajectory_id") == [("a", "step-6", True), ("b", None, False)]
    assert sql(store, "SELECT trajectory_id, unresolved_label FROM generation_events WHERE unresolved_label "
                      "IS NOT NULL") == [("a", "step-6")]
    assert store.info()["unresolved_version_labels"] == [
        {"label": "step-6", "trajectories": 1, "held_back_trajectories": 1}]
    assert store.materialize().num_trajectories == 0  # still waiting

    store.append([label("step-6", 6)])
    assert sql(store, "SELECT trajectory_id, unresolved_label, is_held_back FROM trajectory_summary "
                      "WHERE trajectory_id = 'a'") == [("a", None, False)]
    assert store.info()["unresolved_version_labels"] == []
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_held_back) == (1, 0)
    assert versions_of(store)[("a", 0)] == ([5, 6, 6], 5, 6)
    assert store.materialize().num_trajectories == 0  # exactly once
    assert len(list(store.samples())) == 2
    # the released samples come after everything materialized before (a reader's order holds)
    order = [s.trajectory_id for s in store.samples()]
    assert order == ["b", "a"]


def test_a_label_mapped_before_the_first_materialize_folds_once(store):
    store.append([started("a"), call("a", 0, [1], [2], weight_versions=spans(("s", 0, 1))), finished("a")])
    store.append([label("s", 3)])
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_held_back) == (1, 0)
    assert versions_of(store) == {("a", 0): ([3], 3, 3)}
    assert store.materialize().num_trajectories == 0


def test_a_label_mapped_while_running_folds_at_the_finish(store):
    store.append([started("a"), call("a", 0, [1], [2], weight_versions=spans(("s", 0, 1)))])
    store.append([label("s", 3)])
    assert store.log.count_events(after_position=0, types=["trajectory_released"]) == 0
    store.append([call("a", 1, [1, 2, 9], [4], weight_versions=spans(("s", 0, 1))), finished("a")])
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("a", 0): ([3, -1, 3], 3, 3)}


def test_two_missing_labels_release_only_when_both_are_mapped(store):
    store.append([started("a"), call("a", 0, [1], [2, 3], weight_versions=spans(("p", 0, 1), ("q", 1, 2))),
                  finished("a")])
    assert store.materialize().num_held_back == 1
    store.append([label("q", 4)])
    assert sql(store, "SELECT unresolved_label FROM trajectory_summary") == [("p",)]
    assert store.materialize().num_trajectories == 0
    store.append([label("p", 2)])
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("a", 0): ([2, 4], 2, 4)}


def test_labels_that_resolve_backwards_make_the_trajectory_unfoldable_with_the_reason(store):
    store.append([started("a"), call("a", 0, [1], [2, 3], weight_versions=spans(("p", 0, 1), ("q", 1, 2))),
                  finished("a")])
    store.append([label("p", 5), label("q", 4)])
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable) == (0, 1)
    assert store.materialized.unfoldable_trajectories()["recent"][0]["rule"] == "weight_versions"


def test_version_label_identity_and_conflicts(store):
    assert store.append([label("s", 1)]).num_appended == 1
    assert store.append([label("s", 1)]).num_duplicates == 1  # an identical retry
    with pytest.raises(ConflictError):
        store.append([label("s", 2)])
    assert store.append([label("s", 1, event_id="e1")]).num_duplicates == 1  # the same mapping again: a no-op
    with pytest.raises(ConflictError) as e:
        store.append([label("t", 1), label("s", 3, event_id="e2")])
    assert e.value.index == 1
    with pytest.raises(ConflictError):
        store.append([label("u", 1, event_id="x"), label("u", 2, event_id="y")])  # within one batch
    assert sql(store, "SELECT label, model_version FROM version_labels ORDER BY label") == [("s", 1)]
    assert store.append([label("u", 7, event_id="x"), label("u", 7, event_id="y")]).num_appended == 1


def test_a_retried_generation_is_a_duplicate_after_its_label_was_mapped(store):
    batch = [started("a"), call("a", 0, [1], [2], weight_versions=spans(("s", 0, 1)))]
    store.append(batch)
    store.append([label("s", 3)])
    assert store.append(batch).num_duplicates == 2


def test_labels_in_the_same_batch_resolve_wherever_they_stand(store):
    store.append([started("a"), call("a", 0, [1], [2], weight_versions=spans(("s", 0, 1))), finished("a"),
                  label("s", 3)])
    assert sql(store, "SELECT model_version, unresolved_label FROM generation_events") == [(3, None)]
    assert store.materialize().num_trajectories == 1


def test_the_dry_run_threads_the_label_map_across_batches(store):
    check = store.checker()
    check.check([label("s", 3)])
    check.check([started("a"), call("a", 0, [1], [2], weight_versions=spans(("s", 0, 1)))])
    with pytest.raises(ConflictError):
        check.check([label("s", 4)])
    assert store.log.head_position() == 0


def test_spans_are_validated_per_token_shape():
    from trajstore._append.admission import resolve_weight_versions
    from trajstore.events import parse_event

    g = parse_event(call("a", 0, [1], [2, 3, 4, 5], model_version=1,
                         weight_versions=spans(("default", 0, 1), ("s", 1, 3), ("9", 3, 4))))
    same, missing = resolve_weight_versions(g, {})
    assert same is g and missing == ("s",)
    done, missing = resolve_weight_versions(g, {"s": 2})
    assert missing == () and done.token_model_versions.dtype == np.int32
    assert done.token_model_versions.tolist() == [1, 2, 2, 9] and done.model_version == 9


def test_labels_racing_finishes_and_materializers_fold_every_trajectory_once(store, store_url, tmp_path):
    """Writers finishing trajectories, a trainer mapping their labels and a
    materializer all run at once: each trajectory is folded exactly once, with
    its resolved versions, whichever came first."""
    import threading

    import trajstore

    n = 24
    payload = str(tmp_path / "payload")
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
        return run

    def writer():
        with trajstore.connect(store_url, payload=payload) as s:
            for i in range(n):
                s.append([started(f"t{i}"), call(f"t{i}", 0, [1], [2, 3],
                                                 weight_versions=spans((f"L{i}", 0, 1), ("default", 1, 2)),
                                                 model_version=100 + i),
                          finished(f"t{i}")])

    def trainer():
        with trajstore.connect(store_url, payload=payload) as s:
            for i in reversed(range(n)):
                s.append([label(f"L{i}", i)])

    def materializer():
        with trajstore.connect(store_url, payload=payload) as s:
            for _ in range(6):
                s.materialize()

    threads = [threading.Thread(target=guarded(f)) for f in (writer, trainer, materializer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.materialize()
    got = versions_of(store)
    assert got == {(f"t{i}", 0): ([i, 100 + i], i, 100 + i) for i in range(n)}
    assert store.info()["unresolved_version_labels"] == []
    released = store.log.count_events(after_position=0, types=["trajectory_released"])
    assert released <= n


def test_a_held_call_mixing_a_mapped_and_an_unmapped_label_folds_once_the_label_arrives(store):
    """The common async case: a call spans a weight update, its first label is
    mapped and the second is not yet. It folds whole once the second arrives."""
    store.append([label("ckpt-3", 3), started("t"),
                  call("t", 0, [1], [2, 3, 4], weight_versions=spans(("ckpt-3", 0, 2), ("ckpt-4", 2, 3))),
                  finished("t")])
    assert store.materialize().num_held_back == 1
    store.append([label("ckpt-4", 4)])
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable, stats.num_held_back) == (1, 0, 0)
    assert versions_of(store) == {("t", 0): ([3, 3, 4], 3, 4)}
    assert store.materialized.unfoldable_trajectories()["count"] == 0
    again = store.materialize()  # exactly once
    assert (again.num_trajectories, again.num_unfoldable) == (0, 0) and len(list(store.samples())) == 1


@pytest.mark.parametrize("later, expected", [
    # a second call under "default" + model_version, in a sample of its own
    (call("t", 1, [7], [8, 9], model_version=5, weight_versions=spans(("default", 0, 2))),
     {("t", 0): ([3, 3, 4], 3, 4), ("t", 1): ([5, 5], 5, 5)}),
    # a later call merged into the same sample, "default" + model_version after the held label
    (call("t", 1, [1, 2, 3, 4, 9], [5, 6], model_version=6, weight_versions=spans(("ckpt-4", 0, 1), ("default", 1, 2))),
     {("t", 0): ([3, 3, 4, -1, 4, 6], 3, 6)}),
    # a later call merged, its versions sent per token
    (call("t", 1, [1, 2, 3, 4, 9], [5], token_model_versions=[4]), {("t", 0): ([3, 3, 4, -1, 4], 3, 4)}),
])
@pytest.mark.parametrize("mapped", ["after_finish", "before_finish"])
def test_a_held_call_folds_with_whatever_else_its_trajectory_carries(store, later, expected, mapped):
    store.append([label("ckpt-3", 3), started("t"),
                  call("t", 0, [1], [2, 3, 4], weight_versions=spans(("ckpt-3", 0, 2), ("ckpt-4", 2, 3))), later])
    if mapped == "before_finish":
        store.append([label("ckpt-4", 4)])
    store.append([finished("t")])
    if mapped == "after_finish":
        assert store.materialize().num_held_back == 1
        store.append([label("ckpt-4", 4)])
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable, stats.num_held_back) == (1, 0, 0)
    assert versions_of(store) == expected
    assert store.materialize().num_trajectories == 0 and len(list(store.samples())) == len(expected)


def test_versions_sent_per_token_stay_when_a_label_they_came_with_is_mapped_later(store):
    """A call's explicit token_model_versions win over spans whose label did not
    resolve when it was appended; mapping that label later (to fold another held
    call) changes nothing in it."""
    store.append([started("t"), call("t", 0, [1], [2, 3], token_model_versions=[4, 4],
                                     weight_versions=spans(("s", 0, 2))),
                  call("t", 1, [1, 2, 3, 8], [9], weight_versions=spans(("s", 0, 1))), finished("t")])
    store.append([label("s", 9)])
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("t", 0): ([4, 4, -1, 9], 4, 9)}


# -- version forms agree (rule version_conflict), label conflicts are named ------------------

@pytest.mark.parametrize("fields, span", [
    # a boundary: the spans switch a token later than the per-token versions
    (dict(token_model_versions=[3, 3, 4], weight_versions=spans(("3", 0, 1), ("4", 1, 3))), "weight_versions[1] '4'"),
    # a value
    (dict(token_model_versions=[3, 3, 4], weight_versions=spans(("3", 0, 2), ("5", 2, 3))), "weight_versions[1] '5'"),
    # flat spans against varying versions, and the other way round
    (dict(token_model_versions=[3, 3, 4], weight_versions=spans(("3", 0, 3))), "weight_versions[0] '3'"),
    (dict(token_model_versions=[3, 3, 3], weight_versions=spans(("3", 0, 2), (4, 2, 3))), "weight_versions[1] 4"),
    # a label the map holds, and "default" (the event's model_version)
    (dict(token_model_versions=[3, 3, 3], weight_versions=spans(("3", 0, 2), ("ckpt-4", 2, 3))),
     "weight_versions[1] 'ckpt-4'"),
    (dict(token_model_versions=[3, 3, 4], model_version=4, weight_versions=spans(("default", 0, 2), ("4", 2, 3))),
     "weight_versions[0] 'default'"),
    # model_version sent with spans: the last token's version
    (dict(model_version=3, weight_versions=spans(("3", 0, 2), ("4", 2, 3))), "weight_versions[1] '4'"),
    (dict(model_version=3, weight_versions=spans(("3", 0, 2), ("ckpt-4", 2, 3), ("ckpt-9", 3, 3))),
     "weight_versions[1] 'ckpt-4'"),
    # model_version sent with per-token versions
    (dict(model_version=3, token_model_versions=[3, 3, 4]), "token_model_versions"),
])
def test_version_forms_that_disagree_are_refused_naming_the_span(store, fields, span):
    store.append([label("ckpt-4", 4)])
    head = store.log.head_position()
    batch = [started("a"), call("a", 0, [1], [2, 3, 4], **fields), finished("a")]
    for attempt in (lambda: store.append(batch), lambda: store.check(batch)):
        with pytest.raises(ValidationError) as e:
            attempt()
        assert (e.value.rule, e.value.index, e.value.trajectory_id) == ("version_conflict", 1, "a")
        assert span in str(e.value) and "\n" not in str(e.value)
    assert store.log.head_position() == head


def test_a_label_mapped_in_the_same_batch_is_judged_too(store):
    with pytest.raises(ValidationError) as e:
        store.append([started("a"), call("a", 0, [1], [2, 3], token_model_versions=[3, 3],
                                         weight_versions=spans(("s", 0, 2))), label("s", 4)])
    assert e.value.rule == "version_conflict" and "'s'" in str(e.value)
    assert store.log.head_position() == 0


def test_version_forms_that_agree_are_stored(store):
    store.append([label("ckpt-4", 4)])
    store.append([
        started("a"),
        call("a", 0, [1], [2, 3, 4], token_model_versions=[3, 3, 4], model_version=4,
             weight_versions=spans(("3", 0, 2), ("ckpt-4", 2, 3))),
        call("a", 1, [1, 2, 3, 4, 5], [6, 7], model_version=5, weight_versions=spans(("ckpt-4", 0, 1), ("5", 1, 2))),
        # "default" takes model_version: nothing else to agree with
        call("a", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9], model_version=5, weight_versions=spans(("default", 0, 1))),
        # a label not mapped yet is not judged (the call is held until it is)
        call("a", 3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], model_version=6,
             weight_versions=spans(("ckpt-6", 0, 1))),
        finished("a"),
    ])
    assert store.materialize().num_held_back == 1
    store.append([label("ckpt-6", 6)])
    assert store.materialize().num_trajectories == 1
    assert versions_of(store) == {("a", 0): ([3, 3, 4, -1, 4, 5, -1, 5, -1, 6], 3, 6)}


def _post_events(url, events):
    import httpx

    from trajstore.ingest.client import encode_events

    return httpx.post(f"{url}/v1/events", content=encode_events(events),
                      headers={"Content-Type": "application/json", "Authorization": "Bearer t"})


@pytest.mark.parametrize("via", ["store", "http"])
@pytest.mark.parametrize("event_id", [None, "e2"])
def test_a_remapped_label_names_the_label_and_both_versions(store, via, event_id):
    """Through ``Store.append`` and the HTTP ingest service: never "trajectory ''"."""
    first = label("ckpt-3", 3) if event_id is None else label("ckpt-3", 3, event_id="e1")
    again = label("ckpt-3", 4) if event_id is None else label("ckpt-3", 4, event_id=event_id)
    store.append([first])
    want = "version label 'ckpt-3' is already mapped to model_version 3, not 4"
    if via == "store":
        for batch, index in (([again], 0), ([label("x", 1), again], 1)):
            with pytest.raises(ConflictError) as e:
                store.append(batch)
            assert want in str(e.value) and "trajectory" not in str(e.value) and e.value.index == index
        with pytest.raises(ConflictError) as e:  # within one batch
            store.append([label("u", 1), label("u", 2)])
        assert "version label 'u' is already mapped to model_version 1, not 2" in str(e.value)
    else:
        pytest.importorskip("fastapi")
        from openai_upstream import serve_in_thread
        from trajstore.ingest.service import make_app

        with serve_in_thread(make_app(store, token="t")) as url:
            resp = _post_events(url, [again])
            assert resp.status_code == 409
            err = resp.json()["error"]
            assert want in err["message"] and "trajectory" not in err["message"] and err["index"] == 0
            resp = _post_events(url, [label("u", 1), label("u", 2)])
            assert resp.status_code == 409
            assert "version label 'u' is already mapped to model_version 1, not 2" in resp.json()["error"]["message"]
    assert sql(store, "SELECT label, model_version FROM version_labels") == [("ckpt-3", 3)]
