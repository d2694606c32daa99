"""The export is plain Arrow (SPEC "Exported columns"): DuckDB, Polars and
Hugging Face ``datasets`` read routes, masks and versions as numbers with no
trajstore code, and get exactly the samples the store holds."""

from __future__ import annotations

import glob

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trajstore
from trajstore.cli import main
from tests.helpers import finished, gen, started

L, K = 3, 2


def _routes(rng, rows: int, num_experts: int) -> np.ndarray:
    return rng.integers(0, num_experts, (rows, L, K))


def _trajectory(rng, tid: str, num_experts: int | None) -> list[dict]:
    """Two merged calls (the first spans versions 4 and 5, the second sends no logprobs), one mismatch."""
    routed = num_experts is not None
    r = (lambda rows: {"routed_experts": _routes(rng, rows, num_experts)}) if routed else (lambda rows: {})
    evs = [started(tid, **({"num_experts": num_experts} if routed else {}))]
    evs.append(gen(tid, 0, [1, 2, 3], [4, 5, 6, 7], version=5, token_model_versions=[4, 4, 5, 5],
                   logprobs=[-0.1, -0.2, -0.3, 0.0], finish_reason="length", **r(6)))
    evs.append(gen(tid, 1, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10], version=5, finish_reason="stop", **r(9)))
    evs.append(gen(tid, 2, [50, 51], [52], version=6, logprobs=[-1.5], **r(2)))
    return evs + [finished(tid)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    url = f"sqlite:///{tmp}/s.db"
    rng = np.random.default_rng(0)
    store = trajstore.connect(url)
    for i, experts in enumerate([16, 16, 300, None, 16]):  # uint8, uint16 and route-less layouts
        store.append(_trajectory(rng, f"t{i}", experts))
    store.materialize()
    assert main(["--store", url, "export", str(tmp / "out")]) == 0
    samples = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
    store.close()
    return tmp / "out", samples


def test_columns_are_plain_typed_arrow(exported):
    out, samples = exported
    files = sorted(glob.glob(f"{out}/*.parquet"))
    route_types = set()
    for f in files:
        schema = pq.read_schema(f)
        assert schema.field("loss_mask").type == pa.large_list(pa.uint8())
        assert schema.field("logprobs_mask").type == pa.large_list(pa.bool_())
        assert schema.field("routed_experts_mask").type == pa.large_list(pa.bool_())
        assert schema.field("finish_reason").type == pa.string()
        t = schema.field("routed_experts").type  # list<fixed_size_list<fixed_size_list<uintN, K>, L>>
        assert pa.types.is_large_list(t) and t.value_type.list_size == L
        assert t.value_type.value_type.list_size == K
        route_types.add(t.value_type.value_type.value_type)
    assert route_types == {pa.uint8(), pa.uint16()}
    assert "routed_experts_dtype" not in pq.read_schema(files[0]).names
    table = pq.read_table(files[0])
    [s] = [samples[(table.column("trajectory_id")[0].as_py(), table.column("sample_index")[0].as_py())]]
    np.testing.assert_array_equal(np.array(table.column("routed_experts")[0].as_py()), s.routed_experts)


def test_duckdb_unnests_routes_to_numbers(exported):
    duckdb = pytest.importorskip("duckdb")
    out, samples = exported
    for f in sorted(glob.glob(f"{out}/*.parquet")):
        # one row per (sample, token): the token's [layers, topk] expert ids
        rows = duckdb.sql(f"""
            SELECT trajectory_id, sample_index, generate_subscripts(routed_experts, 1) - 1 AS pos,
                   unnest(routed_experts) AS route
            FROM read_parquet('{f}') WHERE routed_experts IS NOT NULL ORDER BY ALL""").fetchall()
        for tid, index, pos, route in rows:
            np.testing.assert_array_equal(route, samples[(tid, index)].routed_experts[pos])
        totals = duckdb.sql(f"""
            SELECT trajectory_id, sample_index, sum(e)
            FROM (SELECT trajectory_id, sample_index, unnest(routed_experts, recursive := true) AS e
                  FROM read_parquet('{f}'))
            GROUP BY ALL""").fetchall()
        for tid, index, total in totals:
            routes = samples[(tid, index)].routed_experts
            assert total == (None if routes is None else int(routes.astype(np.int64).sum()))
    ((generated, reported),) = duckdb.sql(f"""
        SELECT count(*) FILTER (WHERE v >= 0), count(*) FILTER (WHERE m)
        FROM (SELECT unnest(token_model_versions) AS v, unnest(logprobs_mask) AS m
              FROM read_parquet('{out}/*.parquet', union_by_name = true))""").fetchall()
    assert generated == sum(int((s.token_model_versions >= 0).sum()) for s in samples.values())
    assert reported == sum(int(s.logprobs_mask.sum()) for s in samples.values())


def test_polars_reads_routes_as_arrays(exported):
    pl = pytest.importorskip("polars")
    out, samples = exported
    for f in sorted(glob.glob(f"{out}/*.parquet")):
        df = pl.read_parquet(f)
        routed = df["routed_experts"].null_count() < df.height
        if routed:
            assert isinstance(df.schema["routed_experts"].inner, pl.Array)
            assert df.schema["routed_experts"].inner.shape == (L, K)
        assert df.schema["logprobs_mask"] == pl.List(pl.Boolean)
        for row in df.iter_rows(named=True):
            s = samples[(row["trajectory_id"], row["sample_index"])]
            assert row["finish_reason"] == s.finish_reason
            assert row["logprobs_mask"] == s.logprobs_mask.tolist()
        for i, routes in enumerate(df["routed_experts"]):
            s = samples[(df["trajectory_id"][i], df["sample_index"][i])]
            if s.routed_experts is None:
                assert routes is None
            else:
                got = routes.to_numpy()
                assert got.dtype == s.routed_experts.dtype and got.shape == s.routed_experts.shape
                np.testing.assert_array_equal(got, s.routed_experts)


def test_hugging_face_datasets_reads_routes_as_numpy(exported):
    datasets = pytest.importorskip("datasets")
    out, samples = exported
    seen = 0
    for f in sorted(glob.glob(f"{out}/*.parquet")):
        ds = datasets.Dataset.from_parquet(f, cache_dir=str(out.parent / "hf-cache")).with_format("numpy")
        for row in ds:
            s = samples[(str(row["trajectory_id"]), int(row["sample_index"]))]
            if s.routed_experts is None:
                assert row["routed_experts"] is None
            else:
                assert row["routed_experts"].dtype.kind in "iu"  # numbers (the numpy formatter widens ints)
                np.testing.assert_array_equal(row["routed_experts"], s.routed_experts)
                np.testing.assert_array_equal(row["routed_experts_mask"], s.routed_experts_mask)
            np.testing.assert_array_equal(row["logprobs_mask"], s.logprobs_mask)
            np.testing.assert_array_equal(row["token_model_versions"], s.token_model_versions)
            np.testing.assert_array_equal(row["loss_mask"], s.loss_mask)
            seen += 1
    assert seen == len(samples)


def test_the_exported_samples_are_the_store_samples(exported):
    """A2-shaped data survives: spans, logprob presence, finish reasons."""
    _, samples = exported
    s = samples[("t0", 0)]
    np.testing.assert_array_equal(s.token_model_versions, [4, 4, 5, 5, -1, 5, 5])
    np.testing.assert_array_equal(s.logprobs_mask, [1, 1, 1, 1, 0, 0, 0])
    assert (s.finish_reason, samples[("t0", 1)].finish_reason) == ("stop", None)
    assert samples[("t2", 0)].routed_experts.dtype == np.uint16 and samples[("t3", 0)].routed_experts is None
