"""`dali trace enrich`: next-use times for Belady, computed once per batching and profile split, refused
when stale. The one-sequence hand trace cannot be split: it is enriched and simulated whole (share 0)."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import WHOLE, demand_rows, tiny_model, write_hand_trace

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


@pytest.fixture
def two_sequences(tmp_path):
    """Two sequences of 4 one-token steps (0 1 2 0 and 1 3 0 1)."""
    rows = [(seq, pos, "prefill" if pos == 0 else "decode", [[e]])
            for seq, demand in enumerate(([0, 1, 2, 0], [1, 3, 0, 1])) for pos, e in enumerate(demand)]
    return write_hand_trace(tmp_path / "two.parquet", ONE, rows)


def enrich(*args, share="0"):
    r = CliRunner().invoke(cli, ["trace", "enrich", *map(str, args), *(["--profile-share", share] if share else [])])
    assert r.exit_code == 0, r.output
    return r


def test_enrich_writes_next_uses_beside_the_trace(trace_path):
    r = enrich(trace_path)
    out = future_path(trace_path, WorkloadConfig(1), 0.0)
    assert out.name == "t.future-b1.parquet" and str(out) in r.output
    t = pq.read_table(out).to_pandas()
    # demand 0 1 2 0 1 3 0 1: expert 0 at steps 0, 3, 6; expert 1 at 1, 4, 7; 2 at 2; 3 at 5
    assert t[t.expert == 0].next_step.tolist() == [3, 6, -1]
    assert t[t.expert == 1].next_step.tolist() == [4, 7, -1]
    assert t[t.expert == 2].next_step.tolist() == [-1]
    assert future_path(trace_path, WorkloadConfig(4, 16), 0.0).name == "t.future-b4-c16.parquet"
    # the default profile split (the first 25% of the sequences are not evaluated) has its own file
    assert future_path(trace_path, WorkloadConfig(4, 16)).name == "t.future-b4-c16-p0.25.parquet"


def test_enrich_follows_the_profile_split(two_sequences, trace_path):
    """The default share profiles the first of the two sequences: the file covers the second only, the one
    `dali sim` evaluates; a one-sequence trace cannot be split, and a batch above the evaluated sequences is
    refused (as `dali sim` refuses it)."""
    out = enrich(two_sequences, share="")
    path = future_path(two_sequences, WorkloadConfig(1))
    assert path.name == "two.future-b1-p0.25.parquet" and str(path) in out.output
    # the evaluated sequence 1 3 0 1 alone: (expert, step, next step) sorted by expert, then step
    t = pq.read_table(path).to_pandas()
    assert list(zip(t.expert, t.step, t.next_step)) == [(0, 2, -1), (1, 0, 3), (1, 3, -1), (3, 1, -1)]
    r = simulate(two_sequences, "gpu-lru", overrides=BELADY, timing=False)  # the default split finds it
    assert r.summary["sequences"] == 1 and r.manifest["future"]["path"] == str(path)
    with pytest.raises(ValueError, match="computed for other evaluated sequences"):
        load_future(read_trace(two_sequences), WorkloadConfig(1), path, share=0.0)
    r = CliRunner().invoke(cli, ["trace", "enrich", str(trace_path)])
    assert r.exit_code == 1 and "cannot be split" in r.output and "--profile-share 0" in r.output
    r = CliRunner().invoke(cli, ["trace", "enrich", str(two_sequences), "--batch-size", "2"])
    assert r.exit_code == 1 and "batch size 2 exceeds the 1 sequence(s)" in r.output



def test_belady_refuses_to_run_without_next_uses(trace_path):
    with pytest.raises(ValueError, match=r"run `dali trace enrich .*t.parquet --batch-size 1 --profile-share 0`"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False, profiling=WHOLE)
    enrich(trace_path)
    r = simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False, profiling=WHOLE)
    assert r.summary["hits"] == 4  # the hand-checked count of tests/test_belady.py
    assert r.manifest["future"]["path"].endswith("t.future-b1.parquet")
    # the file is per batching: batch size 2 needs its own (here a batch of 2 is not even possible)
    with pytest.raises(ValueError, match="batch size 2 exceeds the 1 sequence"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, batch_size=2, timing=False, profiling=WHOLE)


def test_a_file_for_another_batching_or_trace_is_refused(trace_path, two_sequences, tmp_path):
    enrich(two_sequences, "--batch-size", "2", "-o", tmp_path / "b2.parquet")
    with pytest.raises(ValueError, match=r"computed for \{'batch_size': 2"):
        load_future(read_trace(two_sequences), WorkloadConfig(1), tmp_path / "b2.parquet", share=0.0)
    # a different trace under the same name: the SHA-256 no longer matches
    enrich(trace_path)
    other = write_hand_trace(tmp_path / "other.parquet", ONE, demand_rows([3, 2, 1, 0, 0, 0, 0, 0]))
    shutil.copy(other, trace_path)
    with pytest.raises(ValueError, match="SHA-256 differs"):
        simulate(trace_path, "gpu-lru", overrides=BELADY, timing=False, profiling=WHOLE)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a next-use file"):
        load_future(read_trace(trace_path), WorkloadConfig(1), tmp_path / "junk.parquet")


def test_loaded_next_uses_answer_like_the_workload(two_sequences):
    enrich(two_sequences, "--batch-size", "2")
    f = load_future(read_trace(two_sequences), WorkloadConfig(2), share=0.0)
    # batch 2: steps {0,1} {1,3} {2,0} {0,1}: after step 0, expert 0 next at 2, 1 at 1, 2 at 2, 3 at 1
    assert f.next_use(0, np.array([0, 1, 2, 3]), 0).tolist() == [2, 1, 2, 1]
