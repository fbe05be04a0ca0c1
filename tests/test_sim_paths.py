"""The simulator's two paths, determinism, the result's manifest, timelines, bad input and the CLI.

* ``timing=False`` (the fast replay) and the SimPy path take the same decisions: every counter of the
  summary and of ``per_layer`` agrees, for every preset, on the shipped traces and a synthetic one,
  at batch sizes 1 and 8 (the whole GPT-OSS trace only under ``-m slow``; a 2-sequence slice here).
* same inputs and seed -> identical results; ``random`` cache init depends on the seed.
* results carry the resolved config and a manifest (trace SHA-256, seed, package version).
* timelines are valid Chrome trace JSON, one track per resource, no overlap within a track.
* bad input gives a clear error naming the parameter, file or numbers.
* ``dali sim run --json`` and ``dali sim compare`` through click's CliRunner.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from conftest import WHOLE, random_rows, simulate_both, tiny_model

import dali_sim
from dali_sim.cli.main import cli
from dali_sim.policies.systems import parse_overrides, resolve_system, system_names
from dali_sim.registry import UnknownNameError
from dali_sim.sim.engine import TRACKS
from dali_sim.sim.simulate import simulate
from dali_sim.sim.timeline import chrome_trace, write_timeline
from dali_sim.trace import TraceWriter, read_trace

REPO = Path(__file__).resolve().parents[1]
GPT_OSS = REPO / "traces" / "gpt-oss-20b.parquet"
SWITCH = REPO / "traces" / "switch-base-8.parquet"
GOLDEN = REPO / "tests" / "data" / "sim-golden.parquet"
PRESETS = ["cpu-only", "gpu-lfu", "gpu-lru", "gpu-static", "llamacpp"]


def write_subset(src, path: Path, seqs) -> Path:
    t = read_trace(src)
    keep = np.isin(t.seq_id, list(seqs))
    with TraceWriter(path, t.model, provenance={"source": str(src), "command": "tests/test_sim_paths.py"}) as w:
        w.write(seq_id=t.seq_id[keep], phase=t.phase[keep], pos=t.pos[keep], layer=t.layer[keep],
                experts=t.experts[keep], weights=t.weights[keep])
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """name -> path: a 2-sequence slice of GPT-OSS (213 decode tokens), switch-base-8 (prefill only,
    dense blocks between MoE blocks), and a synthetic trace (a dense block 0, MoE blocks 1-3, 8 experts,
    top-2, 10 sequences of 12 tokens, half prefill)."""
    d = tmp_path_factory.mktemp("paths")
    model = tiny_model(num_layers=4, moe_layers=(1, 2, 3), num_experts=8, top_k=2)
    synth = d / "synth.parquet"
    with TraceWriter(synth, model, provenance={"source": "random_rows", "command": "tests/test_sim_paths.py"}) as w:
        w.write(**random_rows(model, 10, 12, seed=5))
    return {"gpt-oss-slice": write_subset(GPT_OSS, d / "gpt-oss-0-7.parquet", (0, 7)), "switch": SWITCH,
            "synth": synth}





@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("system", PRESETS)
@pytest.mark.parametrize("name", ["gpt-oss-slice", "switch", "synth"])
def test_no_timing_agrees_with_simpy(traces, name, system, batch):
    batch = min(batch, read_trace(traces[name]).num_sequences)  # the gpt-oss slice has 2: a larger batch is an error
    timed, _ = simulate_both(traces[name], system, batch_size=batch)
    s = timed.summary
    assert s["activated"] == s["gpu_experts"] + s["cpu_experts"]
    assert s["on_demand"] == s["admitted"] + s["staged"]
    if system == "cpu-only":
        assert s["gpu_experts"] == 0 and s["transfers"] == 0
    if name == "gpt-oss-slice" and system == "llamacpp":
        # 24 GiB holds the experts of only some layers: both lanes are used
        assert s["cpu_experts"] > 0 and s["gpu_experts"] > 0 and s["on_demand"] == 0


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("system", ["gpu-lfu", "gpu-lru", "gpu-static"])
@pytest.mark.parametrize("name", ["switch", "synth"])
def test_no_timing_agrees_with_small_caches(traces, name, system, batch):
    """A quarter of the experts cached (2 of 8): staged experts, and (synth, LRU/LFU) evictions happen.
    (switch-base-8 is prefill only: nearly every expert is activated in every step, so nothing is
    ever evictable.)"""
    batch = min(batch, read_trace(traces[name]).num_sequences)
    timed, _ = simulate_both(traces[name], system, {"memory": {"cache_ratio": "0.25"}}, batch_size=batch)
    assert timed.manifest["memory"]["cache_slots_per_layer"][0] == 2
    assert timed.summary["staged"] > 0
    if system != "gpu-static" and name == "synth":
        assert timed.summary["evicted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("system", PRESETS)
def test_no_timing_agrees_full_gpt_oss(system, batch):
    simulate_both(GPT_OSS, system, batch_size=batch)


# ---- determinism ---------------------------------------------------------------------------------
def test_same_inputs_same_results(traces):
    over = {"memory": {"cache_ratio": "0.25", "cache_init": "random"}}
    a = simulate(traces["synth"], "gpu-lru", batch_size=8, seed=7, overrides=over, timeline=True, profiling=WHOLE)
    b = simulate(traces["synth"], "gpu-lru", batch_size=8, seed=7, overrides=over, timeline=True, profiling=WHOLE)
    assert a.to_json() == b.to_json()
    pd.testing.assert_frame_equal(a.per_layer, b.per_layer)
    pd.testing.assert_frame_equal(a.per_step, b.per_step)
    pd.testing.assert_frame_equal(a.per_sequence, b.per_sequence)
    assert [(i.track, i.name, i.start, i.end, i.args) for i in a.intervals] == \
           [(i.track, i.name, i.start, i.end, i.args) for i in b.intervals]


@pytest.mark.parametrize("system", ["gpu-lru", "gpu-static"])
def test_random_cache_init_depends_on_seed(traces, system):
    over = {"memory": {"cache_ratio": "0.25", "cache_init": "random"}}
    runs = {seed: simulate(traces["synth"], system, seed=seed, overrides=over, timing=False,
                           profiling=WHOLE) for seed in range(5)}
    hits = {seed: tuple(r.per_layer["hits"]) for seed, r in runs.items()}
    assert len(set(hits.values())) > 1  # different seeds, different initial caches, different hits
    again = simulate(traces["synth"], system, seed=3, overrides=over, timing=False, profiling=WHOLE)
    assert tuple(again.per_layer["hits"]) == hits[3]
    assert again.manifest["seed"] == 3 and again.config["seed"] == 3
    # empty init ignores the seed
    empty = {"memory": {"cache_ratio": "0.25", "cache_init": "empty"}}
    assert len({simulate(traces["synth"], "gpu-lru", seed=s, overrides=empty, timing=False,
                         profiling=WHOLE).summary["hits"]
                for s in range(3)}) == 1


# ---- config and manifest -------------------------------------------------------------------------
def test_result_carries_config_and_manifest(traces):
    path = traces["synth"]
    over = {"memory": {"cache_experts": "3"}, "cache": {"policy": "lfu", "count": "activations"}}
    r = simulate(path, "gpu-lru", batch_size=8, prefill_chunk=4, seed=11, overrides=over, precision="q8_0",
                 profiling=WHOLE)
    c = r.config
    assert c["system"] == resolve_system("gpu-lru", over).to_dict()
    assert c["system"]["cache"] == {"policy": "lfu", "count": "activations"}
    assert c["system"]["memory"]["cache_experts"] == 3
    assert (c["batch_size"], c["prefill_chunk"], c["seed"], c["precision"], c["timing"]) == (8, 4, 11, "q8_0", True)
    assert c["hardware"] == "rtx3090-epyc7532"
    m = r.manifest
    assert m["dali_version"] == dali_sim.__version__
    assert m["trace"] == str(path)
    assert m["trace_sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert m["seed"] == 11
    assert m["hardware"]["name"] == "rtx3090-epyc7532" and m["hardware"]["path"].endswith("rtx3090-epyc7532.toml")
    assert m["model"]["precision"]["name"] == "q8_0"
    assert m["memory"]["cache_slots_per_layer"] == [3, 3, 3]
    assert m["timing"] is True
    # the JSON form carries both, and is strict JSON (NaN written as null)
    d = json.loads(r.to_json())
    assert d["config"] == json.loads(json.dumps(c)) and d["manifest"]["trace_sha256"] == m["trace_sha256"]
    assert d["prefetch_precision"] is None
    # q8_0 experts are about half the bf16 bytes: fewer bytes per transfer
    bf16 = simulate(path, "gpu-lru", batch_size=8, prefill_chunk=4, seed=11, overrides=over, timing=False,
                    profiling=WHOLE)
    assert bf16.summary["on_demand"] == r.summary["on_demand"] > 0
    assert r.summary["bytes_h2d"] < bf16.summary["bytes_h2d"]


# ---- timelines -----------------------------------------------------------------------------------
def check_chrome(doc: dict, n_intervals: int) -> dict[str, int]:
    """Validate a Trace Event Format document; returns X events per track name."""
    assert set(doc) >= {"traceEvents"}
    events = doc["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    threads = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert sorted(threads) == sorted(t.upper() for t in TRACKS)
    assert len(set(threads.values())) == len(TRACKS)  # one track (thread) per resource
    assert [e for e in meta if e["name"] == "process_name"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == n_intervals
    assert len(events) == len(meta) + len(spans)
    per_track: dict[str, list] = {}
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
        assert e["tid"] == threads[e["cat"].upper()]
        per_track.setdefault(e["cat"], []).append((e["ts"], e["ts"] + e["dur"]))
    for track, iv in per_track.items():  # each resource does one thing at a time
        iv.sort()
        for (_, e0), (s1, _) in itertools.pairwise(iv):
            assert s1 >= e0 - 1e-6, (track, e0, s1)
    return {k: len(v) for k, v in per_track.items()}


def test_timeline_chrome_format(traces, tmp_path):
    r = simulate(traces["gpt-oss-slice"], "llamacpp", timeline=True, profiling=WHOLE)  # CPU and GPU lanes
    assert len(r.intervals) == r.summary["events"]
    check_chrome(chrome_trace(r.intervals), r.summary["events"])
    kinds = Counter((iv.track, iv.name.split(" ")[0] if not iv.name.startswith("L") else "expert") for iv in r.intervals)
    assert kinds[("cpu", "expert")] == r.summary["cpu_experts"]
    assert kinds[("gpu", "expert")] == r.summary["gpu_experts"]
    # one dense part per MoE layer and step (24 x 213), one LM head per step (llama.cpp's implementation)
    assert kinds[("gpu", "dense")] == 24 * 213 and kinds[("gpu", "lm_head")] == 213
    # a CPU layer hands its activations over and back, and runs its experts as one grouped set of ops
    cpu_layers = int((r.per_layer["cpu_experts"] > 0).sum())
    assert kinds[("cpu", "handoff")] == 2 * kinds[("cpu", "overhead")] and kinds[("cpu", "overhead")] >= 213 * cpu_layers
    assert set(kinds) <= {("cpu", k) for k in ("expert", "handoff", "overhead")} | \
        {("gpu", k) for k in ("expert", "dense", "lm_head", "overhead")} | {("host", "host"), ("pcie", "fetch")}
    out = write_timeline(tmp_path / "sub" / "t.json", r.intervals, "test")
    assert out.exists() and not list(out.parent.glob("*.partial"))
    doc = json.loads(out.read_text())
    check_chrome(doc, len(r.intervals))
    assert doc["traceEvents"][0]["args"]["name"] == "test"
    # busy fractions are the per-track sums of the intervals over the makespan
    for track in TRACKS:
        busy = sum(i.end - i.start for i in r.intervals if i.track == track)
        assert r.summary["busy"][track] == pytest.approx(busy / r.summary["makespan_s"], rel=1e-9)


def test_timeline_via_cli(traces, tmp_path):
    out = tmp_path / "timeline.json"
    res = CliRunner().invoke(cli, ["sim", "run", "--trace", str(traces["synth"]), "--system", "gpu-lru",
                                   "--cache-experts", "2", "--timeline", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    counts = check_chrome(json.loads(out.read_text()), summary["events"])
    assert counts["pcie"] == summary["on_demand"] and "cpu" not in counts
    res = CliRunner().invoke(cli, ["sim", "run", "--trace", str(traces["synth"]), "--system", "gpu-lru",
                                   "--timeline", str(tmp_path / "x.json"), "--no-timing"])
    assert res.exit_code == 2 and "--timeline needs timing" in res.output


def test_no_timeline_unless_asked(traces):
    assert simulate(traces["synth"], "gpu-lru", profiling=WHOLE).intervals == []


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("system, over, error, pattern", [
    ("nope", None, UnknownNameError, r"unknown system 'nope'; known: cpu-only, .*gpu-lru.*llamacpp"),
    ("gpu-lru", {"cache": {"foo": "1"}}, ValueError, r"unknown parameter cache\.foo"),
    ("gpu-lru", {"memory": {"cache_size": "1"}}, ValueError, r"unknown parameter memory\.cache_size; memory parameters: .*cache_experts"),
    ("gpu-lru", {"foo": {"bar": "1"}}, ValueError, r"unknown --set section\(s\) \['foo'\]"),
    ("gpu-lru", {"system": {"bogus": "x"}}, ValueError, r"unknown parameter system\.bogus"),
    ("gpu-lru", {"system": {"dense_device": "tpu"}}, ValueError, r"system\.dense_device must be gpu or cpu, got 'tpu'"),
    ("gpu-lru", {"memory": {"cache_ratio": "2"}}, ValueError, r"memory\.cache_ratio must lie in \[0, 1\], got 2\.0"),
    ("gpu-lru", {"memory": {"cache_experts": "abc"}}, ValueError, r"memory\.cache_experts: cannot read 'abc' as int"),
    ("gpu-lru", {"memory": {"cache_experts": "6"}}, ValueError, r"memory\.cache_experts=6 exceeds the 5 experts"),
    ("gpu-lru", {"memory": {"layout": "diagonal"}}, ValueError, r"memory\.layout must be one of uniform, whole-layers, none"),
    ("gpu-lru", {"memory": {"cache_init": "best"}}, ValueError,
     r"memory\.cache_init must be one of empty, random, frequency, frequency-hindsight"),
    ("gpu-lru", {"memory": {"cache_ratio": "0.5", "cache_experts": "2"}}, ValueError, r"cache_ratio or memory\.cache_experts, not both"),
    ("gpu-lru", {"memory": {"staging_slots": "-2"}}, ValueError, r"memory.staging_slots must be >= 0 \(or -1 = one layer.s experts\), got -2"),
    ("gpu-lru", {"cache": {"policy": "nope"}}, UnknownNameError, r"unknown cache policy 'nope'; known: .*lfu, link-budget, lru, optimal, static"),
    ("gpu-lfu", {"cache": {"count": "bytes"}}, ValueError, r"cache\.count must be 'tokens' or 'activations', got 'bytes'"),
    ("gpu-lru", {"memory": {"cache_experts": "0", "staging_slots": "0"}}, ValueError, r"memory\.staging_slots is 0"),
    ("llamacpp", {"placement": {"cpu_layers": "5"}}, ValueError, r"placement\.cpu_layers=5 is not in 0\.\.2"),
])
def test_bad_system_parameters(system, over, error, pattern):
    for timing in (False, True):
        with pytest.raises(error, match=pattern):
            simulate(GOLDEN, system, overrides=over, timing=timing, profiling=WHOLE)


def test_unknown_hardware_profile():
    with pytest.raises(UnknownNameError, match=r"unknown hardware profile 'nope'; known: .*rtx3090-epyc7532"):
        simulate(GOLDEN, "gpu-lru", hardware="nope", profiling=WHOLE)
    with pytest.raises(Exception, match=r"no-such-file\.json"):
        simulate(GOLDEN, "gpu-lru", hardware=str(REPO / "no-such-file.json"), profiling=WHOLE)


def test_measured_profile_of_another_model_is_refused():
    with pytest.raises(ValueError, match=r"hw-measured-example\.json: model\.\w+: measured for .*golden-moe"):
        simulate(GOLDEN, "gpu-lru", hardware=str(REPO / "tests" / "data" / "hw-measured-example.json"), profiling=WHOLE)


def test_impossible_budget_names_the_numbers(traces):
    with pytest.raises(ValueError, match=r"GPU memory budget 1\.00 GiB cannot hold the minimum working set "
                                         r"\(\d+\.\d\d GiB: dense_weights \d+\.\d\d, kv_cache .*memory\.gpu_memory_gib"):
        simulate(traces["gpt-oss-slice"], "gpu-lru", overrides={"memory": {"gpu_memory_gib": "1"}}, timing=False,
                 profiling=WHOLE)
    with pytest.raises(ValueError, match=r"32 cache slots x 24 layers x \d+\.\d MiB = \d+\.\d\d GiB do not fit .* "
                                         r"at most 18 slots per layer fit"):
        simulate(traces["gpt-oss-slice"], "gpu-lru", overrides={"memory": {"cache_experts": "32"}}, timing=False,
                 profiling=WHOLE)
    # 18 slots do fit the default 24 GiB
    r = simulate(traces["gpt-oss-slice"], "gpu-lru", overrides={"memory": {"cache_experts": "18"}}, timing=False,
                 profiling=WHOLE)
    assert r.manifest["memory"]["cache_slots_per_layer"] == [18] * 24


def test_bad_workload_arguments(tmp_path):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        simulate(GOLDEN, "gpu-lru", batch_size=0, timing=False, profiling=WHOLE)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        simulate(GOLDEN, "gpu-lru", prefill_chunk=-2, timing=False, profiling=WHOLE)
    empty = tmp_path / "empty.parquet"
    with TraceWriter(empty, read_trace(GOLDEN).model, provenance={"source": "test"}):
        pass
    for timing in (False, True):
        with pytest.raises(ValueError, match=r"empty\.parquet: the trace has no rows"):
            simulate(empty, "gpu-lru", timing=timing, profiling=WHOLE)


@pytest.mark.parametrize("item", ["memory.cache_experts", "cache_experts=2", "memory=2", "memory.=2"])
def test_parse_overrides_rejects_malformed(item):
    with pytest.raises(ValueError, match=r"expected \[SYSTEM:\]section\.key=value"):
        parse_overrides([item])


def test_parse_overrides():
    assert parse_overrides(["cache.policy=lfu", "memory.cache_experts = 4", "memory.cache_init=random"]) == {
        "cache": {"policy": "lfu"}, "memory": {"cache_experts": "4", "cache_init": "random"}}


# ---- CLI -----------------------------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(cli, ["sim", *args])


def test_cli_run_json(traces):
    # --profile-share 0: the golden trace is evaluated whole, as the golden numbers are
    res = invoke("run", "--trace", str(GOLDEN), "--system", "gpu-lru", "--cache-experts", "2", "--profile-share", "0",
                 "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    for key in ("hit_rate", "prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s", "bytes_h2d",
                "busy", "config", "manifest", "makespan_s", "events"):
        assert key in d, key
    assert d["hit_rate"] == 8 / 33 and d["bytes_h2d"] == 25 * 768  # the golden numbers (test_sim_golden.py)
    assert set(d["busy"]) == set(TRACKS)
    assert d["config"]["system"]["memory"]["cache_experts"] == 2
    assert d["prefill_s"] + d["decode_s"] == pytest.approx(d["makespan_s"], rel=1e-12)
    api = simulate(GOLDEN, "gpu-lru", overrides={"memory": {"cache_experts": "2"}}, profiling=WHOLE)
    assert d == json.loads(api.to_json())


def test_cli_run_set_and_text(traces):
    res = invoke("run", "--trace", str(GOLDEN), "--system", "gpu-lru", "--set", "cache.policy=static",
                 "--set", "memory.cache_init=frequency", "--cache-experts", "2", "--no-timing", "--profile-share", "0",
                 "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["hits"] == 15 and "makespan_s" not in d  # = gpu-static with 2 slots (test_sim_golden.py)
    res = invoke("run", "--trace", str(GOLDEN), "--system", "cpu-only")
    assert res.exit_code == 0, res.output
    assert "hit rate 0.0%" in res.output and "busy: GPU" in res.output


@pytest.mark.parametrize("args, message", [
    (["--system", "nope"], "Error: unknown system 'nope'"),
    (["--system", "gpu-lru", "--hardware", "nope"], "Error: unknown hardware profile 'nope'"),
    (["--system", "gpu-lru", "--set", "cache.foo=1"], "Error: unknown parameter cache.foo"),
    (["--system", "gpu-lru", "--set", "foo.bar=1"], "Error: unknown --set section(s) ['foo']"),
    (["--system", "gpu-lru", "--set", "cache_experts"], "Error: --set 'cache_experts': expected [SYSTEM:]section.key=value"),
    (["--system", "gpu-lru", "--cache-ratio", "2"], "Error: memory.cache_ratio must lie in [0, 1], got 2.0"),
])
def test_cli_errors(args, message):
    res = invoke("run", "--trace", str(GOLDEN), *args)
    assert res.exit_code == 1
    assert message in res.output
    assert "Traceback" not in res.output


def test_cli_both_cache_sizes_is_a_usage_error():
    res = invoke("run", "--trace", str(GOLDEN), "--system", "gpu-lru", "--cache-ratio", "0.5", "--cache-experts", "2")
    assert res.exit_code == 2 and "not both" in res.output


def test_cli_compare(tmp_path):
    csv = tmp_path / "cmp.csv"
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only,gpu-static",
                 "--cache-experts", "2", "--csv", str(csv), "--profile-share", "0", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["baseline"] == "gpu-lru"
    rows = {row["system"]: row for row in d["table"]}
    assert list(rows) == ["gpu-lru", "cpu-only", "gpu-static"]
    assert rows["gpu-lru"]["prefill_speedup"] == 1.0 and rows["gpu-lru"]["decode_speedup"] == 1.0
    for name, row in rows.items():
        base = rows["gpu-lru"]
        assert row["decode_speedup"] == pytest.approx(base["decode_s"] / row["decode_s"], rel=1e-12)
        assert row["prefill_speedup"] == pytest.approx(base["prefill_s"] / row["prefill_s"], rel=1e-12)
        assert d["systems"][name]["decode_s"] == row["decode_s"]
    assert rows["gpu-lru"]["on_demand"] == 25 and rows["gpu-static"]["on_demand"] == 18
    assert rows["cpu-only"]["on_demand"] == 0
    table = pd.read_csv(csv, index_col="system")
    assert table.loc["gpu-lru", "decode_speedup"] == 1.0 and table.loc["gpu-lru", "prefill_speedup"] == 1.0
    assert table.loc["cpu-only", "decode_speedup"] == pytest.approx(rows["cpu-only"]["decode_speedup"])


def test_cli_compare_text_and_baseline():
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,gpu-static", "--baseline", "cpu-only",
                 "--cache-experts", "2")
    assert res.exit_code == 0, res.output
    out = res.output.splitlines()
    # the header names the setting every row shares, the next line the profiling split (of 2 sequences: 1 + 1)
    assert out[0].startswith("golden-moe (bf16) on rtx3090-epyc7532: GPU budget 24.0 GiB")
    assert "batch 1" in out[0] and "tokens" in out[0] and "cache slots per MoE layer" in out[0]
    assert "1 sequences" in out[0]
    assert out[1] == "profiling: the first 1 of 2 sequences (share 0.25); 1 evaluated"
    header = out[2].split()
    assert header[0] == "slots/layer" and header[-4:] == ["prefill", "x", "decode", "x"]
    lines = {line.split()[0]: line.split() for line in out[3:] if line.strip() and not line.startswith(
        ("legend", "winner", "system", "note"))}
    assert set(lines) >= {"gpu-lru", "gpu-static", "cpu-only"}  # the baseline is added as a row
    assert lines["cpu-only"][-2:] == ["1.00x", "1.00x"]
    legend = next(line for line in out if line.startswith("legend:"))
    for term in ("hit %", "GPU %", "tokens per second per sequence", "speedup over cpu-only"):
        assert term in legend
    winner = out[-1]
    assert winner.startswith("winner: ")
    res_json = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,gpu-static", "--baseline",
                      "cpu-only", "--cache-experts", "2", "--json")
    d = json.loads(res_json.output)
    best = max((r for r in d["table"]), key=lambda r: r["decode_tokens_per_s"])
    assert d["winner"]["system"] == best["system"] and winner.startswith(f"winner: {best['system']}, ")
    # --no-timing: no times, hence no speedup columns and no winner
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only", "--no-timing", "--json")
    assert res.exit_code == 0, res.output
    assert "decode_speedup" not in json.loads(res.output)["table"][0] and json.loads(res.output)["winner"] is None
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only", "--no-timing")
    assert res.output.splitlines()[-1] == "winner: none named: no times (--no-timing)"


def test_compare_header_says_when_cache_slots_differ_by_system():
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only", "--set", "gpu-lru:memory.cache_experts=2")
    assert res.exit_code == 0, res.output
    assert "cache slots per MoE layer by system" in res.output.splitlines()[0]
    rows = {line.split()[0]: line.split() for line in res.output.splitlines()[4:6]}
    assert rows["gpu-lru"][1] == "2" and rows["cpu-only"][1] == "0"


def test_compare_per_system_overrides():
    """`--set SYSTEM:section.key=value` applies to SYSTEM only; plain --set to every system; a SYSTEM that is
    not compared is an error."""
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,gpu-lfu", "--cache-experts", "2",
                 "--set", "gpu-lru:cache.policy=lfu", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)["systems"]
    assert d["gpu-lru"]["config"]["system"]["cache"]["policy"] == "lfu"
    assert d["gpu-lfu"]["config"]["system"]["cache"]["policy"] == "lfu"
    assert d["gpu-lru"]["config"]["system"]["memory"]["cache_experts"] == 2  # --cache-experts: every system
    # a key that only one system has: before, it failed for the others
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only", "--set",
                 "gpu-lru:memory.cache_experts=3", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)["systems"]
    assert d["gpu-lru"]["config"]["system"]["memory"]["cache_experts"] == 3
    assert d["cpu-only"]["config"]["system"]["memory"]["cache_experts"] == -1
    # the specific one wins over a plain one, whatever the order
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,gpu-lfu", "--set",
                 "gpu-lru:memory.cache_experts=1", "--set", "memory.cache_experts=2", "--json")
    d = json.loads(res.output)["systems"]
    assert d["gpu-lru"]["config"]["system"]["memory"]["cache_experts"] == 1
    assert d["gpu-lfu"]["config"]["system"]["memory"]["cache_experts"] == 2
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,cpu-only", "--set", "dali:prefetch.k=2")
    assert res.exit_code == 1 and "system 'dali' is not one of the systems run here (gpu-lru, cpu-only)" in res.output
    res = invoke("run", "--trace", str(GOLDEN), "--system", "gpu-lru", "--set", "gpu-lru:cache.policy=lfu", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["config"]["system"]["cache"]["policy"] == "lfu"


def test_cli_compare_fails_fast_on_a_bad_name():
    res = invoke("compare", "--trace", str(GOLDEN), "--systems", "gpu-lru,nope")
    assert res.exit_code == 1 and "unknown system 'nope'" in res.output


def test_cli_lists_systems_and_profiles():
    res = invoke("systems")
    assert res.exit_code == 0
    for name in system_names():
        assert name in res.output
    assert set(PRESETS) <= set(system_names())  # presets needing lookahead columns: test_system_presets.py
    res = invoke("profiles")
    assert res.exit_code == 0 and "rtx3090-epyc7532" in res.output and "(default)" in res.output


def test_plan_counters_add_up_in_bulk_as_plan_by_plan(monkeypatch, tmp_path):
    """PlanCounters keeps plans as tuples and adds them up when read (or every _FLUSH plans): the same
    per-layer counts as adding each plan's, and ``c`` can be changed in place between adds."""
    from dali_sim.policies.systems import resolve_system as resolve
    from dali_sim.runtime.controller import CPU, FETCH, PREFETCHED, Controller
    from dali_sim.runtime.memory import plan_memory
    from dali_sim.hardware.cost import CostModel
    from dali_sim.hardware.profile import load_profile
    from dali_sim.sim.counters import COUNTERS, PlanCounters
    from dali_sim.sim.simulate import DEFAULT_HARDWARE
    from dali_sim.workload.builder import Workload, WorkloadConfig

    from dali_sim.trace.synth import SynthConfig, synthesize

    path = tmp_path / "t.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=4, prompt_len=4, gen_len=12, seed=3,
                           lookahead=("residual=0.8",)), path)
    trace = read_trace(path)
    sysconf = resolve("dali", None, trace.model)  # prefetches, staging, swaps at window ends
    profile = load_profile(DEFAULT_HARDWARE)
    w = Workload(trace, WorkloadConfig(4), predictors=("residual",))
    costs = CostModel(profile, trace.model)
    placement, cache, prefetch = (c.build() for c in (sysconf.placement, sysconf.cache, sysconf.prefetch))
    mem = plan_memory(trace.model, sysconf.memory, profile.gpu_memory_bytes, w.max_batch_context)
    ctl = Controller(w, costs, placement, cache, prefetch, mem.capacities, cache_init=sysconf.memory.cache_init,
                     prefetch_slots=mem.prefetch_slots, staging_slots=mem.staging_slots)
    monkeypatch.setattr(PlanCounters, "_FLUSH", 7)
    bulk, naive = PlanCounters(w.num_layers), {k: np.zeros(w.num_layers, np.int64) for k in COUNTERS}
    for step in range(min(w.num_steps, 40)):
        for layer in range(w.num_layers):
            p = ctl.plan(step, layer)
            bulk.add(p)
            n, src = len(p.experts), p.source
            gpu_tokens = int(p.counts[p.on_gpu].sum())
            for key, v in (("activated", n), ("hits", p.hit.sum()), ("gpu_experts", (src != CPU).sum()),
                           ("cpu_experts", (src == CPU).sum()), ("on_demand", (src == FETCH).sum()),
                           ("prefetch_used", (src == PREFETCHED).sum()), ("prefetch_issued", len(p.prefetches)),
                           ("prefetch_wasted", len(p.prefetch_wasted)), ("admitted", p.admitted.sum()),
                           ("evicted", len(p.evicted)), ("staged", p.staged.sum()), ("swaps", len(p.swaps)),
                           ("gpu_tokens", gpu_tokens), ("cpu_tokens", int(p.counts.sum()) - gpu_tokens)):
                naive[key][layer] += v
        if step == 10:
            bulk.c["activated"] += 1  # changed in place, as the time bound's result does
            naive["activated"] += 1
    assert {k: bulk.c[k].tolist() for k in COUNTERS} == {k: v.tolist() for k, v in naive.items()}
    assert bulk.totals()["activated"] == int(naive["activated"].sum())
    assert naive["prefetch_issued"].sum() > 0 and naive["swaps"].sum() > 0 and naive["cpu_experts"].sum() > 0
