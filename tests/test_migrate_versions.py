"""Migrations on both backends: a fresh database steps through every revision,
and a store at 0002 (the views built before 0004's columns existed) upgrades to
head and keeps working. A migration is frozen: it imports nothing from the
package, the views at head are exactly trajstore.inspect.views', and a store
upgraded one revision at a time ends with the schema of a direct upgrade."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

import trajstore
from trajstore.log._migrate import alembic_config
from trajstore.inspect import views as views_module
from trajstore.inspect.views import READER_ROLE, VIEW_NAMES
from tests.helpers import finished, gen, started


def _migrate(engine, target: str, *, down: bool = False) -> None:
    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        (command.downgrade if down else command.upgrade)(cfg, target)


def _views_answer(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {v: conn.execute(text(f"SELECT count(*) FROM {v}")).scalar_one() for v in VIEW_NAMES}


def _columns(engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


NEW_EVENT_COLUMNS = {"min_model_version", "version_spans", "metadata"}


def test_downgrade_below_0007_is_refused_once_events_were_re_pointed(store_url, tmp_path):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    store.append([started("a"), gen("a", 0, [1], [2, 3]), finished("a")])
    store.materialize()
    store.close()
    engine = create_engine(store_url)
    try:
        with pytest.raises(RuntimeError, match="cannot downgrade below 0007: 1 events"):
            _migrate(engine, "0006", down=True)
        assert "segment_kind" in _columns(engine, "events")  # nothing was dropped
    finally:
        engine.dispose()


def test_a_fresh_database_steps_through_every_revision(store_url):
    engine = create_engine(store_url)
    try:
        _migrate(engine, "0001")
        _migrate(engine, "0002")
        assert _views_answer(engine) == dict.fromkeys(VIEW_NAMES, 0)
        assert not NEW_EVENT_COLUMNS & _columns(engine, "events")
        _migrate(engine, "head")
        assert _views_answer(engine) == dict.fromkeys(VIEW_NAMES, 0)
        assert NEW_EVENT_COLUMNS <= _columns(engine, "events")
        assert "finish_reason" in _columns(engine, "samples")
    finally:
        engine.dispose()


def test_a_0002_store_with_data_upgrades_to_head(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    store.append([started("a"), gen("a", 0, [1], [2, 3], version=3, finish_reason="stop"),
                  gen("a", 1, [1, 2, 3, 4], [5], version=4), finished("a")])
    # Not materialized before the downgrade: 0007's downgrade refuses a store whose
    # events were re-pointed into sample segments (revisions before it cannot read them).
    store.close()
    engine = create_engine(store_url)
    try:
        _migrate(engine, "0002", down=True)  # what a store made before 0004 looks like
        assert not NEW_EVENT_COLUMNS & _columns(engine, "events")
        assert _views_answer(engine)["generation_events"] == 2
        with engine.begin() as conn:  # an event appended by the old code: no min_model_version then
            conn.execute(text("UPDATE events SET model_version = 6 WHERE seq = 1"))
        _migrate(engine, "head")
        assert _views_answer(engine) == {"generation_events": 2, "trajectory_summary": 1, "sample_summary": 0,
                                         "model_version_stats": 2}
        with engine.connect() as conn:
            got = conn.execute(text("SELECT seq, min_model_version, model_version FROM events "
                                    "WHERE type = 'generation' ORDER BY seq")).all()
            summary = conn.execute(text("SELECT min_model_version, max_model_version, last_finish_reason "
                                        "FROM trajectory_summary")).one()
        assert [tuple(r) for r in got] == [(0, 3, 3), (1, 6, 6)]  # filled from model_version
        assert tuple(summary) == (3, 6, None)
    finally:
        engine.dispose()
    store = trajstore.connect(store_url, payload=payload)  # and the upgraded store keeps working
    store.append([started("b"), gen("b", 0, [1], [2, 3], token_model_versions=[6, 7], version=7), finished("b")])
    store.materialize()
    # a is folded after the upgrade, so its seq 1 has the version the old code's row says (6)
    assert [(s.trajectory_id, s.min_model_version, s.max_model_version) for s in store.samples()] == \
        [("a", 3, 6), ("b", 6, 7)]
    store.close()


def test_sample_segments_written_before_0004_still_read():
    """Segments have no migration: old ones lack logprobs_mask and finish_reason."""
    import numpy as np

    from trajstore.sample._codec import sample_table, samples_from_table
    from trajstore.events import parse_event
    from trajstore.fold import fold

    gens = [parse_event(gen("t", 0, [1], [2, 3], logprobs=[-0.5, -1.0], finish_reason="stop")),
            parse_event(gen("t", 1, [1, 2, 3, 4], [5]))]
    [s] = fold(gens, trajectory_id="t").samples
    old = sample_table([s]).drop_columns(["logprobs_mask", "finish_reason"])
    [back] = samples_from_table(old)
    np.testing.assert_array_equal(back.logprobs_mask, [True, True, False, False])  # nonzero logprobs
    assert back.logprobs_mask.dtype == np.bool_ and back.finish_reason is None
    [same] = samples_from_table(sample_table([s]))
    assert same.equals(s)


def test_log_segments_written_before_0004_still_read():
    """Old log segments have no token_model_versions column: every token has model_version."""
    from trajstore._append.admission import StoredGeneration
    from trajstore._append.facts import generations_from_log, segment_table
    from trajstore.events import parse_event
    from trajstore.payload import SegmentRows

    g = parse_event(gen("t", 0, [1], [2, 3], version=4, finish_reason="stop"))
    table = segment_table([StoredGeneration(g, 0, None, 0)]).drop_columns(["token_model_versions"])
    row = {"trajectory_id": "t", "seq": 0, "segment": "s", "segment_row": 0, "prefix_len": 0, "model_version": 4,
           "routes_start": None, "routes_dtype": None, "num_route_rows": None, "reward": None,
           "finish_reason": "stop", "event_id": None}  # an index row from before 0004: no metadata key
    [back] = generations_from_log([row], {"s": SegmentRows(table, {0: 0})}, None)
    assert back.token_model_versions is None and back.metadata is None and back.model_version == 4
    assert list(back.output_ids) == [2, 3] and back.finish_reason == "stop"


def _generation_rows(engine, sql: str) -> list[tuple]:
    with engine.connect() as conn:
        return [(r[0], r[1], r[2], bool(r[3])) for r in conn.execute(text(sql)).all()]


def test_a_0005_store_upgrades_with_the_fold_outcome_backfilled(store_url, tmp_path):
    """0006 stores the fold step's outcome; a store made before it gets the values
    its views derived from prefix_len, and goes on appending from them."""
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    store.append([started("a"), gen("a", 0, [1], [2, 3]), gen("a", 1, [1, 2, 3, 4], [5]),  # merge
                  gen("a", 2, [9, 9], [8]), gen("a", 3, [9, 9, 8], []), gen("a", 4, [9], [7]),  # mismatch, merge,
                  finished("a"),                                             # and a shorter prompt
                  started("b"), gen("b", 0, [5], [6]), gen("b", 1, [7], [8]),  # b stays running
                  started("c")])  # no generation at all
    store.close()  # not materialized: below 0007 a folded event's tokens could not be read
    engine = create_engine(store_url)
    stored_sql = "SELECT trajectory_id, seq, sample_index, is_merged FROM events WHERE type = 'generation' ORDER BY position"
    view_sql = "SELECT trajectory_id, seq, sample_index, is_merged FROM generation_events ORDER BY position"
    try:
        admitted = _generation_rows(engine, stored_sql)
        assert admitted == [("a", 0, 0, False), ("a", 1, 0, True), ("a", 2, 1, False), ("a", 3, 1, True),
                            ("a", 4, 2, False), ("b", 0, 0, False), ("b", 1, 1, False)]
        _migrate(engine, "0005", down=True)
        assert not {"sample_index", "is_merged"} & _columns(engine, "events")
        assert "num_samples" not in _columns(engine, "trajectories")
        derived = _generation_rows(engine, view_sql)  # what the views said before 0006
        with engine.connect() as conn:
            summary = dict(conn.execute(text("SELECT trajectory_id, num_samples FROM trajectory_summary")).all())
        _migrate(engine, "head")
        assert _generation_rows(engine, stored_sql) == derived == admitted
        assert _generation_rows(engine, view_sql) == derived
        with engine.connect() as conn:
            tails = dict(conn.execute(text("SELECT trajectory_id, num_samples FROM trajectories")).all())
            again = dict(conn.execute(text("SELECT trajectory_id, num_samples FROM trajectory_summary")).all())
        assert tails == summary == again == {"a": 3, "b": 2, "c": 0}
    finally:
        engine.dispose()
    store = trajstore.connect(store_url, payload=payload)  # the upgraded tail goes on counting samples
    store.append([gen("b", 2, [7, 8], [1]), gen("b", 3, [3], [4]), finished("b"),
                  gen("c", 0, [1], [2]), finished("c")])
    assert store.trajectory_state("b").num_samples == 3
    store.materialize()
    assert [(s.trajectory_id, s.sample_index) for s in store.samples() if s.trajectory_id != "a"] == \
        [("b", 0), ("b", 1), ("b", 2), ("c", 0)]
    store.close()


def test_0008_renames_the_concurrency_counter_and_keeps_its_value(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    store.append([started("a"), gen("a", 0, [1], [2, 3], version=3)])
    store.close()
    engine = create_engine(store_url)
    try:
        _migrate(engine, "0005", down=True)  # a store made before the rename
        assert "version" in _columns(engine, "trajectories") and "revision" not in _columns(engine, "trajectories")
        _migrate(engine, "head")
        assert "revision" in _columns(engine, "trajectories") and "version" not in _columns(engine, "trajectories")
        assert _views_answer(engine)["trajectory_summary"] == 1
        with engine.connect() as conn:
            assert conn.execute(text("SELECT revision FROM trajectories")).scalar_one() == 2  # started + one call
    finally:
        engine.dispose()
    store = trajstore.connect(store_url, payload=payload)  # the guarded update matches the renamed counter
    store.append([gen("a", 1, [1, 2, 3, 4], [5], version=4), finished("a")])
    assert store.trajectory_state("a").revision == 4 and store.trajectory_state("a").status == "completed"
    store.close()


def test_a_0008_store_upgrades_with_route_rows_resent_backfilled(store_url, tmp_path):
    """0009 adds the drift columns: resent is what admission dropped
    (num_route_rows_sent - num_route_rows), drifted is NULL (never measured)."""
    import numpy as np

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    r = np.arange(8, dtype=np.uint8).reshape(8, 1, 1)
    store.append([started("a"), gen("a", 0, [1, 2, 3, 4, 5], [], routed_experts=r[:4]),
                  gen("a", 1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [], routed_experts=r), gen("a", 2, [7], [8])])
    store.close()
    engine = create_engine(store_url)
    try:
        _migrate(engine, "0008", down=True)
        assert "route_rows_resent" not in _columns(engine, "events")
        assert _views_answer(engine)["generation_events"] == 3  # 0006's views, recreated
        _migrate(engine, "head")
        with engine.connect() as conn:
            got = conn.execute(text("SELECT seq, route_rows_resent, route_rows_drifted FROM generation_events "
                                    "ORDER BY seq")).all()
        assert [tuple(r) for r in got] == [(0, 0, None), (1, 4, None), (2, None, None)]
    finally:
        engine.dispose()


def test_0010_round_trip_keeps_positions_unique(store_url, tmp_path):
    """Down to 0009 (undoing 0010 and what follows) and up again: the recorded payload location goes and is recorded
    again at the next open; on PostgreSQL the counter row is moved past every position
    the sequence handed out, and the sequence starts after it again, so later appends
    never reuse a position."""
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    store.append([started("a"), gen("a", 0, [1], [2]), finished("a")])
    engine = store.log.write_engine
    store.close()
    _migrate(engine, "0009", down=True)
    assert "store_settings" not in inspect(engine).get_table_names()
    store = trajstore.connect(store_url, payload=payload)  # upgraded again; location recorded again
    store.append([started("b"), gen("b", 0, [1], [2]), finished("b")])
    with store.log.read_engine.connect() as conn:
        positions = [p for (p,) in conn.execute(text("SELECT position FROM events ORDER BY position"))]
    assert len(positions) == len(set(positions)) == 6 and positions[:3] == [1, 2, 3]
    assert store.materialize().num_trajectories == 2
    assert trajstore.connect(store_url).payload.location == store.payload.location
    store.close()


# -- a migration is frozen -------------------------------------------------------------------------------------------

VERSIONS_DIR = Path(trajstore.__file__).resolve().parent / "migrations" / "versions"


def _imported_modules(path: Path) -> set[str]:
    """Every module a migration file imports, statically or through importlib.import_module/__import__."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names.add(str(node.args[0].value))
    return names


def test_no_migration_imports_the_package(tmp_path):
    """A migration must do tomorrow what it does today: it imports nothing from trajstore (the live view
    module, the fold, ...), whose code moves on. An older migration's views are reached by loading that
    migration's own file, as 0004, 0006 and 0009 do for their downgrades."""
    files = sorted(VERSIONS_DIR.glob("[0-9]*.py"))
    assert len(files) >= 11
    offending = {f.name: sorted(m for m in _imported_modules(f) if m.split(".")[0] == "trajstore" or m.startswith("."))
                 for f in files}
    assert {name: mods for name, mods in offending.items() if mods} == {}
    probe = tmp_path / "0099_probe.py"  # the check sees each way of importing
    probe.write_text("from trajstore.inspect import views\nimport trajstore.fold as f\nfrom . import x\n"
                     "import importlib\nimportlib.import_module('trajstore.events')\n")
    assert _imported_modules(probe) == {"trajstore.inspect", "trajstore.fold", ".", "importlib", "trajstore.events"}


@pytest.fixture(params=[pytest.param("sqlite", id="sqlite"),
                        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)])
def two_fresh_urls(request: pytest.FixtureRequest, tmp_path: Path):
    """Two empty databases on one backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
        return
    cluster = request.getfixturevalue("pg_cluster")
    urls = cluster.create_database(), cluster.create_database()
    yield urls
    for url in urls:
        cluster.drop_database(url.rsplit("/", 1)[1])


def _stored_views(conn) -> dict[str, str]:
    """Each view's definition as the database keeps it (SQLite: the CREATE text; PostgreSQL: pg_views)."""
    if conn.dialect.name == "sqlite":
        return dict(conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'view'")).all())
    return dict(conn.execute(text("SELECT viewname, definition FROM pg_views "
                                  "WHERE schemaname = current_schema()")).all())


def _schema(conn) -> dict[str, object]:
    """The schema a migration leaves: objects, view definitions and, on PostgreSQL, every grant."""
    if conn.dialect.name == "sqlite":
        return {"objects": sorted(map(tuple, conn.execute(text(
            "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")).all()))}
    rows = {
        "columns": "SELECT table_name, column_name, ordinal_position, data_type, is_nullable, column_default "
                   "FROM information_schema.columns WHERE table_schema = current_schema()",
        "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()",
        "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
                       "WHERE connamespace = current_schema()::regnamespace",
        "acl": "SELECT relname, relkind, relacl::text FROM pg_class WHERE relnamespace = current_schema()::regnamespace",
        "schema_acl": "SELECT nspacl::text FROM pg_namespace WHERE nspname = current_schema()",
        "default_acl": "SELECT defaclrole::regrole::text, defaclobjtype, defaclacl::text FROM pg_default_acl",
        "reader_role": f"SELECT rolname, rolcanlogin, rolsuper FROM pg_roles WHERE rolname = '{READER_ROLE}'",
    }
    got: dict[str, object] = {k: sorted(map(tuple, conn.execute(text(q)).all())) for k, q in rows.items()}
    got["views"] = _stored_views(conn)
    return got


def _views_and_grants(schema: dict[str, object]) -> dict[str, object]:
    if "objects" in schema:
        return {"views": [o for o in schema["objects"] if o[0] == "view"]}
    return {k: v for k, v in schema.items() if k in ("views", "acl", "schema_acl", "default_acl", "reader_role")}


def _revisions() -> list[str]:
    return [s.revision for s in reversed(list(ScriptDirectory.from_config(alembic_config()).walk_revisions()))]


def test_head_views_are_the_view_module_s(two_fresh_urls):
    """The newest migration that (re)creates the views freezes exactly what trajstore.inspect.views builds:
    changing that module without a migration that freezes the new SQL fails here."""
    url, _ = two_fresh_urls
    engine = create_engine(url)
    drifted = ("trajstore.inspect.views differs from the views the newest migration freezes: "
               "add a migration that freezes the new SQL in its own file (docs/design.md, Migrations)")
    try:
        _migrate(engine, "head")
        with engine.connect() as conn:
            dialect = conn.dialect.name
            migrated = _schema(conn)
            stored = _stored_views(conn)
        assert set(VIEW_NAMES) <= set(stored)  # and 0011's projection_sample_summary, frozen there
        if dialect == "sqlite":  # SQLite keeps the statement's text as run
            assert {n: stored[n] for n in VIEW_NAMES} == {
                n: f"CREATE VIEW {n} AS\n{views_module.view_sql(n, dialect)}" for n in VIEW_NAMES}, drifted
        with engine.begin() as conn:  # PostgreSQL keeps its own rendering: compare it with the module's, made here
            views_module.drop_views(lambda sql: conn.execute(text(sql)))
            views_module.create_views(lambda sql: conn.execute(text(sql)), dialect)
        with engine.connect() as conn:
            assert _schema(conn) == migrated, drifted  # definitions, and on PostgreSQL the views' grants too
        if dialect == "postgresql":
            assert migrated["reader_role"] == [(READER_ROLE, False, False)]
            acl = {name: a for name, kind, a in migrated["acl"] if kind == "v"}
            assert set(VIEW_NAMES) <= set(acl) and all(f"{READER_ROLE}=r/" in a for a in acl.values())
    finally:
        engine.dispose()


def test_stepwise_upgrade_ends_where_a_direct_one_does(two_fresh_urls):
    """From 0001 one revision at a time (what an old store goes through), and down to 0001 and up again:
    the same tables, views and grants as a fresh database upgraded to head at once."""
    stepwise_url, direct_url = two_fresh_urls
    stepwise, direct = create_engine(stepwise_url), create_engine(direct_url)
    try:
        for revision in _revisions():
            _migrate(stepwise, revision)
        _migrate(direct, "head")
        with direct.connect() as conn:
            expected = _schema(conn)
        with stepwise.connect() as conn:
            assert _schema(conn) == expected
        _migrate(stepwise, "0001", down=True)
        with stepwise.connect() as conn:
            assert not _stored_views(conn)
        _migrate(stepwise, "head")
        with stepwise.connect() as conn:  # tables rebuilt by a downgrade may be spelled differently (SQLite's
            again = _schema(conn)         # quoted name, PostgreSQL's column numbers): the views and grants are not
        assert _views_and_grants(again) == _views_and_grants(expected)
    finally:
        stepwise.dispose()
        direct.dispose()


def _migration_module(filename: str):
    spec = importlib.util.spec_from_file_location(f"trajstore_migration_{filename[:4]}", VERSIONS_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_view_module_describes_the_reader_role_0002_makes():
    """reader_role_sql (documented, public) says what 0002 runs: the role's statements were frozen there."""
    m = _migration_module("0002_inspection_views_reader_role.py")
    assert views_module.reader_role_sql() == [m.READER_ROLE_SQL]
    assert views_module.drop_reader_grants_sql() == [m.DROP_READER_GRANTS_SQL]
    assert m.VIEW_NAMES == views_module.VIEW_NAMES


def test_0021_drops_the_per_sample_lineage_index_on_sqlite_only(store_url):
    """The trainer's consumption rows keep their per-sample index on PostgreSQL only (on
    SQLite it cost the record a WAL page per sample: docs/benchmarks.md, "Training
    lineage"); the rows stay, one trajectory's still answer, and the downgrade puts it back."""
    engine = create_engine(store_url)
    sqlite = engine.dialect.name == "sqlite"

    def indexed() -> bool:
        return "ix_lineage_step_samples_sample" in {ix["name"] for ix in inspect(engine).get_indexes(
            "lineage_step_samples")}

    try:
        _migrate(engine, "0020")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO lineage_step_samples (run, step, rank, attempt, trajectory_id, "
                              "sample_index, ordinal, response_len, min_model_version, max_model_version) "
                              "VALUES ('r', 1, 0, 0, 't1', 0, 0, 5, 1, 2), ('r', 1, 0, 0, 't2', 0, 1, 3, 1, 1)"))
        assert indexed()
        _migrate(engine, "0021")
        assert indexed() is not sqlite
        with engine.connect() as conn:
            assert conn.execute(text("SELECT step, ordinal FROM lineage_step_samples WHERE trajectory_id = 't2'")
                                ).fetchall() == [(1, 1)]
        _migrate(engine, "0020", down=True)
        assert indexed()
    finally:
        engine.dispose()


def test_0026_turns_the_expert_load_rows_into_one_array_per_version_and_back(store_url):
    """0026: ``agg_expert_load``'s (version, layer, expert) rows become one counts array per
    version (a missing cell counts 0); the downgrade gives the rows back."""
    import numpy as np

    engine = create_engine(store_url)
    try:
        _migrate(engine, "0025")
        cells = {(3, 0, 0): 5, (3, 0, 1): 2, (3, 1, 3): 7, (4, 2, 1): 1}
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO agg_expert_load (model_version, layer, expert, routed) "
                              "VALUES (:v, :l, :e, :n)"),
                         [{"v": v, "l": l_, "e": e, "n": n} for (v, l_, e), n in cells.items()])
        _migrate(engine, "0026")
        assert _columns(engine, "agg_expert_load") == {"model_version", "layers", "experts", "counts"}
        with engine.connect() as conn:
            got = {int(v): np.frombuffer(bytes(c), "<i8").reshape(int(layers), int(experts)) for v, layers, experts, c
                   in conn.execute(text("SELECT model_version, layers, experts, counts FROM agg_expert_load")).all()}
        assert sorted(got) == [3, 4] and got[3].shape == (2, 4) and got[4].shape == (3, 2)
        assert got[3].tolist() == [[5, 2, 0, 0], [0, 0, 0, 7]] and int(got[4].sum()) == 1 and got[4][2, 1] == 1
        _migrate(engine, "0025", down=True)
        with engine.connect() as conn:
            back = {(int(v), int(l_), int(e)): int(n) for v, l_, e, n in conn.execute(text(
                "SELECT model_version, layer, expert, routed FROM agg_expert_load")).all()}
        assert {k: n for k, n in back.items() if n} == cells and len(back) == 2 * 4 + 3 * 2
        _migrate(engine, "head")
    finally:
        engine.dispose()


def test_0027_stores_the_expert_load_arrays_with_lz4_and_reads_them_the_same(store_url):
    """0027 (PostgreSQL): the expert-load arrays' column is compressed with lz4 (uncompressed
    where the server has no lz4) instead of the default pglz; an array written before and one
    written after read back byte for byte; the downgrade puts the server's default back."""
    import numpy as np

    engine = create_engine(store_url)
    postgres = engine.dialect.name == "postgresql"

    def method() -> dict[str, tuple]:
        with engine.connect() as conn:
            return {t: conn.execute(text("SELECT a.attcompression, a.attstorage FROM pg_attribute a "
                                         f"WHERE a.attrelid = '{t}'::regclass AND a.attname = 'counts'")).one()
                    for t in ("agg_expert_load", "agg_expert_load_delta")}

    try:
        _migrate(engine, "0026")
        arrays = [np.arange(48 * 128, dtype="<i8").reshape(48, 128) * k for k in (1, 3)]
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO agg_expert_load_delta (model_version, layers, experts, counts) "
                              "VALUES (1, 48, 128, :c)"), {"c": arrays[0].tobytes()})
        before = method() if postgres else None
        _migrate(engine, "0027")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO agg_expert_load_delta (model_version, layers, experts, counts) "
                              "VALUES (2, 48, 128, :c)"), {"c": arrays[1].tobytes()})
            got = dict(conn.execute(text("SELECT model_version, counts FROM agg_expert_load_delta")).all())
        assert {int(v): bytes(c) for v, c in got.items()} == {1: arrays[0].tobytes(), 2: arrays[1].tobytes()}
        if postgres:
            with engine.connect() as conn:
                lz4 = conn.execute(text("SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                                        "WHERE name = 'default_toast_compression'")).scalar()
            assert set(method().values()) == ({("l", "x")} if lz4 else {("", "e")}) and before != method()
            assert set(before.values()) == {("", "x")}
            _migrate(engine, "0026", down=True)
            assert method() == before
        _migrate(engine, "head")
    finally:
        engine.dispose()
