"""Project-written Parquet is readable by DuckDB, pyarrow and Polars with no harness-s code.

The `harness-s` binary writes synthetic trajectories with `bench storage` and a JSON
summary of what it wrote; each reader recomputes counts per kind (from the Hive partition
in the object names), reward and success sums per harness, and nested turn counts, and
must agree with the writer exactly.
"""

import json
import subprocess
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from harness_s import harness_s_bin




@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("parquet")
    summary_path = out / "summary.json"
    data = out / "data"
    proc = subprocess.run(
        [harness_s_bin(), "bench", "storage", "--rollouts", "1200", "--turns", "6",
         "--rollouts-per-part", "100", "--out", f"file://{data}", "--summary-json", str(summary_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(summary_path.read_text())
    return data, summary


def test_duckdb_reads_partitions_and_values(written):
    data, summary = written
    glob = f"{data}/**/*.parquet"
    con = duckdb.connect()
    by_kind = dict(con.execute(
        f"SELECT kind, count(*) FROM read_parquet('{glob}', hive_partitioning=true) GROUP BY kind").fetchall())
    assert by_kind == summary["rows_by_kind"]
    rewards = dict(con.execute(
        f"SELECT harness_id, sum(reward) FROM read_parquet('{glob}', hive_partitioning=true) GROUP BY 1").fetchall())
    assert rewards == pytest.approx(summary["reward_sum_by_harness"])
    turns, policy_tokens_with_logprobs = con.execute(
        f"""SELECT sum(len(turns)),
                   sum(list_sum(list_transform(turns, lambda t: CASE WHEN t.source = 'policy' THEN len(t.logprobs) ELSE 0 END)))
            FROM read_parquet('{glob}', hive_partitioning=true)""").fetchone()
    assert turns == summary["turns"]
    assert policy_tokens_with_logprobs > 0
    steps = [r[0] for r in con.execute(
        f"SELECT DISTINCT step FROM read_parquet('{glob}', hive_partitioning=true) ORDER BY 1").fetchall()]
    assert steps == list(range(len(steps))) and len(steps) >= 2


def test_pyarrow_reads_partitions_and_values(written):
    data, summary = written
    table = ds.dataset(str(data), format="parquet", partitioning="hive").to_table(
        columns=["kind", "step", "harness_id", "reward", "success"])
    kinds = table.group_by("kind").aggregate([("reward", "count")]).to_pylist()
    assert {r["kind"]: r["reward_count"] for r in kinds} == summary["rows_by_kind"]
    sums = table.group_by("harness_id").aggregate([("reward", "sum")]).to_pylist()
    assert {r["harness_id"]: r["reward_sum"] for r in sums} == pytest.approx(summary["reward_sum_by_harness"])
    # One file read alone still carries the record name and schema version.
    first = sorted(Path(data).rglob("*.parquet"))[0]
    meta = pq.read_metadata(first).metadata
    assert meta[b"harness_s.record"] == b"trajectory"
    assert meta[b"harness_s.schema_version"] == b"3"


def test_polars_reads_partitions_and_values(written):
    data, summary = written
    lf = pl.scan_parquet(f"{data}/**/*.parquet", hive_partitioning=True)
    kinds = lf.group_by("kind").agg(pl.len().alias("n")).collect()
    assert dict(zip(kinds["kind"].to_list(), kinds["n"].to_list())) == summary["rows_by_kind"]
    per_harness = lf.group_by("harness_id").agg(
        pl.col("reward").sum(), pl.col("success").cast(pl.Int64).sum()).collect()
    rows = {r["harness_id"]: r for r in per_harness.to_dicts()}
    assert {h: r["reward"] for h, r in rows.items()} == pytest.approx(summary["reward_sum_by_harness"])
    assert {h: r["success"] for h, r in rows.items()} == summary["success_by_harness"]
    turns = lf.select(pl.col("turns").list.len().sum()).collect().item()
    assert turns == summary["turns"]
