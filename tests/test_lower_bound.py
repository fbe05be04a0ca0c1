"""The time lower bound (``lower-bound`` preset, docs/bounds.md): by hand, never beaten, and its labels.

The property tests draw small synthetic traces (several models, precisions, lookahead columns for
every preset), GPU budgets between the smallest working set and the profile's GPU, and batch sizes,
then run every preset that is not a bound: none may be faster than the bound in makespan, prefill
or decode time, any sequence's TTFT or decode time; and no cache that does not swap may count more
hits than the ``optimal`` cache with the same slots and initial contents.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from conftest import WHOLE, round_number_profile, tiny_model, write_hand_trace

from dali_sim.models import get_model
from dali_sim.policies import CACHES, CachePolicy, resolve_system, system_names
from dali_sim.runtime.future import write_future
from dali_sim.runtime.memory import GIB, MemoryConfig, plan_memory
from dali_sim.sim import simulate
from dali_sim.sim.lower_bound import LAMBDAS, always_paid, reuse_bound
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload import Workload, WorkloadConfig

DATA = Path(__file__).resolve().parent / "data"
LOOKAHEAD = ("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")
SYSTEMS = [s for s in system_names() if not resolve_system(s).time_bound]
#: caches that never swap: the optimal cache bounds their hits
NO_SWAP = [c for c in CACHES.names() if CACHES.get(c).rebalance is CachePolicy.rebalance]


def test_golden_trace_by_hand(tmp_path):
    """tests/data/sim-golden.parquet on the round-number profile (GPU 1 s/token, CPU 3 s/token, copy 2 s,
    dense 0.5 s), 24 GiB: all 10 experts fit, so every use can be served from resident weights and
    the bound is the best split per layer, transfers free. Decode layers (two 1-token experts): both on
    the GPU, 2 s. Step 0 layer 0, workloads 2,2,1,1: the CPU takes a 1-token expert (3 s), the GPU
    the rest (5 s): 5; step 0 layer 1, 3,2,1: CPU the 1-token one, GPU 5: 5; step 4 (batch 1), layers
    2,1,1: CPU one 1-token (3), GPU 3: 3 each. 14 dense parts x 0.5 = 7 s + 36 s = 43 s: hybrimoe-best's
    time (tests/test_preset_goldens.py), so the bound is tight there."""
    trace = read_trace(DATA / "sim-golden.parquet")
    profile = round_number_profile(tmp_path / "p.json", trace.model)
    r = simulate(trace, "lower-bound", hardware=profile, profiling=WHOLE)
    s = r.summary
    assert s["makespan_s"] == pytest.approx(43.0)
    assert s["bounds"] == {"time": "lower-bound"} and s["oracles"] == {}
    assert r.per_step["time_s"].tolist() == pytest.approx([11.0, 5.0, 5.0, 5.0, 7.0, 5.0, 5.0])
    assert s["lower_bound"]["expert_slots"] == 10 and s["lower_bound"]["reuse"] == 33
    assert np.isnan(s["hits"]) and np.isnan(s["hit_rate"]) and s["activated"] == 33
    assert r.per_layer["activated"].tolist() == [17, 16]
    assert r.per_layer["time_s"].sum() == pytest.approx(43.0)
    hyb = simulate(trace, "hybrimoe-best", hardware=profile, overrides={"prefetch": {"policy": "none"}},
                   profiling=WHOLE)
    assert hyb.summary["makespan_s"] == pytest.approx(43.0)
    with pytest.raises(ValueError, match="time bound: it has no counts-only mode"):
        simulate(trace, "lower-bound", hardware=profile, timing=False, profiling=WHOLE)
    with pytest.raises(ValueError, match="time bound with no cache policy"):
        resolve_system("lower-bound", {"cache": {"policy": "lru"}})


def _one_layer(tmp_path, demand, num_experts):
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=num_experts, top_k=1)
    rows = [(0, pos, "decode", [[e]]) for pos, e in enumerate(demand)]
    return read_trace(write_hand_trace(tmp_path / "t.parquet", model, rows))


def _budget_for(trace, slots: int, batch: int = 1) -> str:
    w = Workload(trace, WorkloadConfig(batch))
    base = plan_memory(trace.model, MemoryConfig(gpu_memory_gib=1e6, layout="none", staging_slots=0), 0,
                       w.max_batch_context)
    return repr((base.used_bytes + (slots + 0.5) * trace.model.expert_bytes) / GIB)


def test_the_link_term_by_hand(tmp_path):
    """One layer, 4 decode steps of one expert each (0 1 2 3), CPU 30 s per token (the GPU is worth any
    copy), no expert-sized buffer at all (so nothing is ever resident and every GPU use needs a 2 s copy).
    A(x) = 4 x 0.5 + per step 1 (GPU) or 30 (CPU); B(x) = 2 x (GPU uses). Per step min(30 lam,
    lam + 2 (1 - lam)) = min(30 lam, 2 - lam); LB(lam) = 2 lam + 4 min(30 lam, 2 - lam), largest at the
    first grid point at or above lam = 2/31: 8 - 2 lam = 8 - 0.13 = 7.87 (the all-GPU system's max(A, B)
    is 8; the transfers-free bound is 6)."""
    trace = _one_layer(tmp_path, [0, 1, 2, 3], 4)
    profile = round_number_profile(tmp_path / "p.json", trace.model, cpu=(30.0, 60.0))
    none = {"memory": {"gpu_memory_gib": _budget_for(trace, 0)}}
    r = simulate(trace, "lower-bound", hardware=profile, overrides=none, profiling=WHOLE)
    lb = r.summary["lower_bound"]
    lam = LAMBDAS[np.searchsorted(LAMBDAS, 2 / 31)]
    assert lb["expert_slots"] == 0 and lb["reuse"] == 0 and lb["compute_s"] == pytest.approx(6.0)
    assert lam == pytest.approx(0.065)
    assert r.summary["makespan_s"] == pytest.approx(8 - 2 * lam) == pytest.approx(7.87)
    assert r.summary["decode_s"] == pytest.approx(7.87)
    assert r.manifest["memory"]["expert_slots"] == 0


def test_reuse_bound_by_hand(tmp_path):
    """Demand 0 1 0 1 (one layer): intervals start->0 (gap before visit 0), start->1 (gaps before 0, 1),
    0: 0->2 (gaps 1, 2), 1: 1->3 (gaps 2, 3). One slot: at most one interval per gap, so 2 (e.g.
    start->0 and 1->3); two slots: all 4 (both experts fit); none: 0."""
    w = Workload(_one_layer(tmp_path, [0, 1, 0, 1], 2))
    assert [reuse_bound(w, 0, 3, k) for k in (0, 1, 2)] == [0, 2, 4]
    assert reuse_bound(w, 2, 3, 1) == 1  # the span's own start: one of 0, 1 free


def test_always_paid_takes_the_faster_device():
    """switch-base-8 has 6 dense blocks between its MoE layers: per step 6 blocks + 6 MoE dense parts."""
    from dali_sim.hardware.cost import CostModel
    from dali_sim.hardware.profile import load_profile

    model = get_model("switch-base-8")
    costs = CostModel(load_profile("rtx3090-epyc7532"), model)

    class W:  # the fields always_paid reads
        step_tokens, step_context, step_kv = np.array([1, 64]), np.array([10.0, 32.0]), np.array([10, 64])
        num_steps, num_layers = 2, model.num_moe_layers
    W.model = model
    moe, blocks = always_paid([costs], W)
    for d in ("gpu", "cpu"):
        assert (moe <= costs.dense_time(d, W.step_tokens, W.step_context, W.step_kv) + 1e-15).all()
        assert (blocks <= 6 * costs.dense_block_time(d, W.step_tokens, W.step_context, W.step_kv) + 1e-15).all()
    assert (moe > 0).all() and (blocks > 0).all()


# ---- never beaten --------------------------------------------------------------------------------
MODELS = ("switch-base-8", "olmoe-1b-7b", "mixtral-8x7b", "deepseek-v2-lite")
PRECISIONS = ("bf16", "q4_0", "mxfp4")


def random_case(i: int, tmp_path: Path):
    rng = random.Random(1000 + i)
    model = MODELS[i % len(MODELS)]
    cfg = SynthConfig(model=model, sequences=rng.randint(1, 3), prompt_len=rng.randint(1, 6),
                      gen_len=rng.randint(1, 6), seed=i, precision=rng.choice(PRECISIONS),
                      prompt_len_jitter=0.5, gen_len_jitter=0.5, lookahead=LOOKAHEAD)
    path = tmp_path / f"case{i}.parquet"
    synthesize(cfg, path)
    trace = read_trace(path)
    # at most the trace's sequences (a larger batch is an error; it used to run as this one)
    batch = min(rng.randint(1, 3), trace.num_sequences)
    spec, w = trace.model, Workload(trace, WorkloadConfig(batch))
    base = plan_memory(spec, MemoryConfig(gpu_memory_gib=1e6, layout="none", staging_slots=0), 0, w.max_batch_context)
    full = 24 * GIB
    # from no expert buffer up to the whole 24 GiB GPU, log-uniform in the buffer count
    top = max(1, (full - base.used_bytes) // spec.expert_bytes)
    slots = int(round(np.exp(rng.uniform(0, np.log(top + 1))))) - 1
    hardware = rng.choice(("rtx3090-epyc7532", "rtx4090-ddr5-desktop"))
    return trace, batch, _budget_for(trace, slots, batch), hardware


def _check_case(i: int, tmp_path: Path):
    trace, batch, budget, hardware = random_case(i, tmp_path)
    write_future(trace, WorkloadConfig(batch), share=0.0)
    mem = {"memory": {"gpu_memory_gib": budget}}
    lb = simulate(trace, "lower-bound", batch_size=batch, hardware=hardware, overrides=mem, profiling=WHOLE)
    b_seq = lb.per_sequence.set_index("seq_id")
    ran = 0
    for name in SYSTEMS:
        try:
            r = simulate(trace, name, batch_size=batch, hardware=hardware, overrides=mem, profiling=WHOLE)
        except ValueError as exc:
            if "budget" in str(exc) or "do not fit" in str(exc):
                continue  # this preset's memory plan does not fit the budget: not a system here
            raise
        ran += 1
        s, b = r.summary, lb.summary
        tol = 1e-9
        assert s["makespan_s"] >= b["makespan_s"] * (1 - tol), (name, s["makespan_s"], b["makespan_s"])
        for key in ("prefill_s", "decode_s"):
            assert s[key] >= b[key] * (1 - tol) - 1e-12, (name, key, s[key], b[key])
        seq = r.per_sequence.set_index("seq_id")
        for col in ("ttft_s", "decode_time_s"):
            ok = seq[col].isna() | (seq[col] >= b_seq[col] * (1 - tol) - 1e-12)
            assert ok.all(), (name, col, seq[col].tolist(), b_seq[col].tolist())
    assert ran >= 2  # cpu-only and ktransformers need no expert buffer: at least they always run
    # caches that do not swap: at most the optimal cache's hits, at the same slots and initial contents
    slots = str(random.Random(i).randint(1, trace.num_experts - 1))
    for init in ("empty", "frequency"):
        over = {"memory": {"gpu_memory_gib": "4096", "cache_experts": slots, "cache_init": init}}
        best = simulate(trace, "gpu-lru", batch_size=batch, hardware=hardware, timing=False,
                        overrides={**over, "cache": {"policy": "optimal"}}, profiling=WHOLE).summary["hits"]
        for cache in NO_SWAP:
            if cache == "static" and init == "empty":
                continue
            hits = simulate(trace, "gpu-lru", batch_size=batch, hardware=hardware, timing=False,
                            overrides={**over, "cache": {"policy": cache}}, profiling=WHOLE).summary["hits"]
            assert hits <= best, (cache, init, hits, best)


@pytest.mark.parametrize("i", range(4))
def test_no_preset_beats_the_bound(i, tmp_path):
    _check_case(i, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(4, 40))
def test_no_preset_beats_the_bound_more_cases(i, tmp_path):
    _check_case(i, tmp_path)


# ---- the command line ----------------------------------------------------------------------------
def test_cli_labels_bounds_and_oracle_heuristics(tmp_path):
    import json

    from click.testing import CliRunner

    from dali_sim.cli.main import cli

    golden = DATA / "sim-golden.parquet"
    profile = str(round_number_profile(tmp_path / "p.json", read_trace(golden).model))
    whole = ["--profile-share", "0"]  # the golden trace evaluated whole, as the hand derivation
    run = CliRunner().invoke(cli, ["sim", "run", "--trace", str(golden), "--system", "lower-bound", "--hardware",
                                   profile, "--cache-experts", "2", *whole])
    assert run.exit_code == 0, run.output
    assert "BOUND: time lower-bound bounds time" in run.output and "makespan 43.000 s" in run.output
    assert "memory.cache_experts not used" in run.output and "10 expert buffers" in run.output
    js = CliRunner().invoke(cli, ["sim", "run", "--trace", str(golden), "--system", "lower-bound", "--hardware",
                                  profile, "--json", *whole])
    d = json.loads(js.output)
    assert d["bounds"] == {"time": "lower-bound"} and d["hits"] is None and d["makespan_s"] == pytest.approx(43.0)
    future = write_future(read_trace(golden), WorkloadConfig(1), tmp_path / "f.parquet", share=0.0)
    cmp = CliRunner().invoke(cli, ["sim", "compare", "--trace", str(golden), "--hardware", profile, "--future",
                                   str(future), "--systems", "lower-bound,oracle-heuristic,fiddler", *whole])
    assert cmp.exit_code == 0, cmp.output
    assert "lower-bound: BOUND: time lower-bound" in cmp.output
    assert "oracle-heuristic: ORACLE HEURISTIC: cache belady reads the future" in cmp.output
    assert "oracle-heuristic: BOUND: placement optimal bounds DALI's per-layer objective" in cmp.output
    assert "fiddler: " not in cmp.output
    systems = CliRunner().invoke(cli, ["sim", "systems"])
    assert "lower-bound" in systems.output and "oracle-heuristic" in systems.output
    assert "\noracle " not in systems.output


def test_the_bound_takes_the_least_implementation(tmp_path):
    """``any`` (the preset's default) takes every term's least over the implementations the profile
    prices, so it is at most the bound for any one of them; a named implementation bounds the systems
    run by it (llama.cpp's kernel and sync costs included), and ``any`` is refused outside a bound."""
    cfg = SynthConfig(model="mixtral-8x7b", sequences=2, prompt_len=4, gen_len=4, seed=3, precision="q4_0")
    trace = read_trace(synthesize(cfg, tmp_path / "m.parquet"))
    budget = {"memory": {"gpu_memory_gib": "12"}}
    anyb = simulate(trace, "lower-bound", overrides=budget, profiling=WHOLE)
    assert anyb.manifest["implementation"]["name"].split(",")[0] != "any"
    assert len(anyb.manifest["implementation"]["name"].split(",")) > 3
    llama_b = simulate(trace, "lower-bound", overrides={**budget, "system": {"implementation": "llamacpp"}},
                       profiling=WHOLE)
    llama = simulate(trace, "llamacpp", overrides=budget, profiling=WHOLE)
    assert anyb.summary["makespan_s"] <= llama_b.summary["makespan_s"] <= llama.summary["makespan_s"]
    assert llama_b.summary["makespan_s"] > anyb.summary["makespan_s"]  # llama.cpp's own costs count
    with pytest.raises(ValueError, match="implementation=any is only for a time bound"):
        resolve_system("gpu-lru", {"system": {"implementation": "any"}})
