"""No hindsight: frequency choices read a profiling input apart from the evaluated sequences (a deterministic
split of the trace's sequences by default, or a separate trace), every system of a run is evaluated on the
same sequences, results record which; a batch larger than the evaluated sequences is an error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import WHOLE, round_number_profile

from dali_sim.cli.main import cli
from dali_sim.sim import simulate
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload import Workload, WorkloadConfig
from dali_sim.workload.profiling import (ProfileSpec, apply_profile, check_batch_size, profile_count, seq_id_summary,
                                         total_sequences, trace_frequencies)

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "sim-golden.parquet"
SMALL = {"memory": {"cache_experts": "2"}}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """8 Mixtral-shaped sequences of 4 + 4 tokens."""
    path = tmp_path_factory.mktemp("profiling") / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=8, prompt_len=4, gen_len=4, seed=3), path)
    return read_trace(path)


def test_split_counts():
    assert [profile_count(n, 0.25) for n in (2, 3, 4, 5, 8, 12, 64)] == [1, 1, 1, 2, 2, 3, 16]
    assert profile_count(10, 0.0) == 0
    for n in (1, 3, 4, 16, 48):
        total = total_sequences(n)
        assert total - profile_count(total, 0.25) == n and total - 1 - profile_count(total - 1, 0.25) < n
    assert total_sequences(48) == 64 and total_sequences(4) == 6


def test_the_default_split_profiles_the_first_quarter(synth):
    """The first ceil(25%) sequences in seq_id order profile, the rest are evaluated; the frequencies are
    the profile part's (the same totals as its Workload's), and the same call gives the same split."""
    p = apply_profile(synth)
    ids = np.unique(synth.seq_id)
    assert np.array_equal(np.unique(p.evaluated.seq_id), ids[2:]) and p.evaluated.num_sequences == 6
    profile_part = synth.table.filter(np.isin(synth.seq_id, ids[:2]))
    prof = read_trace(synth.path)
    prof = type(prof)(profile_part, prof.meta, prof.path)
    assert np.array_equal(p.frequencies, Workload(prof, WorkloadConfig(2)).frequencies())
    assert np.array_equal(p.frequencies, trace_frequencies(prof))
    assert not np.array_equal(p.frequencies, trace_frequencies(synth))
    r = p.record
    assert r["source"] == "split" and r["share"] == 0.25 and not p.hindsight
    assert r["profile_sequences"] == seq_id_summary(ids[:2]) and r["evaluated_sequences"]["count"] == 6
    again = apply_profile(read_trace(synth.path))
    assert again.record == r and np.array_equal(again.frequencies, p.frequencies)
    half = apply_profile(synth, ProfileSpec(share=0.5))
    assert half.record["profile_sequences"]["count"] == 4 and half.evaluated.num_sequences == 4
    whole = apply_profile(synth, WHOLE)
    assert whole.hindsight and whole.evaluated is synth and np.array_equal(whole.frequencies, trace_frequencies(synth))


def test_a_profile_trace_is_the_profiling_input_and_the_whole_trace_is_evaluated(synth, tmp_path):
    other = tmp_path / "other.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=4, gen_len=4, seed=9), other)
    p = apply_profile(synth, ProfileSpec(trace=other))
    assert p.evaluated is synth and np.array_equal(p.frequencies, trace_frequencies(read_trace(other)))
    assert p.record["source"] == "trace" and p.record["trace"] == str(other) and len(p.record["trace_sha256"]) == 64
    assert p.record["profile_sequences"]["count"] == 3 and p.record["evaluated_sequences"]["count"] == 8
    wrong = tmp_path / "olmoe.parquet"
    synthesize(SynthConfig(model="olmoe-1b-7b", sequences=1, prompt_len=2, gen_len=2, seed=1), wrong)
    with pytest.raises(ValueError, match=r"profile trace .*olmoe\.parquet: MoE layers .*64 experts.*same model"):
        apply_profile(synth, ProfileSpec(trace=wrong))
    with pytest.raises(ValueError, match="not both"):
        ProfileSpec(share=0.25, trace=other)
    for bad in (1.0, -0.1, "x", True):
        with pytest.raises(ValueError, match=r"profile share must be a number in \[0, 1\)"):
            ProfileSpec(share=bad)


def test_a_trace_too_small_to_split_says_what_to_do(tmp_path):
    one = tmp_path / "one.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=1, prompt_len=2, gen_len=2, seed=1), one)
    with pytest.raises(ValueError, match=r"one\.parquet: 1 sequence\(s\) cannot be split .*--profile-trace.*"
                                         r"--profile-share 0"):
        simulate(one, "gpu-lru", timing=False)
    r = CliRunner().invoke(cli, ["sim", "run", "--trace", str(one), "--system", "gpu-lru"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and "--profile-share 0" in r.output
    assert simulate(one, "gpu-lru", timing=False, profiling=WHOLE).summary["sequences"] == 1


def test_frequencies_come_from_the_profile_part_only(tmp_path):
    """The golden trace (tests/test_preset_goldens.py), share 0.5: sequence 0 profiles, sequence 1 is
    evaluated. ktransformers-best with 2 slots keeps each layer's 2 most frequent experts and computes the
    rest on the CPU, so its GPU experts are its hits.
      profile (seq 0) counts: layer 0 (steps 0-3: 0[2],1[2],3,2 | 4,0 | 4,2 | 3,1) e0 3, e1 3, e2 2, e3 2,
        e4 2 -> {0, 1}; layer 1 (2[3],3[2],4 | 0,1 | 2,0 | 4,3) e0 2, e1 1, e2 4, e3 3, e4 2 -> {2, 3}
      evaluated (seq 1): layer 0 4[2],2,3 | 0,2 | 2,3: hits 0 + 1 + 0 = 1; layer 1 1[2],0,4 | 3,1 | 4,3: 0 + 1 + 1
        = 2: 3 hits.
      frequency-hindsight (seq 1's own counts): layer 0 e2 3, e3 2, e4 2 (ties to the lower id) -> {2, 3}: 2 + 1
        + 2 = 5; layer 1 e1 3, e3 2, e4 2 -> {1, 3}: 1 + 2 + 1 = 4: 9 hits, three times the honest count."""
    profile = round_number_profile(tmp_path / "p.json", read_trace(GOLDEN).model)
    half = ProfileSpec(share=0.5)
    r = simulate(GOLDEN, "ktransformers-best", hardware=profile, overrides=SMALL, profiling=half)
    assert r.summary["sequences"] == 1 and r.per_sequence["seq_id"].tolist() == [1]
    assert r.per_layer["hits"].tolist() == [1, 2] and r.summary["gpu_experts"] == 3
    over = {"memory": {"cache_experts": "2", "cache_init": "frequency-hindsight"}}
    h = simulate(GOLDEN, "ktransformers-best", hardware=profile, overrides=over, profiling=half)
    assert h.per_layer["hits"].tolist() == [5, 4]
    # share 0: no split, frequency = frequency-hindsight on the whole trace (the preset goldens' 15 hits)
    w = simulate(GOLDEN, "ktransformers-best", hardware=profile, overrides=SMALL, profiling=WHOLE)
    assert w.summary["hits"] == 15 and w.manifest["profiling"]["source"] == "hindsight"


def test_results_record_the_profiling_input(synth):
    r = simulate(synth, "gpu-static", batch_size=2, timing=False)
    m, c = r.manifest["profiling"], r.config["profiling"]
    assert m["source"] == "split" and m["share"] == 0.25 and m["profile_sequences"]["count"] == 2
    assert m["evaluated_sequences"] == seq_id_summary(np.unique(synth.seq_id)[2:])
    assert c == {"source": "split", "share": 0.25, "evaluated_sequences": 6}
    assert r.summary["sequences"] == 6 and set(r.per_sequence["seq_id"]) == set(np.unique(synth.seq_id)[2:].tolist())
    lb = simulate(synth, "lower-bound", batch_size=2)  # a time bound is evaluated on the same sequences
    assert lb.manifest["profiling"] == m and lb.summary["sequences"] == 6


def test_every_system_of_a_comparison_is_evaluated_on_the_same_sequences(synth):
    """Also the ones that make no frequency choice (gpu-lru, llamacpp's whole layers): a comparison is on
    identical inputs."""
    r = CliRunner().invoke(cli, ["sim", "compare", "--trace", str(synth.path), "--systems",
                                 "gpu-lru,ktransformers-best,llamacpp,lower-bound", "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)["systems"]
    records = [s["manifest"]["profiling"] for s in d.values()]
    assert all(rec == records[0] for rec in records) and records[0]["evaluated_sequences"]["count"] == 6
    assert {s["sequences"] for s in d.values()} == {6} and len({s["tokens"] for s in d.values()}) == 1
    text = CliRunner().invoke(cli, ["sim", "compare", "--trace", str(synth.path), "--systems", "gpu-lru,cpu-only",
                                    "--no-timing"]).output.splitlines()
    assert text[1] == "profiling: the first 2 of 8 sequences (share 0.25); 6 evaluated"


def test_cli_profile_options(synth, tmp_path):
    other = tmp_path / "p.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=2, prompt_len=4, gen_len=4, seed=4), other)
    run = ["sim", "run", "--trace", str(synth.path), "--system", "gpu-static", "--no-timing"]
    r = CliRunner().invoke(cli, [*run, "--profile-trace", str(other), "--json"])
    d = json.loads(r.output)
    assert d["sequences"] == 8 and d["manifest"]["profiling"]["trace"] == str(other)
    text = CliRunner().invoke(cli, [*run, "--profile-trace", str(other)]).output
    assert f"profiling: trace {other} (2 sequences); all 8 sequences evaluated" in text
    text = CliRunner().invoke(cli, [*run, "--profile-share", "0"]).output
    assert "profiling: none (share 0): frequency choices see the 8 evaluated sequences (hindsight)" in text
    r = CliRunner().invoke(cli, [*run, "--profile-trace", str(other), "--profile-share", "0.5"])
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(cli, [*run, "--profile-share", "1"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, [*run, "--cache-init", "frequency-hindsight", "--json"])
    assert json.loads(r.output)["config"]["system"]["memory"]["cache_init"] == "frequency-hindsight"


def test_a_batch_larger_than_the_evaluated_sequences_is_an_error(synth, tmp_path):
    """It used to run silently with the sequences there were."""
    with pytest.raises(ValueError, match=r"batch size 7 exceeds the 6 sequence\(s\) evaluated from .*mix\.parquet"):
        simulate(synth, "gpu-lru", batch_size=7, timing=False)
    assert simulate(synth, "gpu-lru", batch_size=6, timing=False).summary["batches"] == 1
    r = CliRunner().invoke(cli, ["sim", "run", "--trace", str(synth.path), "--system", "gpu-lru", "--batch-size", "64"])
    assert r.exit_code == 1 and "batch size 64 exceeds the 6 sequence(s) evaluated" in r.output
    assert "use --batch-size 6 or less" in r.output and "Traceback" not in r.output
    with pytest.raises(ValueError, match=r"batch size 9 exceeds the 8 sequence\(s\)"):
        simulate(synth, "gpu-lru", batch_size=9, timing=False, profiling=WHOLE)
    with pytest.raises(ValueError, match="batch size 3 exceeds the 2"):
        check_batch_size(3, 2)


def test_the_executor_replays_the_evaluated_sequences_with_the_same_frequencies(synth):
    """prepare_replay makes the simulator's split; its controller reads the profile's frequencies (the first
    MoE layers of a cut replay); the profiling sequences are never replayed."""
    pytest.importorskip("torch")
    from dali_exec.executor import ReplayOptions, prepare_replay

    split = apply_profile(synth)
    setup = prepare_replay(synth, "ktransformers-best", ReplayOptions(layers=3, scale=1 / 64, dtype="fp32"),
                           batch_size=2)
    assert set(np.unique(setup.trace.seq_id)) == set(np.unique(split.evaluated.seq_id))
    assert np.array_equal(setup.profiled.frequencies, split.frequencies[:3])
    assert setup.profiled.evaluated is setup.trace and setup.profiled.record["source"] == "split"
    with pytest.raises(ValueError, match="batch size 7 exceeds the 6 sequence"):
        prepare_replay(synth, "gpu-lru", ReplayOptions(layers=2, scale=1 / 64, dtype="fp32"), batch_size=7)
    cut = prepare_replay(synth, "gpu-lru", ReplayOptions(layers=2, scale=1 / 64, dtype="fp32", sequences=2),
                         batch_size=2)
    assert cut.profiled.record["evaluated_sequences"]["count"] == 2
    assert cut.profiled.record["profile_sequences"] == split.record["profile_sequences"]
