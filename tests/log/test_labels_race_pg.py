"""On PostgreSQL, positions come from a sequence and appends run side by side.
The held-back rule decides from positions alone (docs/materializer.md, "Held
back on a version label"), so an append that maps a label and one that
finishes a trajectory waiting on it must see each other in position order.
Here the finish has taken its position and is still inside its transaction
(a trigger makes its events INSERT sleep) when the label arrives: the label's
append must wait for it and then release the trajectory, never leave it held
back for good."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import create_engine, text

import trajstore
from tests.helpers import finished, started

pytestmark = pytest.mark.postgres

SLOW_FINISH = """
CREATE FUNCTION slow_finish() RETURNS trigger AS $$
BEGIN
    IF NEW.type = 'trajectory_finished' THEN PERFORM pg_sleep(2); END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER slow_finish BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION slow_finish();
"""


def test_a_label_mapped_while_a_finish_commits_releases_it(fresh_pg_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(fresh_pg_url, payload=payload)
    store.append([started("t"), {"type": "generation", "trajectory_id": "t", "seq": 0, "prompt_ids": [1],
                                 "output_ids": [2, 3], "weight_versions": [{"version": "step-1", "start": 0,
                                                                            "end": 2}]}])
    engine = create_engine(fresh_pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(SLOW_FINISH)
    finisher = trajstore.connect(fresh_pg_url, payload=payload)
    errors: list[BaseException] = []

    def finish() -> None:
        try:
            finisher.append([finished("t")])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=finish)
    thread.start()
    deadline = time.monotonic() + 10
    with engine.connect() as conn:  # the finish is inside its INSERT (positions taken)
        while not conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'")).scalar():
            assert time.monotonic() < deadline, "the finish never reached its INSERT"
            time.sleep(0.05)
    store.append([{"type": "version_label", "label": "step-1", "model_version": 1}])
    thread.join(30)
    assert not thread.is_alive() and errors == []
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_held_back) == (1, 0)
    [sample] = list(store.samples())
    assert sample.token_model_versions.tolist() == [1, 1]
    with engine.connect() as conn:
        held = conn.execute(text("SELECT count(*) FROM trajectory_summary WHERE is_held_back")).scalar()
    assert held == 0
    finisher.close()
    store.close()
    engine.dispose()
