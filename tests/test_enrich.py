"""`dali trace enrich`: next-use times for Belady, computed once per batching, refused when stale."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import demand_rows, tiny_model, write_hand_trace

from dali_sim.cli.main import cli
from dali_sim.runtime.future import future_path, load_future
from dali_sim.sim import simulate
from dali_sim.trace import read_trace
from dali_sim.workload import WorkloadConfig

ONE = tiny_model(num_layers=1, moe_layers=(0,), num_experts=4, top_k=1)
BELADY = {"cache": {"policy": "belady"}, "memory": {"cache_experts": "2"}}


@pytest.fixture
def trace_path(tmp_path):
    return write_hand_trace(tmp_path / "t.parquet", ONE, demand_rows([0, 1, 2, 0, 1, 3, 0, 1]))


def enrich(*args):
    r = CliRunner().invoke(cli, ["trace", "enrich", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r


def test_enrich_writes_next_uses_beside_the_trace(trace_path):
    r = enrich(trace_path)
    out = future_path(trace_path, WorkloadConfig(1))
    assert out.name == "t.future-b1.parquet" and str(out) in r.output
    t = pq.read_table(out).to_pandas()
    # demand 0 1 2 0 1 3 0 1: expert 0 at steps 0, 3, 6; expert 1 at 1, 4, 7; 2 at 2; 3 at 5
    assert t[t.expert == 0].next_step.tolist() == [3, 6, -1]
    assert t[t.expert == 1].next_step.tolist() == [4, 7, -1]
    assert t[t.expert == 2].next_step.tolist() == [-1]
    assert future_path(trace_path, WorkloadConfig(4, 16)).name == "t.future-b4-c16.parquet"


def test_belady_refuses_to_run_without_next_uses(trace_path):
    with pytest.raises(ValueError, match=r"run `dali trace enrich .*t.parquet --batch-size 1`"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False)
    enrich(trace_path)
    r = simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False)
    assert r.summary["hits"] == 4  # the hand-checked count of tests/test_belady.py
    assert r.manifest["future"]["path"].endswith("t.future-b1.parquet")
    # the file is per batching: batch size 2 needs its own
    with pytest.raises(ValueError, match="--batch-size 2"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, batch_size=2, timing=False)


def test_a_file_for_another_batching_or_trace_is_refused(trace_path, tmp_path):
    enrich(trace_path, "--batch-size", "2", "-o", tmp_path / "b2.parquet")
    t = read_trace(trace_path)
    with pytest.raises(ValueError, match=r"computed for \{'batch_size': 2"):
        load_future(t, WorkloadConfig(1), tmp_path / "b2.parquet")
    # a different trace under the same name: the SHA-256 no longer matches
    enrich(trace_path)
    other = write_hand_trace(tmp_path / "other.parquet", ONE, demand_rows([3, 2, 1, 0, 0, 0, 0, 0]))
    shutil.copy(other, trace_path)
    with pytest.raises(ValueError, match="SHA-256 differs"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a next-use file"):
        load_future(read_trace(trace_path), WorkloadConfig(1), tmp_path / "junk.parquet")


def test_loaded_next_uses_answer_like_the_workload(trace_path):
    enrich(trace_path, "--batch-size", "2")
    f = load_future(read_trace(trace_path), WorkloadConfig(2))
    # batch 2 of one sequence is still one token per step
    assert f.next_use(0, np.array([0, 1, 2, 3]), 0).tolist()[:2] == [3, 1]
