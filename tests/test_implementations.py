"""Implementation traits: the shipped table, the costs they add, and how the engine applies them, on
hand-computed cases (round-number profiles) and on the cost model's own formulas."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from importlib import resources

import numpy as np
import pytest
from conftest import OVERLAP_MODEL, WHOLE, round_number_profile, tiny_model
from test_hardware import EXAMPLE as EXAMPLE_MEASURED
from test_hardware import TOY_PARAMS, toy_model, toy_profile_dict
from test_sim_overlap import spans, split_system

from dali_sim.hardware import CostModel, load_profile, profile_from_dict
from dali_sim.hardware.implementation import (
    EXECUTOR,
    KERNEL_KEYS,
    PREFETCH_BUFFERS,
    Implementation,
    get_implementation,
    implementation_from_dict,
    implementation_names,
)
from dali_sim.policies.systems import resolve_system
from dali_sim.runtime.controller import Controller
from dali_sim.runtime.memory import plan_memory
from dali_sim.sim.counters import PlanCounters
from dali_sim.sim.engine import SimEngine
from dali_sim.sim.simulate import simulate
from dali_sim.trace import TraceWriter, read_trace
from dali_sim.workload.builder import Workload, WorkloadConfig


# ---- the table ------------------------------------------------------------------------------------
def test_every_shipped_implementation_loads_and_cites_every_trait():
    raw = tomllib.loads(resources.files("dali_sim.hardware").joinpath("implementations.toml").read_text())
    assert set(raw) == set(implementation_names()) >= {"llamacpp", "ktransformers", "dali-executor", "bare"}
    for name, table in raw.items():
        impl = get_implementation(name)
        traits = [k for k in table if not k.endswith("_source") and k != "description"]
        assert all(impl.sources[t].strip() for t in traits), name
        assert set(impl.kernels) <= set(KERNEL_KEYS)


@pytest.mark.parametrize("change, message", [
    ({"copy_from": "dma"}, "copy_from must be one of pinned, pageable"),
    ({"kernels": {"bogus": 1}, "kernels_source": "x"}, "unknown key"),
    ({"kernels": {"expert": -1}, "kernels_source": "x"}, "kernels.expert must be a non-negative integer"),
    ({"lanes_overlap": "yes"}, "lanes_overlap must be one of always, decode, never"),
    ({"activation_copies": "yes", "activation_copies_source": "x"}, "activation_copies must be true or false"),
    ({"host_op_us": -1.0, "host_op_us_source": "x"}, "host_op_us must be a finite number >= 0"),
    ({"speed": 1, "speed_source": "x"}, "no trait 'speed'"),
])
def test_bad_implementation_tables_are_refused(change, message):
    base = {"description": "d", "copy_from": "pinned", "copy_from_source": "s", "lanes_overlap": "always",
            "lanes_overlap_source": "s"}
    with pytest.raises(ValueError, match=message):
        implementation_from_dict("x", {**base, **change})
    with pytest.raises(ValueError, match="lanes_overlap_source: missing"):
        implementation_from_dict("x", {"description": "d", "lanes_overlap": "always"})


def test_unknown_implementation_is_refused_listing_the_known():
    with pytest.raises(ValueError, match="unknown implementation 'nope'; known: .*llamacpp"):
        resolve_system("gpu-lru", {"system": {"implementation": "nope"}})


# ---- costs the traits add (toy profile: GPU 100 TFLOP/s peak x 0.5, 1000 GB/s x 0.5) ----------------
def _cm(impl=None, profile_over=None, **model_kw):
    d = toy_profile_dict()
    for part, fields in (profile_over or {}).items():
        d[part].update(fields)
    return CostModel(profile_from_dict(d), toy_model(**model_kw), implementation=impl or "bare")


def test_gemm_tile_fill_lowers_the_rate_but_not_below_simt():
    """Tile of 128 tokens: at n = 64 the tensor rate is 50 TFLOP/s x 2*64/192 = 33.3; at n = 16, 50 x
    32/144 = 11.1 < the fp32 (SIMT) rate 50 x 0.5 = 25, so 25; at n >= 128 the full 50."""
    cm = _cm(profile_over={"gpu": {"gemm_tile_tokens": 128}})
    for n, rate in ((64, 50e12 * 128 / 192), (16, 25e12), (128, 50e12), (1000, 50e12)):
        flops_t = 2 * n * TOY_PARAMS / rate
        bytes_t = (2 * TOY_PARAMS + n * 2 * (2 * 1024 + 2 * 2048)) / 500e9
        assert cm.expert_time("gpu", n) == pytest.approx(max(flops_t, bytes_t)), n


def test_kernel_counts_times_kernel_cost():
    impl = Implementation("k", "d", gpu_experts="grouped", kernels={"dense_gqa": 3, "moe": 7, "head": 2, "cpu_moe": 4})
    cm, bare = _cm(impl), _cm()
    assert cm.expert_time("gpu", 4) == bare.expert_time("gpu", 4)  # grouped: nothing per expert
    assert cm.lane_overhead("gpu") == pytest.approx(7 * 10e-6) and cm.lane_overhead("cpu") == pytest.approx(4 * 5e-6)
    assert cm.dense_time("gpu", 4, 16) == pytest.approx(bare.dense_time("gpu", 4, 16) + 3 * 10e-6)
    assert cm.lm_head_time("gpu", 4) == pytest.approx(bare.lm_head_time("gpu", 4) + 2 * 10e-6)
    per = Implementation("p", "d", gpu_experts="per-expert", kernels={"expert": 5, "cpu_expert": 2})
    cp = _cm(per)
    assert cp.expert_time("gpu", 4) == pytest.approx(bare.expert_time("gpu", 4) + 5 * 10e-6)
    assert cp.expert_time("cpu", 4) == pytest.approx(bare.expert_time("cpu", 4) + 2 * 5e-6)
    assert cp.lane_overhead("gpu") == 0.0


def test_host_launches_syncs_and_graphs():
    """launch 4 us + the framework's 2 us per kernel; 10 dense kernels, 3 per GPU expert, one per copy;
    2 syncs per GPU expert of 15 us each."""
    impl = Implementation("h", "d", host="launches", host_op_us=2.0, gpu_experts="per-expert",
                          kernels={"dense_gqa": 10, "expert": 3, "sync_expert": 2})
    cm = _cm(impl, profile_over={"gpu": {"launch_us": 4.0, "sync_us": 15.0}})
    launches = (10 + 2 * 3 + 1) * 6e-6  # 2 GPU experts, 1 copy
    assert cm.host_layer_time(2, 0, 1) == pytest.approx(launches + 4 * 15e-6)
    # device work hides launches, not syncs
    assert cm.host_layer_time(2, 0, 1, device_s=1.0) == pytest.approx(4 * 15e-6)
    assert cm.host_layer_time(2, 0, 1, device_s=launches / 2) == pytest.approx(launches / 2 + 4 * 15e-6)
    assert cm.host_layer_time(2, 0, 1, graph=True) == 0.0
    # a dense part on the CPU launches nothing on the GPU
    assert cm.host_layer_time(0, 3, 0, dense_on_gpu=False) == 0.0
    assert _cm().host_layer_time(5, 5, 5) == 0.0  # bare


def test_a_loop_over_every_expert_syncs_once_per_expert_of_the_layer():
    """KTransformers' GPU-resident layers ask every one of the layer's experts (4 in the toy) whether it has
    tokens: 4 syncs of 15 us in a layer that runs GPU experts, none in one that does not."""
    impl = Implementation("a", "d", host="launches", kernels={"sync_all_experts": 1})
    cm = _cm(impl, profile_over={"gpu": {"sync_us": 15.0}})
    assert cm.host_layer_time(1, 0, 0, device_s=1.0) == pytest.approx(4 * 15e-6)
    assert cm.host_layer_time(0, 2, 0, device_s=1.0) == 0.0


def test_pageable_copies_use_the_pageable_efficiency():
    pinned = _cm(Implementation("a", "d", copy_from="pinned"))
    pageable = _cm(Implementation("b", "d", copy_from="pageable"))
    assert pinned.transfer_time(1e9) == pytest.approx(10e-6 + 1e9 / (25e9 * 0.8))
    assert pageable.transfer_time(1e9) == pytest.approx(10e-6 + 1e9 / (25e9 * 0.4))
    # host memory a copy draws: the DMA's read; a pageable one also the driver's staging copy (read + write)
    assert pinned.copy_demand == pytest.approx(25e9 * 0.8)
    assert pageable.copy_demand == pytest.approx(3 * 25e9 * 0.4)


def test_dense_precision_and_shared_split():
    """mxfp4 experts and a bf16 rest: the dense part reads bf16 bytes; without the shared experts the
    dense part is cheaper by about the shared experts' own time."""
    from dali_sim.models.presets import get_precision

    spec = toy_model(num_shared_experts=1, shared_expert_intermediate_size=2048,
                     precision=get_precision("mxfp4"), dense_precision=get_precision("bf16"))
    cm = CostModel(profile_from_dict(toy_profile_dict()), spec)
    assert spec.expert_bytes == round(TOY_PARAMS * 0.53125) and spec.bytes_of(100) == 200
    full, attn, shared = cm.dense_time("gpu", 1, 0), cm.dense_time("gpu", 1, 0, shared=False), cm.shared_expert_time("gpu", 1)
    assert attn < full and full == pytest.approx(attn + shared, rel=1e-3)
    assert spec.precision_label == "mxfp4/bf16"


def test_lm_head_tokens_per_step(overlap_trace):
    """Decode steps need logits for every token, a prefill step for each prompt's last token only."""
    w = Workload(overlap_trace, WorkloadConfig(1))
    assert w.step_tokens.tolist() == [2, 1] and w.step_logit_tokens.tolist() == [1, 1]


# ---- the engine applies the traits (round numbers: GPU 1 s/token, CPU 3 s/token, copy 2 s, dense 0.5 s) --
def _engine(trace, system, profile_path, impl, shortcut=True):
    """One timed run of ``system`` with implementation ``impl`` (bypassing simulate()'s choice)."""
    profile = load_profile(profile_path)
    model = trace.model
    costs = CostModel(profile, model, implementation=impl, system=system.name)
    placement, cache, prefetch = (c.build() for c in (system.placement, system.cache, system.prefetch))
    w = Workload(trace, WorkloadConfig(1))
    mem = plan_memory(model, system.memory, profile.gpu_memory_bytes, w.max_batch_context,
                      required=placement.required_capacities(w.num_layers, w.num_experts))
    ctl = Controller(w, costs, placement, cache, prefetch, mem.capacities, cache_init=system.memory.cache_init,
                     prefetch_slots=mem.prefetch_slots, staging_slots=mem.staging_slots)
    engine = SimEngine(w, ctl, costs, PlanCounters(w.num_layers), dense_device=system.dense_device,
                       staging_slots=mem.staging_slots, record=True, shortcut=shortcut)
    return engine.run()


def _spans(out):
    return sorted((iv.track, iv.name, iv.start, iv.end) for iv in out.intervals)


def test_serial_lanes_run_the_cpu_lane_then_the_gpu_lane(overlap_trace, round_profile):
    """Case C with lanes one after the other: step 0 layer 0: dense 0-0.5, CPU E0 0.5-6.5; then the GPU
    lane: copies E1 6.5-8.5, E2 8.5-10.5, computes E1 8.5-9.5, E2 10.5-11.5."""
    impl = dataclasses.replace(get_implementation("bare"), name="serial", lanes_overlap="never")
    out = _engine(overlap_trace, split_system([0]), round_profile, impl)
    first = [s for s in _spans(out) if s[2] < 11.5]
    assert first == sorted([("gpu", "dense L0", 0.0, 0.5), ("cpu", "L0 E0", 0.5, 6.5),
                            ("pcie", "fetch L0 E1", 6.5, 8.5), ("pcie", "fetch L0 E2", 8.5, 10.5),
                            ("gpu", "L0 E1", 8.5, 9.5), ("gpu", "L0 E2", 10.5, 11.5)])


def test_a_grouped_launch_waits_for_every_copy(overlap_trace, round_profile):
    """gpu-lru (all on the GPU) with a grouped launch that needs all weights: step 0 layer 0 copies E0, E1,
    E2 back to back 0.5-6.5 (admitted E0, E1 and staged E2 with one layer of buffers), then computes all:
    E0 (2 tokens) 6.5-8.5, E1 8.5-9.5, E2 9.5-10.5."""
    impl = dataclasses.replace(get_implementation("bare"), name="grouped", gpu_experts="grouped",
                               compute_waits_copies=True)
    system = resolve_system("gpu-lru", {"memory": {"cache_experts": "2", "staging_slots": "-1"}})
    out = _engine(overlap_trace, system, round_profile, impl)
    gpu = [s for s in _spans(out) if s[0] == "gpu" and s[2] < 10.5 and not s[1].startswith("dense")]
    assert gpu == [("gpu", "L0 E0", 6.5, 8.5), ("gpu", "L0 E1", 8.5, 9.5), ("gpu", "L0 E2", 9.5, 10.5)]
    assert max(s[3] for s in _spans(out) if s[0] == "pcie" and s[2] < 6.5) == 6.5


@pytest.mark.parametrize("shortcut", [True, False])
def test_calls_on_what_has_landed_pay_the_fixed_part_each(tmp_path, overlap_trace, shortcut):
    """The executor computes whatever has landed in one call (fixed part 0.25 s): gpu-lru step 0 layer 0
    copies E0 0.5-2.5, E1 2.5-4.5, E2 4.5-6.5; the lane waits for E0, calls on {E0} 2.5-2.75, E0 (2 tokens)
    2.75-4.75, on {E1} (landed meanwhile) 4.75-5.0, E1 5.0-6.0, waits, on {E2} 6.5-6.75, E2 6.75-7.75.
    One call per layer pays 0.25 s once, before the experts: E0 2.5-4.5, E1 4.5-5.5, E2 6.5-7.5."""
    prof = round_number_profile(tmp_path / "lanes.json", OVERLAP_MODEL, lanes={"gpu": 0.25})
    system = resolve_system("gpu-lru", {"memory": {"cache_experts": "2", "staging_slots": "-1"}})
    landed = dataclasses.replace(get_implementation("bare"), name="landed", gpu_calls="landed")
    out = _engine(overlap_trace, system, prof, landed, shortcut)
    gpu = [s for s in _spans(out) if s[0] == "gpu" and s[2] < 7.75 and not s[1].startswith("dense")]
    assert gpu == [("gpu", "L0 E0", 2.75, 4.75), ("gpu", "L0 E1", 5.0, 6.0), ("gpu", "L0 E2", 6.75, 7.75),
                   ("gpu", "overhead L0", 2.5, 2.75), ("gpu", "overhead L0", 4.75, 5.0),
                   ("gpu", "overhead L0", 6.5, 6.75)]
    out = _engine(overlap_trace, system, prof, get_implementation("bare"), shortcut)
    gpu = [s for s in _spans(out) if s[0] == "gpu" and s[2] < 7.5 and not s[1].startswith("dense")]
    assert gpu == [("gpu", "L0 E0", 2.5, 4.5), ("gpu", "L0 E1", 4.5, 5.5), ("gpu", "L0 E2", 6.5, 7.5),
                   ("gpu", "overhead L0", 0.5, 0.75)]


@pytest.mark.parametrize("wakes, cpu_experts, start", [("never", [0], 0.5), ("always", [0], 0.75),
                                                       ("beside-gpu", [0], 0.75), ("always", [0, 1, 2], 0.75),
                                                       ("beside-gpu", [0, 1, 2], 0.5)])
def test_a_sleeping_cpu_lane_pays_its_wake_up(tmp_path, overlap_trace, wakes, cpu_experts, start):
    """A profile whose CPU lane's call costs 0.25 s more after its thread slept: step 0 layer 0's CPU lane
    (E0, 2 tokens: 6 s) starts after the 0.5 s dense part, at 0.5 without the trait, at 0.75 when every CPU
    call pays it, and with "beside-gpu" only when the layer also has GPU experts (E1 on the GPU; with every
    expert on the CPU the executor runs the lane inline, nothing sleeps)."""
    prof = round_number_profile(tmp_path / "wake.json", OVERLAP_MODEL, lane_wake={"cpu": 0.25})
    impl = dataclasses.replace(get_implementation("bare"), name="wake", cpu_lane_wakes=wakes)
    out = _engine(overlap_trace, split_system(cpu_experts), prof, impl)
    e0 = [s for s in _spans(out) if s[:2] == ("cpu", "L0 E0")][0]
    assert e0[2:] == (start, start + 6.0)
    assert CostModel(load_profile(prof), OVERLAP_MODEL).lane_wake("cpu") == 0.25
    assert CostModel(load_profile(prof), OVERLAP_MODEL).lane_wake("gpu") == 0.0  # not measured: none
    with pytest.raises(ValueError, match="cpu_lane_wakes must be one of never, always, beside-gpu"):
        dataclasses.replace(impl, cpu_lane_wakes="sometimes")


@pytest.mark.parametrize("wakes, cpu_experts, charged", [("never", [0], False), ("always", [0], True),
                                                         ("beside-gpu", [0], True), ("always", [0, 1, 2], False)])
@pytest.mark.parametrize("shortcut", [True, False])
def test_the_accelerator_lane_pays_the_wake_of_the_cpu_lane_beside_it(tmp_path, overlap_trace, wakes, cpu_experts,
                                                                      charged, shortcut):
    """A profile whose accelerator call costs 0.125 s more when the CPU lane's sleeping worker is woken as it
    starts (``lane_wake.gpu``): in step 0 layer 0 (E0 on the CPU, E1 and E2 on the GPU) the GPU lane pays it
    after the 0.5 s dense part, before its experts, wherever the CPU lane wakes; not without a CPU lane
    beside GPU experts, nor where nothing wakes."""
    prof = round_number_profile(tmp_path / "wake.json", OVERLAP_MODEL, lane_wake={"cpu": 0.25, "gpu": 0.125})
    impl = dataclasses.replace(get_implementation("bare"), name="wake", cpu_lane_wakes=wakes)
    out = _engine(overlap_trace, split_system(cpu_experts), prof, impl, shortcut)
    overhead = [s for s in _spans(out) if s[:2] == ("gpu", "overhead L0") and s[2] < 1.0]
    assert overhead == ([("gpu", "overhead L0", 0.5, 0.625)] if charged else [])


@pytest.mark.parametrize("wakes, cpu_experts, handed", [("never", [0], False), ("always", [0], True),
                                                        ("beside-gpu", [0], True), ("always", [0, 1, 2], True),
                                                        ("beside-gpu", [0, 1, 2], False)])
def test_the_host_pays_its_hand_over_of_the_cpu_lane_to_a_sleeping_worker(tmp_path, overlap_trace, wakes,
                                                                         cpu_experts, handed):
    """A profile whose host pays 0.125 s to hand work to a sleeping thread (``lane_wake.host``): wherever the
    implementation hands the CPU lane to its worker, the layer visit's host time is 0.125 s before its dense part
    (0.5 s) and the lanes start after both: in the 3 of the 4 layer visits with E0 on the CPU lane, in all 4 with
    every expert there; with "beside-gpu" only beside GPU experts (every expert on the CPU: the executor runs
    the lane inline)."""
    prof = round_number_profile(tmp_path / "handoff.json", OVERLAP_MODEL, lane_wake={"host": 0.125})
    impl = dataclasses.replace(get_implementation("bare"), name="handoff", cpu_lane_wakes=wakes)
    out = _engine(overlap_trace, split_system(cpu_experts), prof, impl)
    got = _spans(out)
    host = [s for s in got if s[0] == "host"]
    e0 = [s for s in got if s[:2] == ("cpu", "L0 E0")][0]
    if handed:
        assert host[0] == ("host", "host L0", 0, 0.125) and all(b - a == 0.125 for _, _, a, b in host)
        assert len(host) == (3 if cpu_experts == [0] else 4)  # (E0 is in 3 of the 4 layer visits)
        assert e0[2] == 0.625
    else:
        assert host == [] and e0[2] == 0.5
    # counted as charged (what dali exec validate compares with the executor's), and where nothing sleeps not at all
    assert out.handoffs == ({"cpu_lane": len(host), "copy_thread": 0} if wakes != "never" else
                            {"cpu_lane": 0, "copy_thread": 0})
    assert CostModel(load_profile(prof), OVERLAP_MODEL).handoff_time() == 0.125


@pytest.mark.parametrize("shortcut", [True, False])
@pytest.mark.parametrize("spin_s, asleep", [(0.0, [True] * 3), (1e-9, [True, False, True]),
                                             (1e6, [True, False, False])])
def test_a_worker_still_spinning_for_its_next_job_pays_what_a_spinning_hand_over_costs(tmp_path, overlap_trace,
                                                                                       shortcut, spin_s, asleep):
    """A worker that spins ``wait_spin_s`` after each job before it sleeps: a hand-over within that time of its last
    job's end pays the profile's ``*_spinning`` costs (host 0.0625 s, none for the CPU call) instead of waking it
    (host 0.125 s, the CPU call 0.25 s more). E0 is on the CPU lane in 3 of the 4 layer visits: with no spin all 3
    wake it; with a spin of a nanosecond the first and the third (the second visit starts as the first one's CPU
    lane, the layer's last work, ends: no time to wait); with one longer than the whole run only the first (the worker
    had no job before it). Every hand-over is counted, whatever it costs (what `dali exec validate` compares with the
    executor's)."""
    prof = round_number_profile(tmp_path / "spin.json", OVERLAP_MODEL,
                                lane_wake={"host": 0.125, "cpu": 0.25, "host_spinning": 0.0625})
    impl = dataclasses.replace(get_implementation("bare"), name="spin", cpu_lane_wakes="always", wait_spin_s=spin_s)
    out = _engine(overlap_trace, split_system([0]), prof, impl, shortcut)
    got = _spans(out)
    host = sorted(s for s in got if s[0] == "host")
    assert [b - a for _, _, a, b in sorted(host, key=lambda s: s[2])] == [0.125 if a else 0.0625 for a in asleep]
    assert host[0] == ("host", "host L0", 0, 0.125)
    e0 = [s for s in got if s[:2] == ("cpu", "L0 E0")][0]
    assert e0[2] == 0.125 + 0.5 + 0.25  # (the first visit: hand-over, dense part, the worker's wake)
    assert out.handoffs == {"cpu_lane": 3, "copy_thread": 0}
    costs = CostModel(load_profile(prof), OVERLAP_MODEL)
    assert (costs.handoff_time(), costs.handoff_time(asleep=False), costs.lane_wake("cpu", asleep=False)) == \
        (0.125, 0.0625, 0.0)
    with pytest.raises(ValueError, match="wait_spin_s must be a finite number >= 0"):
        dataclasses.replace(impl, wait_spin_s=-1.0)


def test_whether_the_worker_sleeps_is_a_python_bool_whatever_the_clock():
    """The engine indexes its (spinning, asleep) costs by it: a clock of NumPy floats (times from the compiled lanes)
    must not turn it into a NumPy bool, which no tuple takes as an index."""
    from types import SimpleNamespace

    from dali_sim.sim.engine import SimEngine

    for now, free, want in ((np.float64(1.0), np.float64(0.5), True), (np.float64(1.0), 0.9995, False)):
        engine = SimpleNamespace(spin=1e-3, env=SimpleNamespace(now=now), worker_free=free)
        got = SimEngine._worker_asleep(engine)
        assert type(got) is bool and got is want
        assert (0.0, 1.0)[got] == float(want)


def test_a_spinning_worker_takes_a_dense_part_without_a_wake(tmp_path, overlap_trace):
    """The dense parts on the CPU, handed to the worker ("always"), which spins longer than the run: only the
    first of the 4 layer visits' dense parts wakes it (0.125 s on the host, 0.25 s more on the CPU); the other 3
    find it spinning and take 0.5 s. All 4 hand-overs are counted."""
    prof = round_number_profile(tmp_path / "dense.json", OVERLAP_MODEL, lane_wake={"host": 0.125, "cpu": 0.25})
    impl = dataclasses.replace(get_implementation("bare"), name="dense-spin", cpu_lane_wakes="always", wait_spin_s=1e6)
    system = dataclasses.replace(split_system([], slots=3), dense_device="cpu")
    out = _engine(overlap_trace, system, prof, impl)
    got = _spans(out)
    dense = [s for s in got if s[1].startswith("dense")]
    assert [b - a for _, _, a, b in dense] == [0.75, 0.5, 0.5, 0.5]
    assert [s for s in got if s[0] == "host"] == [("host", "host L0", 0, 0.125)]
    assert out.handoffs == {"cpu_lane": 4, "copy_thread": 0}


@pytest.mark.parametrize("wakes, shortcut", [("never", True), ("always", True), ("always", False),
                                             ("beside-gpu", True)])
def test_a_dense_part_on_the_cpu_is_handed_to_the_sleeping_cpu_worker_as_a_cpu_lane_call(tmp_path, overlap_trace,
                                                                                       wakes, shortcut):
    """Every expert on the GPU (3 cache slots: nothing to copy after the first uses), the dense parts on the CPU
    (0.5 s), a host hand-over of 0.125 s and a worker's wake of 0.25 s: a dense part is a CPU-lane call with no GPU
    expert beside it, so where every such call goes to the sleeping worker ("always") each of the 4 layer visits
    pays the hand-over on the host, then its dense part takes 0.75 s; with "beside-gpu" (the executor runs such a
    call in its own thread) or "never", nothing. The direct path and the SimPy path agree."""
    prof = round_number_profile(tmp_path / "dense.json", OVERLAP_MODEL, lane_wake={"host": 0.125, "cpu": 0.25})
    impl = dataclasses.replace(get_implementation("bare"), name="dense-handoff", cpu_lane_wakes=wakes)
    system = dataclasses.replace(split_system([], slots=3), dense_device="cpu")
    out = _engine(overlap_trace, system, prof, impl, shortcut=shortcut)
    got = _spans(out)
    host = [s for s in got if s[0] == "host"]
    dense = [s for s in got if s[1].startswith("dense")]
    assert len(dense) == 4 and all(s[0] == "cpu" for s in dense)
    handed = wakes == "always"
    assert [b - a for _, _, a, b in dense] == [0.75 if handed else 0.5] * 4
    assert [(b - a) for _, _, a, b in host] == ([0.125] * 4 if handed else [])
    assert dense[0][2] == (0.125 if handed else 0.0)  # (the first visit: its dense part after the hand-over)
    assert out.handoffs == {"cpu_lane": 4 if handed else 0, "copy_thread": 0}


@pytest.mark.parametrize("wakes", ["always", "beside-gpu"])
def test_a_dense_block_on_the_cpu_is_handed_over_as_a_layers_dense_part_is(tmp_path, wakes):
    """A model whose first block is dense (0.25 s on the CPU) before 2 MoE layers (every expert cached on the GPU),
    one sequence of 2 steps (a one-token prompt, a decode step), everything dense on the CPU: with "always" each of the 2 blocks and 4 dense
    parts is handed to the sleeping worker (0.125 s on the host, 0.25 s more on the CPU lane), the block's
    hand-over logged as host work of no layer; with "beside-gpu" nothing is."""
    model = tiny_model(num_layers=3, moe_layers=(1, 2), num_experts=3, top_k=2)
    path = tmp_path / "block.parquet"
    with TraceWriter(path, model, provenance={"source": "hand-written", "command": "tests"}) as w:
        for pos, phase in ((0, "prefill"), (1, "decode")):
            for layer in (1, 2):  # (the blocks')
                w.write(seq_id=0, phase=phase, pos=pos, layer=layer, experts=np.array([[0, 1]]),
                        weights=np.array([[0.5, 0.5]], np.float32))
    prof = round_number_profile(tmp_path / "block.json", model, lane_wake={"host": 0.125, "cpu": 0.25})
    data = json.loads(prof.read_text())
    data["tables"]["cpu_dense_block"] = {"tokens": [1, 2], "context_lens": [0], "seconds": [[0.25, 0.25]]}
    prof.write_text(json.dumps(data))
    impl = dataclasses.replace(get_implementation("bare"), name="block-handoff", cpu_lane_wakes=wakes)
    system = dataclasses.replace(split_system([], slots=3), dense_device="cpu")
    out = _engine(read_trace(path), system, prof, impl)
    got = _spans(out)
    blocks = [s for s in got if s[1] == "dense block 0"]
    handed = wakes == "always"
    assert [b - a for _, _, a, b in blocks] == [0.5 if handed else 0.25] * 2
    assert [s for s in got if s[1] == "host"] == ([("host", "host", 0, 0.125)] + [("host", "host", blocks[1][2] - 0.125,
                                                                                   blocks[1][2])] if handed else [])
    assert out.handoffs == {"cpu_lane": 6 if handed else 0, "copy_thread": 0}


@pytest.mark.parametrize("host_s", [0.0, 0.125])
def test_the_host_pays_its_hand_over_of_background_copies_to_a_sleeping_copy_thread(tmp_path, overlap_trace, host_s):
    """gpu-lru with an oracle prefetcher (no cache; 3 staging, 4 prefetch buffers): step 0 layer 0 issues its
    prefetches with no copy in flight (the copy thread asleep: the host pays 0.125 s), step 0 layer 1 while the
    prefetch of L1 E0 is still copying (8-10 s: nothing), step 1 layer 0 with the link idle again (at 13.5 s: it
    pays); the layer's work starts after the hand-over."""
    oracle = {"cache": {"policy": "lru"}, "prefetch": {"policy": "oracle", "k": "2"},
              "memory": {"cache_experts": "0", "staging_slots": "3", "prefetch_slots": "4"}}
    prof = round_number_profile(tmp_path / "handoff.json", OVERLAP_MODEL, lane_wake={"host": host_s} if host_s else None)
    impl = dataclasses.replace(get_implementation("bare"), name="handoff", cpu_lane_wakes="always")
    out = _engine(overlap_trace, resolve_system("gpu-lru", oracle), prof, impl)
    got = _spans(out)
    host = [s for s in got if s[0] == "host"]
    assert out.handoffs == {"cpu_lane": 0, "copy_thread": 2}  # (counted whether the profile charges them or not)
    if host_s:
        assert host == [("host", "host L0", 0, 0.125), ("host", "host L0", 13.5, 13.625)]
        assert ("gpu", "dense L0", 0.125, 0.625) in got and ("pcie", "prefetch L1 E1", 13.5, 15.5) in got
    else:
        assert host == [] and ("gpu", "dense L0", 0.0, 0.5) in got


@pytest.mark.parametrize("shortcut", [True, False])
def test_a_swap_request_hands_over_after_the_lanes_to_a_sleeping_copy_thread(tmp_path, overlap_trace, monkeypatch,
                                                                             shortcut):
    """A cache that swaps expert 2 in for expert 0 after step 0 layer 0 (2 slots, no prefetches, nothing on the CPU):
    no hand-over before the layer, one of 0.125 s as its lanes end at 4.5 s with no background copy in flight
    (the copy thread sleeps), then the swap and the next layer; the layers after it move by 0.125 s."""
    from dali_sim.policies.base import CACHES
    from test_sim_prefetch import SwapIn, with_policy

    monkeypatch.setitem(CACHES._items, SwapIn.name, SwapIn)
    system = with_policy("cache", SwapIn, {"memory": {"cache_experts": "2", "staging_slots": "2"}})
    impl = dataclasses.replace(get_implementation("bare"), name="handoff", cpu_lane_wakes="always")
    spans_of = {}
    for host_s in (0.0, 0.125):
        prof = round_number_profile(tmp_path / f"handoff{host_s}.json", OVERLAP_MODEL,
                                    lane_wake={"host": host_s} if host_s else None)
        out = _engine(overlap_trace, system, prof, impl, shortcut)
        spans_of[host_s] = _spans(out)
        assert out.handoffs == {"cpu_lane": 0, "copy_thread": 1}
    assert [s for s in spans_of[0.125] if s[0] == "host"] == [("host", "host L0", 4.5, 4.625)]
    assert ("pcie", "swap L0 +E2 -E0", 4.5, 6.5) in spans_of[0.0]
    assert ("pcie", "swap L0 +E2 -E0", 4.625, 6.625) in spans_of[0.125]
    assert ("gpu", "dense L1", 4.5, 5.0) in spans_of[0.0] and ("gpu", "dense L1", 4.625, 5.125) in spans_of[0.125]


@pytest.fixture(scope="module")
def chain_trace(tmp_path_factory):
    """3 MoE layers of 3 experts, top-1: layer l routes its one decode token to expert l, for 2 steps."""
    from dali_sim.trace import TraceWriter

    path = tmp_path_factory.mktemp("chain") / "chain.parquet"
    with TraceWriter(path, tiny_model(num_layers=3, moe_layers=(0, 1, 2), num_experts=3, top_k=1),
                     provenance={"source": "hand-written", "command": "tests/test_implementations.py"}) as w:
        for pos in range(2):
            for layer in range(3):
                w.write(seq_id=0, phase="decode", pos=pos, layer=layer, experts=np.array([[layer]]),
                        weights=np.array([[1.0]], np.float32))
    return read_trace(path)


def _next_layer_system(monkeypatch, cache_experts: int):
    """gpu-lru whose prefetcher asks at layer l for expert l + 1 of layer l + 1 (one prefetch buffer)."""
    from dali_sim.policies.base import PREFETCHERS, PrefetchPolicy
    from test_sim_prefetch import with_policy

    class NextOne(PrefetchPolicy):
        name = "test-next-one"

        def prefetch(self, view):
            return [(view.layer + 1, view.layer + 1)] if view.layer + 1 < view.num_layers else []

    monkeypatch.setitem(PREFETCHERS._items, NextOne.name, NextOne)
    return with_policy("prefetch", NextOne, {"memory": {"cache_experts": str(cache_experts), "staging_slots": "1",
                                                        "prefetch_slots": "1"}})


@pytest.mark.parametrize("shortcut", [True, False])
@pytest.mark.parametrize("cache_experts", [0, 1])
def test_a_prefetch_that_finds_no_free_buffer_waits_until_the_runtime_is_done_with_one(
        tmp_path, chain_trace, monkeypatch, shortcut, cache_experts):
    """One prefetch buffer; layer 0 prefetches L1 E1 (0-2 s: the link is idle, the copy thread asleep, the host pays
    0.125 s), layer 1 uses it and asks for L2 E2. The controller counts the buffer free as layer 1's plan is made
    ("at-plan": the copy runs 5-7 s, its hand-over 5-5.125). A runtime frees it once done with it. Without a
    cache the buffer of the declined E1 frees after its compute (5.5-6.5 s): a thread doing the work in order
    ("in-order", the CPU device) then hands the waiting prefetch to the sleeping copy thread (0.125 s of host)
    and its copy follows; one that issues the work and goes on ("at-use", CUDA) has asked before (its host time
    hidden behind the lane) and the copy, which waits for E1's compute, follows it at once. With one cache slot
    the cache adopts E1: in order after the dense part (5-5.5 s), hand-over, copy; at-use as the routing is
    grouped while the dense part is queued: as at-plan. Layer 2 waits for the copy."""
    system = _next_layer_system(monkeypatch, cache_experts)
    prof = round_number_profile(tmp_path / "handoff.json", chain_trace.model, lane_wake={"host": 0.125})
    got = {}
    for buffers in PREFETCH_BUFFERS:
        impl = dataclasses.replace(get_implementation("bare"), name="buffers", cpu_lane_wakes="always",
                                   prefetch_buffers=buffers)
        out = _engine(chain_trace, system, prof, impl, shortcut)
        got[buffers] = set(_spans(out))
        # the same requests, each handed over once (the copy thread sleeps every time)
        assert out.handoffs == {"cpu_lane": 0, "copy_thread": 4 if cache_experts == 0 else 2}, buffers
        # layer 1's found no free buffer, in each step that prefetches (with a cache slot, step 1 has all cached)
        assert out.prefetches_waited == (0 if buffers == "at-plan" else 2 if cache_experts == 0 else 1), buffers
    at_plan = {("host", "host L1", 5.0, 5.125), ("pcie", "prefetch L2 E2", 5.0, 7.0), ("gpu", "dense L1", 5.125, 5.625)}
    assert at_plan <= got["at-plan"]
    if cache_experts == 0:
        assert {("gpu", "dense L1", 5.0, 5.5), ("gpu", "L1 E1", 5.5, 6.5), ("host", "host L1", 6.5, 6.625),
                ("pcie", "prefetch L2 E2", 6.625, 8.625), ("gpu", "L2 E2", 8.625, 9.625)} <= got["in-order"]
        assert {("gpu", "dense L1", 5.0, 5.5), ("gpu", "L1 E1", 5.5, 6.5), ("pcie", "prefetch L2 E2", 6.5, 8.5),
                ("gpu", "L2 E2", 8.5, 9.5)} <= got["at-use"]
        assert not any(s[:2] == ("host", "host L1") for s in got["at-use"])
    else:
        assert {("gpu", "dense L1", 5.0, 5.5), ("host", "host L1", 5.5, 5.625), ("gpu", "L1 E1", 5.625, 6.625),
                ("pcie", "prefetch L2 E2", 5.625, 7.625), ("gpu", "L2 E2", 7.625, 8.625)} <= got["in-order"]
        assert got["at-use"] == got["at-plan"]


def test_the_executor_frees_prefetch_buffers_in_order_on_the_cpu_device():
    """dali's executor (``at-use`` on CUDA) does a layer's work in its own thread on the CPU device: ``in-order``."""
    from dali_sim.hardware.cost import executor_on

    impl = get_implementation(EXECUTOR)
    assert impl.prefetch_buffers == "at-use"
    base = load_profile(EXAMPLE_MEASURED)
    for cpu_device, want in ((True, "in-order"), (False, "at-use")):
        prof = dataclasses.replace(base, provenance={**base.provenance, "devices": {"gpu_is_cpu_device": cpu_device}})
        assert executor_on(prof, impl).prefetch_buffers == want
    assert all(get_implementation(n).prefetch_buffers == "at-plan" for n in implementation_names() if n != EXECUTOR)


def test_the_executor_wakes_its_cpu_lane_beside_accelerator_experts_only_where_its_thread_has_the_lanes_threads():
    """dali's executor submits the CPU lane to its sleeping worker; where the replay's thread has the lane's thread
    count (the profile's threads.main_thread; in older profiles the CPU device's accelerator_lane) a CPU-lane call
    without accelerator experts runs inline (runtime.py run_experts, OffloadRuntime.on_cpu_lane): on the CPU device
    by default, on CUDA where --cpu-threads is the main thread's. Only the CPU device changes the other traits."""
    from dali_sim.hardware.cost import executor_on

    impl = get_implementation("dali-executor")
    assert impl.cpu_lane_wakes == "always"
    base = load_profile(EXAMPLE_MEASURED)
    cpu, cuda = {"gpu_is_cpu_device": True}, {"gpu_is_cpu_device": False}
    for threads, devices, want in (({"cpu_lane": 1, "accelerator_lane": 1}, cpu, "beside-gpu"),
                                   ({"cpu_lane": 1, "accelerator_lane": 1, "main_thread": 1}, cpu, "beside-gpu"),
                                   ({"cpu_lane": 1, "accelerator_lane": 2}, cpu, "always"),
                                   ({"cpu_lane": 7, "accelerator_lane": None}, cuda, "always"),
                                   ({"cpu_lane": 7, "accelerator_lane": None, "main_thread": 16}, cuda, "always"),
                                   ({"cpu_lane": 7, "accelerator_lane": None, "main_thread": 7}, cuda, "beside-gpu")):
        prof = dataclasses.replace(base, provenance={**base.provenance, "threads": threads, "devices": devices})
        got = executor_on(prof, impl)
        assert got.cpu_lane_wakes == want, threads
        on_cpu = devices["gpu_is_cpu_device"]
        assert (got.compute_waits_copies, got.prefetch_buffers) == ((True, "in-order") if on_cpu else
                                                                    (impl.compute_waits_copies, "at-use")), threads
        assert got.wait_spin_s == 0.0  # (profiles from before the worker could spin: it slept at once)
    spinning = dataclasses.replace(base, provenance={**base.provenance, "waiting": {"spin_s": 0.001}})
    assert executor_on(spinning, impl).wait_spin_s == 0.001
    assert executor_on(base, get_implementation("pytorch-eager")) == get_implementation("pytorch-eager")


def test_activation_handovers_frame_the_cpu_lane(tmp_path, overlap_trace):
    """An activation copy of 0.25 s each way: the CPU lane of step 0 layer 0 is 0.5-0.75 (in), E0 0.75-6.75,
    6.75-7.0 (out); the layer ends at 7.0 instead of 6.5."""
    prof = round_number_profile(tmp_path / "d2h.json", OVERLAP_MODEL, d2h=0.25)
    impl = dataclasses.replace(get_implementation("bare"), name="handover", activation_copies=True)
    out = _engine(overlap_trace, split_system([0]), prof, impl)
    cpu = [s for s in _spans(out) if s[0] == "cpu" and s[2] < 7.0]
    assert cpu == [("cpu", "L0 E0", 0.75, 6.75), ("cpu", "handoff L0", 0.5, 0.75), ("cpu", "handoff L0", 6.75, 7.0)]
    assert out.step_start[1] == pytest.approx(out.step_end[0])


def test_lanes_overlap_only_in_decode(overlap_trace, round_profile):
    """Lanes that overlap in decode only (KTransformers' graph path): step 0 (the prompt) runs its CPU lane
    first as in test_serial_lanes...; step 1 (decode) overlaps: layer 0's E1 (GPU) and E0 (CPU) start
    together after its dense part."""
    impl = dataclasses.replace(get_implementation("bare"), name="decode-overlap", lanes_overlap="decode")
    out = _engine(overlap_trace, split_system([0]), round_profile, impl)
    by_name = {}
    for track, name, a, b in _spans(out):
        by_name.setdefault((track, name), []).append((a, b))
    assert by_name[("cpu", "L0 E0")][0] == (0.5, 6.5) and by_name[("pcie", "fetch L0 E1")][0][0] == 6.5
    t1 = out.step_start[1]
    dense = [a for a, _ in by_name[("gpu", "dense L0")] if a >= t1][0]
    assert by_name[("gpu", "L0 E1")][-1][0] == dense + 0.5 == by_name[("cpu", "L0 E0")][-1][0]


def test_lm_head_over_the_last_or_every_prompt_token():
    """An implementation computing logits for every prompt token pays the LM head on the whole prompt."""
    trace = read_trace(_tiny_trace())
    base = {"placement": {"policy": "gpu-only"}, "memory": {"cache_experts": "32"}}
    runs = {}
    for mode in ("last", "all"):
        impl = dataclasses.replace(get_implementation("bare"), name=f"head-{mode}", lm_head=mode)
        w = Workload(trace, WorkloadConfig(1))
        system = resolve_system("gpu-static", base, trace.model)
        profile = load_profile("rtx4090-ddr5-desktop")
        costs = CostModel(profile, trace.model, implementation=impl)
        mem = plan_memory(trace.model, system.memory, profile.gpu_memory_bytes, w.max_batch_context)
        ctl = Controller(w, costs, system.placement.build(), system.cache.build(), system.prefetch.build(),
                         mem.capacities, cache_init="frequency")
        out = SimEngine(w, ctl, costs, PlanCounters(w.num_layers), record=True).run()
        runs[mode] = [iv.end - iv.start for iv in out.intervals if iv.name == "lm_head"]
        head = costs.lm_head_time("gpu", np.array([1, 8]))
    assert runs["last"][0] == pytest.approx(head[0]) and runs["all"][0] == pytest.approx(head[1])
    assert runs["last"][1:] == runs["all"][1:]  # decode steps: one token each


def test_evictions_write_back_before_the_copies(tmp_path, overlap_trace, round_profile):
    """mixtral-offloading writes the evicted expert back to the host on the same link, and computes wait for
    the layer's copies: step 1 layer 1 (cache {0, 2}, E1 missing, E0 evicted): write-back E0 then fetch E1,
    then E1 and E2 are computed."""
    impl = dataclasses.replace(get_implementation("bare"), name="writeback", evict_writeback=True,
                               compute_waits_copies=True)
    system = resolve_system("gpu-lru", {"memory": {"cache_experts": "2"}})
    out = _engine(overlap_trace, system, round_profile, impl)
    wb = [s for s in _spans(out) if s[1].startswith("writeback")]
    assert [s[1] for s in wb] == ["writeback L1 E0"]
    _, _, a, b = wb[0]
    fetch = next(s for s in _spans(out) if s[1] == "fetch L1 E1" and s[2] >= b)
    assert fetch[2] == b and b - a == 2.0
    computes = [s for s in _spans(out) if s[0] == "gpu" and s[2] >= a and not s[1].startswith("dense")]
    assert computes and min(s[2] for s in computes) >= fetch[3]


def test_measured_host_costs_run_before_the_dense_part(tmp_path, overlap_trace):
    """The executor's host time per layer visit: 0.25 s + 0.5 s per GPU expert + the system's 0.125 s of
    decisions; case C's first layer (2 GPU experts, 1 CPU expert, 2 copies): 1.375 s of host work first."""
    prof = round_number_profile(tmp_path / "host.json", OVERLAP_MODEL,
                                host={"layer_s": 0.25, "gpu_expert_s": 0.5, "decision_s": {"split": 0.125}})
    r = simulate(overlap_trace, split_system([0]), hardware=prof, timeline=True, profiling=WHOLE)
    first = sorted(s for s in spans(r) if s[2] < 2.0)
    assert ("host", "host L0", 0.0, 1.375) in first and ("gpu", "dense L0", 1.375, 1.875) in first
    assert r.manifest["implementation"]["name"] == "dali-executor"
    assert "describes dali's executor" in r.manifest["implementation"]["note"]
    bare = simulate(overlap_trace, dataclasses.replace(split_system([0]), implementation="bare"), hardware=prof,
                    profiling=WHOLE)
    assert bare.summary["makespan_s"] == 18.0 and "note" not in bare.manifest["implementation"]


def test_executor_implementation_needs_measured_host_costs(overlap_trace):
    system = dataclasses.replace(resolve_system("gpu-lru"), implementation="dali-executor")
    with pytest.raises(ValueError, match="needs the executor's measured host costs"):
        simulate(overlap_trace, system, profiling=WHOLE)
    # the no-timing path never asks for host time
    assert simulate(overlap_trace, system, timing=False, profiling=WHOLE).summary["hits"] >= 0


def test_which_steps_replay_a_cuda_graph():
    """llama.cpp 2025: one-token steps of a run whose experts are all resident; with CPU-held experts none.
    llama.cpp 2026: every decode step, also with CPU-held experts; KTransformers likewise."""
    trace = read_trace(_tiny_trace())
    w = Workload(trace, WorkloadConfig(1))
    decode = w.step_tokens == 1
    assert decode.sum() == 6 and not decode.all()

    def graphs(impl, cpu_layers=None):
        over = {"placement": {"cpu_layers": str(cpu_layers)}} if cpu_layers is not None else None
        system = resolve_system("llamacpp", over, trace.model)
        profile = load_profile("rtx4090-ddr5-desktop")
        costs = CostModel(profile, trace.model, implementation=impl)
        placement = system.placement.build()
        mem = plan_memory(trace.model, system.memory, profile.gpu_memory_bytes, w.max_batch_context,
                          required=placement.required_capacities(w.num_layers, w.num_experts))
        ctl = Controller(w, costs, placement, system.cache.build(), system.prefetch.build(), mem.capacities,
                         cache_init=system.memory.cache_init, staging_slots=mem.staging_slots)
        return SimEngine(w, ctl, costs, PlanCounters(w.num_layers)).graph_steps.tolist()

    assert graphs("llamacpp-2025") == decode.tolist()
    assert graphs("llamacpp-2025", cpu_layers=2) == [False] * w.num_steps
    assert graphs("llamacpp", cpu_layers=2) == decode.tolist()
    assert graphs("llamacpp-2023") == [False] * w.num_steps


_TINY = {}


def _tiny_trace():
    """A gpt-oss-20b-shaped synthetic trace: 1 sequence, 8 prompt + 6 generated tokens."""
    if "path" not in _TINY:
        import tempfile
        from pathlib import Path

        from dali_sim.trace.synth import SynthConfig, synthesize

        path = Path(tempfile.mkdtemp()) / "tiny.parquet"
        synthesize(SynthConfig("gpt-oss-20b", sequences=1, prompt_len=8, gen_len=6, seed=0,
                               precision="mxfp4/q8_0"), path)
        _TINY["path"] = path
    return _TINY["path"]


@pytest.mark.parametrize("cpu_device", [True, False])
def test_the_executor_on_the_cpu_device_computes_after_its_copies(tmp_path, cpu_device):
    """dali's executor without CUDA makes a layer's on-demand copies on the accelerator lane itself, so its
    computes wait for them (compute_waits_copies); on CUDA (and for every other implementation) the trait is
    the implementation's own."""
    import json

    from test_hardware import EXAMPLE

    data = json.loads(EXAMPLE.read_text())
    data.setdefault("provenance", {})["devices"] = {"gpu": "x", "cpu": "y", "gpu_is_cpu_device": cpu_device}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    profile = load_profile(path)
    from dali_sim.models import get_model

    m = get_model("mixtral-8x7b", "bf16")
    executor = CostModel(profile, m, implementation=EXECUTOR).impl
    assert executor.compute_waits_copies is cpu_device
    assert executor.gpu_calls == get_implementation(EXECUTOR).gpu_calls  # nothing else changes
    assert CostModel(profile, m, implementation="bare").impl == get_implementation("bare")
