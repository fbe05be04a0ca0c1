"""Hardware profiles and the cost model: hand-computed rooflines, table interpolation, file formats
and their errors, and the `dali hw` command group."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dali_sim.cli.hw import hw
from dali_sim.hardware.implementation import Implementation
from dali_sim.hardware import (
    CostModel,
    HardwareProfile,
    MeasuredProfile,
    ProfileError,
    attention_flops_per_pair,
    interp_extrap,
    load_profile,
    measured_profile_from_dict,
    profile_from_dict,
    profile_names,
    write_measured_profile,
)
from dali_sim.models.presets import get_model
from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.registry import UnknownNameError

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
EXAMPLE = DATA / "hw-measured-example.json"
SHIPPED = ["rtx3090-epyc7532", "rtx4090-ddr5-desktop"]
# the machines of docs/validation.md's published rows (not 24 GB cards): their numbers are sourced the same way
PUBLISHED_MACHINES = ["rtx4080-ryzen7950x", "rtx2080-i9-10900x", "rx7900xt-ryzen5900x"]


# ---- fixtures ----------------------------------------------------------------------------------
def _device(**over):
    d = {
        "name": "dev",
        "memory_gib": 8,
        "peak_tflops": {"default": 100.0, "fp32": 50.0},
        "mem_bandwidth_gbs": 1000.0,
        "compute_efficiency": 0.5,
        "memory_efficiency": 0.5,
        "kernel_us": 10.0,
        "launch_us": 0.0,
        "sync_us": 0.0,
        "gemm_tile_tokens": 0,
        "activation_bytes": 2,
    }
    d.update(over)
    for k in list(d):
        if k != "name":
            d[f"{k}_source"] = "test"
    return d


def toy_profile_dict() -> dict:
    """Round numbers: GPU 50 TFLOP/s and 500 GB/s effective, CPU 1 TFLOP/s and 50 GB/s, link 20 GB/s."""
    cpu = _device(peak_tflops={"default": 2.0}, mem_bandwidth_gbs=100.0, kernel_us=5.0,
                  shared_bandwidth_efficiency=0.8)
    link = {"name": "link", "bandwidth_gbs": 25.0, "efficiency": 0.8, "pageable_efficiency": 0.4, "latency_us": 10.0}
    link.update({f"{k}_source": "test" for k in ("bandwidth_gbs", "efficiency", "pageable_efficiency", "latency_us")})
    return {"kind": "analytic", "name": "toy", "description": "toy", "gpu": _device(), "cpu": cpu, "link": link}


#: an implementation with one kernel per expert on each lane and three for a dense part (10 and 5 us each)
TOY_IMPL = Implementation("toy", "one kernel per expert, three per dense part", gpu_experts="per-expert",
                          kernels={"expert": 1, "cpu_expert": 1, "dense_gqa": 3})


def toy_model(**over) -> ModelSpec:
    kw = dict(
        name="toy-moe", family="toy", num_layers=2, moe_layers=(1,), num_experts=4, top_k=2, hidden_size=1024,
        expert_intermediate_size=2048, vocab_size=1000, dense_intermediate_size=4096,
        attention=AttentionSpec(kind="gqa", num_heads=8, num_kv_heads=2, head_dim=128),
    )
    kw.update(over)
    return ModelSpec(**kw)


@pytest.fixture
def toy() -> CostModel:
    return CostModel(profile_from_dict(toy_profile_dict()), toy_model(), implementation=TOY_IMPL)


def example_dict() -> dict:
    return json.loads(EXAMPLE.read_text())


# ---- shipped profiles ----------------------------------------------------------------------------
def test_shipped_profiles_listed_and_loadable():
    assert set(SHIPPED) <= set(profile_names())
    for name in SHIPPED:
        p = load_profile(name)
        assert isinstance(p, HardwareProfile) and p.kind == "analytic"
        assert p.name == name
        assert p.gpu.memory_gib == 24


@pytest.mark.parametrize("name", SHIPPED + PUBLISHED_MACHINES)
def test_every_shipped_number_has_a_source(name):
    p = load_profile(name)
    raw = tomllib.loads(Path(p.path).read_text())
    for part in ("gpu", "cpu", "link"):
        for key, value in raw[part].items():
            if isinstance(value, (int, float, dict)):
                assert p.sources[f"{part}.{key}"].strip(), f"{part}.{key}"
    # numbers that are not on a spec sheet say how they were obtained, and every derivation is written out
    soft = [k for k in p.sources if any(w in k for w in ("efficiency", "kernel_us", "launch_us", "latency"))]
    tags = ("assumption", "derived [D", "measured elsewhere", "measured on this machine", "definition")
    assert soft and all(any(t in p.sources[k] for t in tags) for k in soft), [k for k in soft if not any(
        t in p.sources[k] for t in tags)]
    doc = (REPO / "docs" / "hardware.md").read_text()
    for ref in sorted({m for k in p.sources for m in re.findall(r"\[D\d+\]", p.sources[k])}):
        assert f"**{ref}**" in doc, f"{name}: derivation {ref} is not written out in docs/hardware.md"


def test_shipped_headline_numbers():
    """Pins the documented key numbers (docs/hardware.md) for Mixtral-8x7B bf16 (the bare implementation:
    the roofline alone)."""
    mix = get_model("mixtral-8x7b", "bf16")
    tb = CostModel(load_profile("rtx3090-epyc7532"), mix)
    # GPU, 1 token: memory bound, (352321536 + 36864*2 bytes) / (936e9 * 0.85)
    assert tb.expert_time("gpu", 1) == pytest.approx((352321536 + 73728) / 795.6e9)
    # CPU, 1 token: memory bound on 204.8 GB/s * 0.6
    assert tb.expert_time("cpu", 1) == pytest.approx((352321536 + 73728) / 122.88e9)
    # CPU, 64 tokens: compute bound on 16 cores * 2.4 GHz * 32 FLOP * 0.5
    assert tb.expert_time("cpu", 64) == pytest.approx(2 * 64 * 176160768 / 614.4e9)
    # one expert over PCIe 4.0 x16, pinned: 3 us + bytes at 76%; pageable (llama.cpp's mmap): 50%
    assert tb.expert_transfer_time() == pytest.approx(3e-6 + 352321536 / (31.508e9 * 0.76))
    assert tb.expert_transfer_time() == pytest.approx(14.716e-3, rel=1e-3)
    pageable = CostModel(load_profile("rtx3090-epyc7532"), mix, implementation="llamacpp")
    assert pageable.expert_transfer_time() == pytest.approx(3e-6 + 352321536 / (31.508e9 * 0.5))
    desk = CostModel(load_profile("rtx4090-ddr5-desktop"), mix)
    assert desk.expert_time("cpu", 1) == pytest.approx((352321536 + 73728) / 62.4e9)
    assert desk.expert_time("gpu", 1) < tb.expert_time("gpu", 1)
    # near the crossover the CPU is compute bound and the desktop CPU computes faster (1.15 vs 0.61 TFLOP/s
    # effective), so an uncached expert needs more tokens before the GPU wins there
    assert tb.crossover_tokens() < desk.crossover_tokens()


# ---- roofline, hand-computed --------------------------------------------------------------------
TOY_PARAMS = 3 * 1024 * 2048  # 6_291_456
TOY_BYTES = 2 * TOY_PARAMS
TOY_ACT = 2 * (2 * 1024 + 2 * 2048)  # bytes per token


def test_expert_roofline_hand_computed(toy):
    # GPU: 50e12 FLOP/s and 500e9 B/s effective
    assert toy.expert_time("gpu", 1) == pytest.approx(10e-6 + (TOY_BYTES + TOY_ACT) / 500e9)
    n = 1000  # compute bound: 2*1000*6.29e6 / 50e12 = 0.2517 ms > bytes/bw = 0.0375 ms
    assert toy.expert_time("gpu", n) == pytest.approx(10e-6 + 2 * n * TOY_PARAMS / 50e12)
    # CPU: 1e12 FLOP/s, 50e9 B/s
    assert toy.expert_time("cpu", 1) == pytest.approx(5e-6 + (TOY_BYTES + TOY_ACT) / 50e9)
    assert toy.expert_time("cpu", 64) == pytest.approx(5e-6 + 2 * 64 * TOY_PARAMS / 1e12)


def test_precision_selects_peak():
    prof = profile_from_dict(toy_profile_dict())
    fp32 = toy_model(precision=get_model("mixtral-8x7b", "fp32").precision)
    cm = CostModel(prof, fp32, implementation=TOY_IMPL)
    n = 1000  # compute bound at the fp32 peak of 50 TFLOP/s * 0.5
    assert cm.expert_time("gpu", n) == pytest.approx(10e-6 + 2 * n * TOY_PARAMS / 25e12)
    q4 = CostModel(prof, toy_model(precision=get_model("mixtral-8x7b", "q4_0").precision), implementation=TOY_IMPL)
    assert q4.expert_time("gpu", 1) == pytest.approx(10e-6 + (round(TOY_PARAMS * 0.5625) + TOY_ACT) / 500e9)


def test_zero_tokens_cost_nothing_and_inputs_agree(toy):
    assert toy.expert_time("gpu", 0) == 0.0
    assert toy.transfer_time(0) == 0.0
    assert toy.dense_time("gpu", 0, 4096) == 0.0
    counts = np.array([0, 1, 7, 64, 300])
    arr = toy.expert_time("cpu", counts)
    assert arr.shape == counts.shape and arr[0] == 0.0
    for n, t in zip(counts, arr):
        assert toy.expert_time("cpu", int(n)) == t
        assert toy.expert_time("cpu", np.int64(n)) == t
        assert toy.expert_time("cpu", float(n)) == pytest.approx(t)
    assert toy.expert_time("gpu", np.zeros((2, 3), dtype=int)).shape == (2, 3)


def test_lookup_matches_direct_computation():
    prof, model = profile_from_dict(toy_profile_dict()), toy_model()
    small = CostModel(prof, model, lookup_tokens=16)
    big = CostModel(prof, model, lookup_tokens=4096)
    for n in (15, 16, 17, 100, 5000):
        assert small.expert_time("gpu", n) == pytest.approx(big.expert_time("gpu", n), rel=1e-12)
    assert np.allclose(small.expert_time("cpu", np.arange(40)), big.expert_time("cpu", np.arange(40)), rtol=1e-12)
    table = big.expert_time_table("gpu")
    assert table.shape == (4097,) and not table.flags.writeable


def test_monotone_in_tokens_bytes_and_context():
    for name in SHIPPED:
        for model in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite"):
            cm = CostModel(load_profile(name), get_model(model))
            n = np.arange(0, 3000)
            for dev in ("gpu", "cpu"):
                assert np.all(np.diff(cm.expert_time(dev, n)) >= 0)
                assert np.all(np.diff(cm.dense_time(dev, n, 512)) >= 0)
                assert np.all(np.diff(cm.dense_time(dev, 8, np.arange(0, 100_000, 1000))) >= 0)
            assert np.all(np.diff(cm.transfer_time(np.linspace(0, 1e10, 500))) >= 0)


def test_memory_bound_then_compute_bound(toy):
    # CPU: flops = bytes*bw ratio at n* = TOY_BYTES * 1e12 / (2 * TOY_PARAMS * 50e9) = 20 tokens (ignoring activations)
    t = toy.expert_time("cpu", np.arange(1, 41))
    assert np.ptp(t[:10]) < 0.1 * t[0]  # nearly flat while reading weights dominates
    assert t[39] == pytest.approx(5e-6 + 2 * 40 * TOY_PARAMS / 1e12)  # linear once compute bound


def test_transfer_hand_computed(toy):
    assert toy.transfer_time(1e9) == pytest.approx(10e-6 + 1e9 / 20e9)
    assert toy.expert_transfer_time() == pytest.approx(10e-6 + TOY_BYTES / 20e9)
    assert np.allclose(toy.transfer_time(np.array([0, 2e9])), [0.0, 10e-6 + 0.1])


def test_dense_time_hand_computed(toy):
    m = toy_model()
    dense_params = m.dense_params_per_moe_layer()
    pair = attention_flops_per_pair(m.attention)
    assert pair == 4 * 8 * 128
    kv_elems = m.attention.kv_cache_elements_per_token()
    act = 2 * 4 * 1024
    # decode, 4 queries each attending 1000 cached tokens (KV read 4000 tokens): memory bound on the GPU
    n, ctx = 4, 1000
    flops = 2 * n * dense_params + n * ctx * pair
    moved = 2 * dense_params + n * act + n * ctx * kv_elems * 2
    expected = 30e-6 + max(flops / 50e12, moved / 500e9)
    assert toy.dense_time("gpu", n, ctx) == pytest.approx(expected)
    # prefill of one 2000-token sequence: mean context 1000, KV read once (2000 entries)
    n, ctx, kv = 2000, 1000, 2000
    flops = 2 * n * dense_params + n * ctx * pair
    moved = 2 * dense_params + n * act + kv * kv_elems * 2
    assert toy.dense_time("cpu", n, ctx, kv_tokens=kv) == pytest.approx(max(flops / 1e12, moved / 50e9))


def test_mla_attention_flops():
    ds = get_model("deepseek-v2-lite").attention
    assert attention_flops_per_pair(ds) == 2 * 16 * (128 + 64 + 128)


def test_dense_block_time():
    cm = CostModel(load_profile("rtx3090-epyc7532"), get_model("deepseek-v2-lite"))
    block = cm.dense_block_time("gpu", 16, 128)
    assert block > cm.dense_time("gpu", 16, 128)  # the dense MLP (10944) is larger than 2 shared experts
    mix = CostModel(load_profile("rtx3090-epyc7532"), get_model("mixtral-8x7b"))
    with pytest.raises(ValueError, match="no dense"):
        mix.dense_block_time("gpu", 1)


def test_crossover_matches_brute_force():
    for name in SHIPPED:
        cm = CostModel(load_profile(name), get_model("mixtral-8x7b"))
        for overlap in (False, True):
            x = cm.crossover_tokens(overlap=overlap)
            assert x is not None and x > 1
            gpu = lambda n: (max if overlap else (lambda a, b: a + b))(cm.expert_transfer_time(), cm.expert_time("gpu", n))
            assert gpu(x) < cm.expert_time("cpu", x)
            assert all(gpu(n) >= cm.expert_time("cpu", n) for n in range(1, x))
        assert cm.uncached_gpu_time(0) == 0.0


def test_bad_arguments(toy):
    with pytest.raises(ValueError, match="device"):
        toy.expert_time("tpu", 1)
    with pytest.raises(ValueError, match="device"):
        toy.dense_time("npu", 1)
    with pytest.raises(ValueError, match="n_tokens"):
        toy.expert_time("gpu", -1)
    with pytest.raises(ValueError, match="n_tokens"):
        toy.expert_time("gpu", np.array([1, -3]))
    with pytest.raises(ValueError, match="finite"):
        toy.expert_time("gpu", float("nan"))
    with pytest.raises(ValueError, match="n_bytes"):
        toy.transfer_time(-5)
    with pytest.raises(ValueError, match="context_len"):
        toy.dense_time("gpu", 1, -1)
    with pytest.raises(TypeError):
        toy.expert_time("gpu", "12")


def test_deterministic():
    a = CostModel(load_profile("rtx4090-ddr5-desktop"), get_model("olmoe-1b-7b"))
    b = CostModel(load_profile("rtx4090-ddr5-desktop"), get_model("olmoe-1b-7b"))
    assert np.array_equal(a.expert_time_table("cpu"), b.expert_time_table("cpu"))


# ---- analytic profile errors ---------------------------------------------------------------------
def _write_toml(path: Path, d: dict) -> Path:
    def val(v):
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines = [f"{k} = {val(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {val(vv)}" for kk, vv in v.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_toml_file_round_trip(tmp_path):
    p = load_profile(_write_toml(tmp_path / "mine.toml", toy_profile_dict()))
    assert p == profile_from_dict(toy_profile_dict())
    assert p.path.endswith("mine.toml")


@pytest.mark.parametrize(
    "mutate, field, problem",
    [
        (lambda d: d["gpu"].pop("mem_bandwidth_gbs"), "gpu.mem_bandwidth_gbs", "missing"),
        (lambda d: d["cpu"].update(memory_gib=-4), "cpu.memory_gib", "must be > 0"),
        (lambda d: d["gpu"].update(compute_efficiency=1.5), "gpu.compute_efficiency", "<= 1"),
        (lambda d: d["link"].update(latency_us="ten"), "link.latency_us", "must be a number"),
        (lambda d: d["gpu"].pop("memory_efficiency_source"), "gpu.memory_efficiency_source", "needs a source"),
        (lambda d: d["gpu"].update(mem_bandwith_gbs=1.0), "gpu", "unknown field"),
        (lambda d: d["gpu"]["peak_tflops"].update(bf61=3.0), "gpu.peak_tflops", "unknown field"),
        (lambda d: d["cpu"]["peak_tflops"].pop("default"), "cpu.peak_tflops.default", "missing"),
        (lambda d: d["gpu"]["peak_tflops"].update(fp32=0), "gpu.peak_tflops.fp32", "must be > 0"),
        (lambda d: d.update(kind="measured"), "kind", "analytic"),
        (lambda d: d.pop("link"), "link", "missing"),
    ],
)
def test_analytic_errors_name_file_and_field(tmp_path, mutate, field, problem):
    d = toy_profile_dict()
    mutate(d)
    path = _write_toml(tmp_path / "bad.toml", d)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and f"{field}:" in msg and problem in msg


def test_unknown_profile_name_and_missing_file(tmp_path):
    with pytest.raises(UnknownNameError, match="rtx3090-epyc7532"):
        load_profile("rtx9090")
    with pytest.raises(ProfileError, match="no such"):
        load_profile(tmp_path / "absent.toml")
    bad = tmp_path / "broken.toml"
    bad.write_text("kind = [")
    with pytest.raises(ProfileError, match="broken.toml: not valid TOML"):
        load_profile(bad)


# ---- measured profiles ------------------------------------------------------------------------
@pytest.fixture
def measured() -> CostModel:
    return CostModel(load_profile(EXAMPLE), get_model("mixtral-8x7b", "bf16"))


def test_measured_interpolation(measured):
    # gpu_expert: tokens [1, 16, 64, 256], seconds [0.5, 0.51, 0.52, 1.9] ms
    assert measured.kind == "measured"
    assert measured.expert_time("gpu", 0) == 0.0
    assert measured.expert_time("gpu", 1) == pytest.approx(0.0005)
    assert measured.expert_time("gpu", 40) == pytest.approx(0.000515)  # halfway 16..64
    assert measured.expert_time("gpu", 160) == pytest.approx(0.00052 + 0.5 * 0.00138)
    # past the last point: the line through the last two points
    assert measured.expert_time("gpu", 512) == pytest.approx(0.0019 + 256 * 0.00138 / 192)
    # cpu_expert: [1, 8, 32] -> [3, 4.5, 18] ms
    assert measured.expert_time("cpu", 20) == pytest.approx(0.0045 + 12 / 24 * 0.0135)
    assert measured.expert_time("cpu", 64) == pytest.approx(0.018 + 32 * 0.0135 / 24)
    # h2d is the table's last point for one expert; halfway in bytes interpolates
    assert measured.expert_transfer_time() == pytest.approx(0.014)
    mid = (1048576 + 352321536) / 2
    assert measured.transfer_time(mid) == pytest.approx((0.00005 + 0.014) / 2)
    assert measured.transfer_time(1024) == pytest.approx(0.00005)  # below the first point: flat


def test_measured_dense_interpolation(measured):
    # gpu_dense: tokens [1, 64] x context [0, 1024]: [[0.2, 0.3], [0.3, 0.9]] ms
    assert measured.dense_time("gpu", 1, 0) == pytest.approx(0.0002)
    assert measured.dense_time("gpu", 64, 1024) == pytest.approx(0.0009)
    at_512 = lambda n: 0.5 * (np.interp(n, [1, 64], [0.0002, 0.0003]) + np.interp(n, [1, 64], [0.0003, 0.0009]))
    assert measured.dense_time("gpu", 32, 512) == pytest.approx(at_512(32))
    assert measured.dense_time("gpu", 64, 2048) == pytest.approx(0.0009 + 0.0006)  # context extrapolated
    assert measured.dense_time("cpu", 64, 5000) == pytest.approx(0.009)  # one context row: constant in context
    assert np.allclose(measured.dense_time("gpu", np.array([0, 1]), 0), [0.0, 0.0002])
    with pytest.raises(ProfileError, match="tables.gpu_dense_block: missing"):
        measured.dense_block_time("gpu", 4)


def test_prefill_layout_of_steps():
    """Decode steps (every query its own sequence: kv = n * ctx) do not share; a step of 4 whole prompts of 32
    tokens is 4 sequences of 32 new tokens; 2 chunks of 16 tokens after 48 cached ones are recovered exactly."""
    from dali_sim.hardware.measured import prefill_layout

    n = np.array([4.0, 128.0, 32.0])
    ctx = np.array([20.0, 16.5, 48 + 8.5])
    kv = np.array([80.0, 128.0, 2 * 64.0])
    shared, s, q, c0 = prefill_layout(n, ctx, kv)
    assert shared.tolist() == [False, True, True]
    assert np.allclose(q, [1, 32, 16]) and np.allclose(s, [4, 4, 2]) and np.allclose(c0, [0, 0, 48])


def _with_prefill_table(p, rows=((0.001, 0.002), (0.004, 0.010))):
    from dali_sim.hardware.measured import PrefillTable

    # sequences [1, 4] x new tokens per sequence [1, 32]
    return dataclasses.replace(p, gpu_dense_prefill=PrefillTable((1.0, 4.0), (1.0, 32.0), rows))


def test_measured_dense_prefill_layout(tmp_path):
    """A prefill step reads the prefill-layout table at its sequences and new tokens per sequence; a chunk after
    cached tokens adds the decode table's cost of attending to them; decode steps and profiles without the
    table are unchanged."""
    model = get_model("mixtral-8x7b", "bf16")
    base = load_profile(EXAMPLE)
    p = load_profile(write_measured_profile(tmp_path / "pre.json", _with_prefill_table(base)))
    with_pre, without = CostModel(p, model), CostModel(base, model)
    # 4 prompts of 32 tokens: the table's corner (4 sequences, 32 tokens each); without the table: the decode
    # table at 128 tokens and mean context 16.5 (the old reading)
    assert with_pre.dense_time("gpu", 128, 16.5, 128) == pytest.approx(0.010)
    assert without.dense_time("gpu", 128, 16.5, 128) == pytest.approx(float(without.dense_time("gpu", 128, 16.5)))
    # 2 prompts of 16.5 tokens' worth: halfway in both axes -> the mean of the four corners' bilinear blend
    q = 16.0  # 2 sequences of 16 tokens: n = 32, ctx = 8.5, kv = 32
    s_t, q_t = (2 - 1) / 3, (q - 1) / 31
    lo = 0.001 + s_t * (0.002 - 0.001)
    hi = 0.004 + s_t * (0.010 - 0.004)
    assert with_pre.dense_time("gpu", 32, 8.5, 32) == pytest.approx(lo + q_t * (hi - lo))
    # a chunk of 16 tokens of each of 2 sequences after 48 cached: the chunk as a prefill, plus the decode
    # table's cost at mean context 56.5 minus at 8.5 (tokens [1, 64] x context [0, 1024]: linear in context)
    chunk = with_pre.dense_time("gpu", 32, 48 + 8.5, 2 * 64)
    extra = without.dense_time("gpu", 32, 56.5) - without.dense_time("gpu", 32, 8.5)
    assert extra > 0 and chunk == pytest.approx(lo + q_t * (hi - lo) + extra)
    # decode steps: the decode table, with or without the prefill one
    for n, c in ((4, 100.0), (64, 1024.0)):
        assert with_pre.dense_time("gpu", n, c, n * c) == pytest.approx(float(without.dense_time("gpu", n, c)))
    # the CPU lane has no prefill table in this profile: its prefill steps keep the decode reading
    assert with_pre.dense_time("cpu", 128, 16.5, 128) == pytest.approx(float(without.dense_time("cpu", 128, 16.5)))


def test_measured_prefill_table_checks(tmp_path):
    data = _with_prefill_table(load_profile(EXAMPLE)).to_dict()
    data["format_version"] = 2
    for mutate, where in ((lambda d: d["tables"]["gpu_dense_prefill"]["queries"].insert(0, 0),
                           "tables.gpu_dense_prefill.queries[0]"),
                          (lambda d: d["tables"]["gpu_dense_prefill"]["seconds"].pop(), "tables.gpu_dense_prefill.seconds"),
                          (lambda d: d["tables"]["gpu_dense_prefill"].update(tokens=[1, 2]), "tables.gpu_dense_prefill"),
                          (lambda d: d["tables"].update(gpu_dense_block_prefill=d["tables"]["gpu_dense_prefill"]),
                           "tables.gpu_dense_block_prefill: a prefill-layout table needs the decode-layout table")):
        bad = json.loads(json.dumps(data))
        mutate(bad)
        with pytest.raises(ProfileError, match=re.escape(where)):
            measured_profile_from_dict(bad, "p.json")


def test_interp_extrap_rule():
    xp, fp = np.array([1.0, 2.0, 4.0]), np.array([1.0, 3.0, 2.0])
    assert np.allclose(interp_extrap(np.array([0.0, 1.5, 3.0, 8.0]), xp, fp), [1.0, 2.0, 2.5, 2.0])  # negative last slope -> flat


def test_measured_round_trip(tmp_path):
    p = load_profile(EXAMPLE)
    assert isinstance(p, MeasuredProfile)
    out = write_measured_profile(tmp_path / "sub" / "copy.json", p)
    q = load_profile(out)
    assert q == p
    assert json.loads(out.read_text()) == p.to_dict()
    assert not [f for f in out.parent.iterdir() if f.name != "copy.json"]  # no temp file left behind


def test_measured_format_2_round_trip_with_contention_host_and_d2h(tmp_path):
    """Format 2 adds the slowdowns per lane combination, the executor's host costs and the d2h table;
    a format-1 file (the example) still loads, without them, and is written back as format 2."""
    from dali_sim.hardware.contention import lane_combinations
    from dali_sim.hardware.measured import CurveTable, HostCosts

    p = load_profile(EXAMPLE)
    assert p.contention is None and p.host is None and p.d2h is None
    table = {k: {lane: 1.0 + 0.25 * i for i, lane in enumerate(k.split("+"))} for k in lane_combinations()}
    host = HostCosts(layer_s=4e-4, gpu_expert_s=3e-5, cpu_expert_s=1e-4, copy_s=5e-6, decision_s={"dali": 6e-5})
    v2 = dataclasses.replace(p, contention=table, host=host, d2h=CurveTable((1024.0, 65536.0), (1e-5, 3e-5)),
                             lanes={"gpu": 2e-5, "cpu": 5e-5}, lane_wake={"cpu": 3e-4, "host": 2e-5})
    out = write_measured_profile(tmp_path / "v2.json", v2)
    data = json.loads(out.read_text())
    assert data["format_version"] == 2 and set(data["contention"]) == set(lane_combinations())
    q = load_profile(out)
    assert q == v2 and q.host.decision_s == {"dali": 6e-5}
    cm = CostModel(q, get_model_for(q))
    assert (cm.lane_overhead("gpu"), cm.lane_overhead("cpu")) == (2e-5, 5e-5)  # a grouped call's fixed part
    assert CostModel(p, get_model_for(p)).lane_overhead("cpu") == 0.0  # not measured: in the expert tables
    assert (cm.lane_wake("cpu"), cm.lane_wake("gpu"), cm.handoff_time()) == (3e-4, 0.0, 2e-5)
    assert CostModel(p, get_model_for(p)).handoff_time() == 0.0  # not measured: none
    assert cm.contention.rates({"cpu": 0.0, "h2d": 0.0}) == {"cpu": 1 / 1.0, "h2d": 1 / 1.25}
    # a missing combination or lane, or a slowdown below 1, names the field
    for mutate, where in ((lambda d: d["contention"].pop("cpu+h2d"), "contention.cpu+h2d: missing"),
                          (lambda d: d["contention"]["gpu+h2d"].pop("gpu"), "contention.gpu+h2d.gpu: missing"),
                          (lambda d: d["contention"]["cpu+gpu"].update(cpu=0.9), "contention.cpu+gpu.cpu: must be >= 1"),
                          (lambda d: d["host"].pop("copy_s"), "host.copy_s: missing"),
                          (lambda d: d["lanes"].update(cpu=-1e-6), "lanes.cpu: must be >= 0"),
                          (lambda d: d["lane_wake"].update(cpu=-1e-6), "lane_wake.cpu: must be >= 0"),
                          (lambda d: d["lane_wake"].update(host=-1e-6), "lane_wake.host: must be >= 0"),
                          (lambda d: d["lane_wake"].update(disk=1.0), "lane_wake: unknown"),
                          (lambda d: d["host"]["decision_s"].update(dali=-1.0), "host.decision_s.dali: must be >= 0")):
        bad = json.loads(out.read_text())
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ProfileError, match=re.escape(where)):
            load_profile(tmp_path / "bad.json")
    # format 1 has no such fields
    old = json.loads(out.read_text())
    old["format_version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ProfileError, match="unknown field"):
        load_profile(tmp_path / "old.json")


def get_model_for(p: MeasuredProfile):
    """A spec of the shape a measured profile was taken for (the example's toy shape)."""
    return next(m for m in (toy_model(), get_model("mixtral-8x7b", "bf16")) if _shape_matches(p, m))


def _shape_matches(p, m) -> bool:
    try:
        p.check_model(m)
        return True
    except ProfileError:
        return False


def test_measured_writer_refuses_bad_profile_and_writes_nothing(tmp_path):
    p = load_profile(EXAMPLE)
    from dataclasses import replace

    from dali_sim.hardware import CurveTable

    bad = replace(p, cpu_expert=CurveTable((1.0, 8.0), (0.001, float("nan"))))
    with pytest.raises(ProfileError, match=r"tables\.cpu_expert\.seconds\[1\]"):
        write_measured_profile(tmp_path / "bad.json", bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "mutate, field, problem",
    [
        (lambda d: d["tables"]["gpu_expert"].update(tokens=[1, 16, 16, 256]), "tables.gpu_expert.tokens", "strictly increasing"),
        (lambda d: d["tables"]["cpu_expert"].update(seconds=[0.003, -0.1, 0.018]), "tables.cpu_expert.seconds[1]", ">= 0"),
        (lambda d: d["tables"]["h2d"].update(seconds=[0.001, float("nan")]), "tables.h2d.seconds[1]", "finite"),
        (lambda d: d["tables"]["h2d"].update(bytes=[0, 100]), "tables.h2d.bytes[0]", "> 0"),
        (lambda d: d["tables"]["gpu_expert"].update(seconds=[0.1, 0.2]), "tables.gpu_expert.seconds", "list of 4"),
        (lambda d: d["tables"]["gpu_expert"].update(tokens=[5], seconds=[0.1]), "tables.gpu_expert.tokens", "at least 2"),
        (lambda d: d["tables"]["gpu_dense"].update(context_lens=[0]), "tables.gpu_dense.seconds", "1 rows"),
        (lambda d: d["tables"]["gpu_dense"]["seconds"][1].append(0.1), "tables.gpu_dense.seconds[1]", "list of 2"),
        (lambda d: d["tables"].pop("cpu_dense"), "tables.cpu_dense", "missing"),
        (lambda d: d["tables"].update(tpu_expert={}), "tables", "unknown field"),
        (lambda d: d["model"].pop("expert_bytes"), "model.expert_bytes", "missing"),
        (lambda d: d["model"].update(hidden_size=-1), "model.hidden_size", "non-negative integer"),
        (lambda d: d["provenance"].pop("date"), "provenance.date", "missing"),
        (lambda d: d.update(format_version=3), "format_version", "must be one of [1, 2]"),
        (lambda d: d["gpu"].pop("memory_gib"), "gpu.memory_gib", "missing"),
    ],
)
def test_measured_errors_name_file_and_field(tmp_path, mutate, field, problem):
    d = example_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and f"{field}:" in msg and problem in msg


def test_measured_model_mismatch_is_detected():
    p = load_profile(EXAMPLE)
    with pytest.raises(ProfileError, match=r"hw-measured-example\.json: model\.expert_params: .*'olmoe-1b-7b'"):
        CostModel(p, get_model("olmoe-1b-7b"))
    with pytest.raises(ProfileError, match=r"model\.precision: .*q4_0"):
        CostModel(p, get_model("mixtral-8x7b", "q4_0"))
    d = example_dict()
    d["model"]["model"] = "my-mixtral-finetune"  # same shape, other name: accepted
    CostModel(measured_profile_from_dict(d), get_model("mixtral-8x7b", "bf16"))


def test_measured_dict_errors_without_file():
    d = copy.deepcopy(example_dict())
    d["kind"] = "analytic"
    with pytest.raises(ProfileError, match=r"^<dict>: kind: must be 'measured'"):
        measured_profile_from_dict(d)


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_list_and_show(tmp_path):
    r = CliRunner()
    res = r.invoke(hw, ["list"])
    assert res.exit_code == 0
    for name in SHIPPED:
        assert name in res.output
    res = r.invoke(hw, ["show", "rtx3090-epyc7532"])
    assert res.exit_code == 0 and "mem_bandwidth_gbs" in res.output and "source:" in res.output
    res = r.invoke(hw, ["show", "rtx4090-ddr5-desktop", "--json"])
    d = json.loads(res.output)
    assert d["cpu"]["mem_bandwidth_gbs"] == 83.2 and d["cpu"]["mem_bandwidth_gbs_source"]
    res = r.invoke(hw, ["show", str(EXAMPLE)])
    assert res.exit_code == 0 and "gpu_dense" in res.output and "sleeping threads" not in res.output
    woken = dataclasses.replace(load_profile(EXAMPLE), lanes={"gpu": 2e-5, "cpu": 5e-5},
                                lane_wake={"cpu": 1.1e-4, "gpu": 2.5e-4, "host": 2.1e-5})
    res = r.invoke(hw, ["show", str(write_measured_profile(tmp_path / "woken.json", woken))])
    assert res.exit_code == 0 and "a grouped call's fixed part: gpu lane 20 us, cpu lane 50 us" in res.output
    assert ("sleeping threads: a CPU-lane call after its worker slept +110 us, the accelerator's call beside that "
            "wake-up +250 us, the host's hand-over to a sleeping thread +21 us") in res.output


def test_cli_cost_json_matches_cost_model():
    res = CliRunner().invoke(hw, ["cost", "rtx3090-epyc7532", "--model", "mixtral-8x7b", "--tokens", "1,64", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    cm = CostModel(load_profile("rtx3090-epyc7532"), get_model("mixtral-8x7b"))
    assert [r["tokens"] for r in d["rows"]] == [1, 64]
    assert d["rows"][1]["cpu_s"] == pytest.approx(cm.expert_time("cpu", 64))
    assert d["rows"][0]["gpu_uncached_s"] == pytest.approx(cm.expert_transfer_time() + cm.expert_time("gpu", 1))
    assert d["expert_transfer_s"] == pytest.approx(cm.expert_transfer_time())
    assert d["crossover_tokens"] == cm.crossover_tokens()
    res = CliRunner().invoke(hw, ["cost", "rtx3090-epyc7532", "--model", "olmoe-1b-7b", "--precision", "q4_0"])
    assert res.exit_code == 0 and "crossover" in res.output and "q4_0" in res.output


@pytest.mark.parametrize(
    "args, text",
    [
        (["show", "rtx9090"], "unknown hardware profile 'rtx9090'"),
        (["cost", "rtx3090-epyc7532", "--model", "gpt-5"], "unknown model preset 'gpt-5'"),
        (["cost", "rtx3090-epyc7532", "--model", "mixtral-8x7b", "--precision", "fp7"], "unknown precision 'fp7'"),
        (["cost", "rtx3090-epyc7532", "--model", "mixtral-8x7b", "--tokens", "1,x"], "comma-separated integers"),
        (["cost", str(EXAMPLE), "--model", "olmoe-1b-7b"], "model.expert_params"),
    ],
)
def test_cli_errors(args, text):
    res = CliRunner().invoke(hw, args)
    assert res.exit_code != 0
    assert text in res.output


def test_no_torch_import():
    code = "import sys, dali_sim.hardware, dali_sim.cli.hw; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
