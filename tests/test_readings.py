"""Two readings of every competitor (docs/policies.md, "Readings"): the plain name as the DALI paper ran it
(or as the released code runs), NAME-best the most favourable reasonable reading; each with its source, and
`dali sim systems` says which is which."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import WHOLE, round_number_profile, tiny_model, write_hand_trace

from dali_sim.cli.main import cli
from dali_sim.models import get_model
from dali_sim.policies import resolve_system, system_names
from dali_sim.policies.base import SetupContext, initial_contents
from dali_sim.policies.systems import READINGS, system_reading
from dali_sim.runtime.memory import MemoryConfig, plan_memory
from dali_sim.sim import simulate
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize

COMPETITORS = ("llamacpp", "ktransformers", "hybrimoe", "fiddler", "mixtral-offloading", "moe-lightning")
MIXTRAL = get_model("mixtral-8x7b")


def test_every_preset_says_what_it_is_and_every_reading_names_its_source():
    for name in system_names():
        conf = resolve_system(name)
        assert conf.reading in READINGS and system_reading(name) == conf.reading, name
        if conf.reading in ("paper", "best"):
            assert conf.source and len(conf.source) > 40, name  # repository, commit, file, function
    for name in COMPETITORS:
        assert system_reading(name) == "paper" and system_reading(f"{name}-best") == "best", name
    assert {system_reading(n) for n in ("dali-plus", "lower-bound", "oracle-heuristic", "gpu-lru")} == \
        {"ours", "bound", "reference", "baseline"}


def test_systems_command_shows_the_readings():
    r = CliRunner().invoke(cli, ["sim", "systems"])
    assert r.exit_code == 0
    rows = {line.split()[0]: line.split()[1] for line in r.output.splitlines()[1:] if line and line.split()[0] in
            system_names()}
    assert rows["hybrimoe"] == "paper" and rows["hybrimoe-best"] == "best" and rows["dali-plus"] == "ours"
    assert "readings: paper = as the DALI paper ran the competitor" in r.output
    v = CliRunner().invoke(cli, ["sim", "systems", "-v"]).output
    assert "source: PKU-SEC-Lab/HybriMoE (commit 508a85b)" in v and "size(0) == 1" in v


def test_whole_layer_readings_are_matched_in_memory():
    """ktransformers, llamacpp and moe-lightning as the DALI paper ran them hold whole MoE layers with the
    expert bytes of the cache ratio (50%: 16 of Mixtral's 32 layers, the last ones); their -best readings
    (and the per-layer systems) keep 4 of 8 experts in every layer."""
    for name in ("ktransformers", "llamacpp", "llamacpp-best", "moe-lightning"):
        conf = resolve_system(name, {"memory": {"cache_ratio": "0.5"}}, MIXTRAL)
        plan = plan_memory(MIXTRAL, conf.memory, 24 * 2**30, 256)
        assert plan.capacities.tolist() == [0] * 16 + [8] * 16, name
        assert any("16 of 32 MoE layers" in n for n in plan.notes), name
    for name in ("ktransformers-best", "moe-lightning-best", "hybrimoe", "hybrimoe-best", "fiddler"):
        conf = resolve_system(name, {"memory": {"cache_ratio": "0.5"}}, MIXTRAL)
        assert plan_memory(MIXTRAL, conf.memory, 24 * 2**30, 256).capacities.tolist() == [4] * 32, name
    big = resolve_system("llamacpp", {"memory": {"cache_ratio": "1", "gpu_memory_gib": "8"}}, MIXTRAL)
    with pytest.raises(ValueError, match=r"32 whole layers x 8 experts .* at most \d+ whole layers fit"):
        plan_memory(MIXTRAL, big.memory, 0, 256)
    # without a ratio the layout fills the budget, as before
    fill = plan_memory(MIXTRAL, resolve_system("llamacpp", model=MIXTRAL).memory, 24 * 2**30, 256)
    assert 16 < int((fill.capacities > 0).sum()) < 32 and not fill.notes


def test_the_readings_differ_where_documented():
    ktp, ktb = resolve_system("ktransformers"), resolve_system("ktransformers-best")
    assert (ktp.placement.name, ktp.memory.layout, ktp.implementation) == ("static-layers", "whole-layers",
                                                                          "ktransformers")
    assert ktp.placement.config.offload_min_tokens == 30000  # the per-layer GPU prefill threshold
    assert (ktb.placement.name, ktb.memory.layout, ktb.implementation) == ("resident-gpu", "uniform", "kt-sglang")
    lp, lb = resolve_system("llamacpp"), resolve_system("llamacpp-best")
    assert (lp.implementation, lb.implementation) == ("llamacpp", "llamacpp-pinned")
    assert lp.placement == lb.placement and lp.memory == lb.memory
    fp, fb = resolve_system("fiddler"), resolve_system("fiddler-best")
    assert (fp.implementation, fb.implementation) == ("fiddler", "fiddler-best") and fp.placement == fb.placement
    mp, mb = resolve_system("mixtral-offloading"), resolve_system("mixtral-offloading-best")
    assert (mp.prefetch.name, mp.memory.cache_init, mp.implementation) == ("none", "highest-ids", "mixtral-offloading")
    assert (mb.prefetch.name, mb.implementation) == ("next-gate", "pytorch-eager")
    op, ob = resolve_system("moe-lightning"), resolve_system("moe-lightning-best")
    assert (op.memory.layout, ob.memory.layout) == ("whole-layers", "uniform") and op.cache.name == ob.cache.name
    hp, hb = resolve_system("hybrimoe"), resolve_system("hybrimoe-best")
    assert (hp.placement.config.hss_steps, hb.placement.config.hss_steps) == ("single-token", "all")
    assert (hp.prefetch.config.min_gain, hb.prefetch.config.min_gain) == (0.0, -1.0)
    assert (hp.cache.config.prefill_evicts, hb.cache.config.prefill_evicts) == (True, False)
    assert (hp.memory.cache_init, hb.memory.cache_init) == ("lowest-ids", "frequency")


def test_hybrimoe_paper_runs_a_two_token_step_all_on_the_gpu(tmp_path):
    """One MoE layer of 4 experts, top-2, no cache (0 slots), no prefetch; round-number costs (GPU 1 s per
    token, CPU 3 s, a copy 2 s). Step 0 (prefill, 2 tokens: [0, 1] and [0, 2]): loads 0[2], 1, 2.
      HSS (hybrimoe-best): GPU head 0 ends at max(0, 2) + 2 = 4 > CPU tail 2 at 3: the CPU takes 2; GPU 0 at
        4 <= CPU 1 at 6: GPU; GPU 1 at max(4, 2 + 2) + 1 = 5 <= 6: GPU: two on the GPU, one on the CPU.
      the released code (hybrimoe): a step of two tokens is not `generate`: all three on the GPU.
    Step 1 (decode, 1 token: [1, 3]): both schedule it, GPU 1 at max(0, 2) + 1 = 3 <= CPU 3 (ties to the GPU),
    then GPU 3 at max(3, 4) + 1 = 5 > CPU 3: the CPU takes 3."""
    model = tiny_model(num_layers=1, moe_layers=(0,), num_experts=4, top_k=2)
    path = write_hand_trace(tmp_path / "t.parquet", model, [(0, 0, "prefill", [[0, 1]]), (0, 1, "prefill", [[0, 2]]),
                                                            (0, 2, "decode", [[1, 3]])])
    profile = round_number_profile(tmp_path / "p.json", model)
    over = {"memory": {"cache_experts": "0", "prefetch_slots": "0"}, "prefetch": {"policy": "none"}}
    paper = simulate(path, "hybrimoe", hardware=profile, overrides=over, profiling=WHOLE).summary
    best = simulate(path, "hybrimoe-best", hardware=profile, overrides=over, profiling=WHOLE).summary
    assert (paper["gpu_experts"], paper["cpu_experts"]) == (4, 1)
    assert (best["gpu_experts"], best["cpu_experts"]) == (3, 2)
    assert paper["on_demand"] == 4 and best["on_demand"] == 3


def test_llamacpp_best_copies_at_the_pinned_rate(tmp_path):
    """Op offload (a step of >= 32 tokens copies its CPU layers' experts): llama.cpp's mmap'd weights are
    pageable, --no-mmap pins them; the same plans, a faster prefill, the same decode."""
    path = tmp_path / "m.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=40, gen_len=3, seed=2), path)
    t = read_trace(path)
    over = {"memory": {"cache_ratio": "0.5"}}
    plain = simulate(t, "llamacpp", overrides=over).summary
    best = simulate(t, "llamacpp-best", overrides=over).summary
    assert plain["on_demand"] == best["on_demand"] > 0 and plain["hits"] == best["hits"]
    assert best["prefill_s"] < plain["prefill_s"] and best["decode_s"] == pytest.approx(plain["decode_s"])


def test_initial_contents_by_id():
    ctx = SetupContext(num_layers=1, num_experts=8, top_k=2, capacities=np.array([3]),
                       frequencies=np.zeros((1, 8), np.int64), costs=None, seed=0, block_of_layer=(0,))
    rng = np.random.default_rng(0)
    assert initial_contents(0, 3, ctx, "lowest-ids", rng) == [0, 1, 2]
    assert initial_contents(0, 3, ctx, "highest-ids", rng) == [5, 6, 7]
    assert initial_contents(0, 9, ctx, "highest-ids", rng) == list(range(8))
    with pytest.raises(ValueError, match="no evaluated-workload frequencies"):
        initial_contents(0, 3, ctx, "frequency-hindsight", rng)
    with pytest.raises(ValueError, match="memory.cache_init must be one of"):
        MemoryConfig(cache_init="middle-ids")
    # the command line offers the same names (written out there: `dali --help` imports no memory plan)
    from dali_sim.cli.sim import run_cmd
    from dali_sim.runtime.memory import CACHE_INITS

    choice = next(p for p in run_cmd.params if p.name == "cache_init").type.choices
    assert tuple(choice) == CACHE_INITS
