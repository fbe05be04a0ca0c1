"""``dali exec run`` and ``dali exec calibrate``; the simulator accepts a calibrated profile."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dali_exec.calibrate import CalibrationConfig, MicroSettings, calibrate  # noqa: E402
from dali_exec.executor.problem import scale_model  # noqa: E402
from dali_sim.cli.main import cli  # noqa: E402
from dali_sim.hardware.cost import CostModel  # noqa: E402
from dali_sim.hardware.measured import read_measured_profile  # noqa: E402
from dali_sim.models.presets import get_model  # noqa: E402
from dali_sim.trace import TraceWriter  # noqa: E402

from conftest import REPO, random_rows  # noqa: E402

GPT_OSS = str(REPO / "traces" / "gpt-oss-20b.parquet")
SCALE = "0.015625"  # 1/64: Mixtral's hidden 4096 -> 64
QUICK = ["--expert-tokens", "1,4,16", "--dense-tokens", "1,4", "--context-lens", "1,32", "--prefill-sequences", "1,2",
         "--prefill-tokens", "1,8", "--repeats", "1",
         "--warmup", "1", "--dtype", "fp32", "--device", "cpu", "--cpu-threads", "1", "--accel-threads", "1"]


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "mixtral-x64.json"
    r = _invoke("exec", "calibrate", "--model-shape", "mixtral-8x7b", "--scale", SCALE, *QUICK, "-o", str(path))
    assert r.exit_code == 0, r.output
    return path, r.output


@pytest.fixture(scope="module")
def profile(calibrated):
    return calibrated[0]


def test_calibrated_profile_is_usable_end_to_end(calibrated, tmp_path):
    """The path `dali exec calibrate` promises: calibrate (tiny, CPU), synthesize a trace of the scaled shape by
    name, simulate it with the profile."""
    path, said = calibrated
    synth = f"dali trace synth --model mixtral-8x7b-x{SCALE} --precision fp32"
    assert synth in said and f"--hardware {path}" in said
    trace = tmp_path / "scaled.parquet"
    r = _invoke("trace", "synth", "--model", f"mixtral-8x7b-x{SCALE}", "--precision", "fp32", "--sequences", "2",
                "--prompt-len", "8", "--gen-len", "8", "-q", "-o", str(trace))
    assert r.exit_code == 0, r.output
    r = _invoke("sim", "run", "--trace", str(trace), "--system", "gpu-lru", "--hardware", str(path), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["model"] == f"mixtral-8x7b-x{SCALE}" and out["hardware"] == read_measured_profile(path).name
    assert out["makespan_s"] > 0
    # the same shape by name in the other commands
    r = _invoke("model", "show", f"mixtral-8x7b-x{SCALE}", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["spec"]["hidden_size"] == 64
    r = _invoke("hw", "cost", str(path), "--model", f"mixtral-8x7b-x{SCALE}", "--precision", "fp32")
    assert r.exit_code == 0, r.output


def test_calibrate_writes_a_measured_profile_of_the_scaled_shape(profile):
    p = read_measured_profile(profile)
    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    assert p.model.hidden_size == 64 and p.model.expert_bytes == model.expert_bytes
    assert p.gpu_expert.x == (1, 4, 16) and all(s > 0 for s in p.gpu_expert.seconds + p.cpu_expert.seconds)
    assert set(p.lanes) == {"gpu", "cpu"} and all(v >= 0 for v in p.lanes.values())  # a grouped call's fixed part
    assert len(p.h2d.x) == 4 and p.h2d.x[2] == model.expert_bytes and all(s > 0 for s in p.h2d.seconds)
    assert p.gpu_dense.context_lens == (1, 32) and len(p.gpu_dense.seconds[1]) == 2
    for pre in (p.gpu_dense_prefill, p.cpu_dense_prefill):  # prefill layout: sequences x new tokens per sequence
        assert pre.sequences == (1, 2) and pre.queries == (1, 8) and all(t > 0 for row in pre.seconds for t in row)
    assert p.gpu_dense_block_prefill is None  # Mixtral has no non-MoE blocks
    prov = p.provenance
    assert prov["command"].startswith("dali exec calibrate") and prov["versions"]["torch"] == torch.__version__
    assert prov["scale"] == 1 / 64 and prov["model_shape"] == "mixtral-8x7b"
    lanes = prov["lanes_beside"]  # the compute lanes side by side, measured in replays (or why not, and the loops')
    assert len(lanes["rounds"]) == 5
    assert p.contention["cpu+gpu"] == (lanes["slowdowns"] if isinstance(lanes["slowdowns"], dict) else
                                       lanes["loops_cpu+gpu"])
    if not torch.cuda.is_available():  # said honestly: the "gpu" is the CPU device, the link a host copy
        assert prov["devices"]["gpu_is_cpu_device"] and "no CUDA" in p.gpu.name and "no CUDA" in p.link_name
    CostModel(p, model)  # the simulator's cost model accepts it for this shape


def test_sim_run_accepts_the_calibrated_profile(profile, tmp_path):
    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    trace = tmp_path / "scaled.parquet"
    with TraceWriter(trace, model, provenance={"source": "random rows", "command": "tests"}) as w:
        w.write(**random_rows(model, seqs=2, tokens=6))
    r = _invoke("sim", "run", "--trace", str(trace), "--system", "gpu-lru", "--hardware", str(profile), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["hardware"] == read_measured_profile(profile).name and out["makespan_s"] > 0
    # a shape it was not measured for is refused, naming the field
    r = _invoke("sim", "run", "--trace", GPT_OSS, "--system", "gpu-lru", "--hardware", str(profile))
    assert r.exit_code == 1 and "model.precision: measured for 'fp32'" in r.output


def test_calibrate_measures_non_moe_blocks_when_the_model_has_them():
    cfg = CalibrationConfig("deepseek-v2-lite", scale=1 / 16, dtype="fp32", device="cpu", cpu_threads=1,
                            accel_threads=1, expert_tokens=(1, 2), dense_tokens=(1, 2), context_lens=(4,),
                            prefill_sequences=(1, 2), prefill_queries=(4,),
                            settings=MicroSettings(repeats=1, warmup=0, table_rounds=1))
    p = calibrate(cfg)
    assert p.gpu_dense_block is not None and p.cpu_dense_block is not None
    model = cfg.model()
    cm = CostModel(p, model)
    assert cm.dense_block_time("cpu", 2, 4) > 0
    # a prefill of 2 prompts of 4 tokens reads the block's prefill-layout table at its corner
    assert cm.dense_block_time("gpu", 8, 2.5, 8) == pytest.approx(p.gpu_dense_block_prefill.seconds[0][1])
    assert cm.dense_time("cpu", 4, 2.5, 4) == pytest.approx(p.cpu_dense_prefill.seconds[0][0])
    with pytest.raises(ValueError, match="expert_tokens must be strictly increasing"):
        CalibrationConfig("mixtral-8x7b", expert_tokens=(4, 2))
    with pytest.raises(ValueError, match="prefill_sequences must be strictly increasing.*got \\[1\\]"):
        CalibrationConfig("mixtral-8x7b", prefill_sequences=(1,))
    assert CalibrationConfig("mixtral-8x7b", prefill_sequences=(), prefill_queries=()).prefill_queries == ()


def test_exec_run_prints_metrics_and_writes_timeline_and_csv(profile, tmp_path):
    from dali_sim.trace.synth import SynthConfig, synthesize

    trace = tmp_path / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=3, prompt_len=4, gen_len=4, seed=1), trace)
    tl, csv = tmp_path / "tl.json", tmp_path / "layers.csv"
    args = ["exec", "run", "--trace", str(trace), "--system", "fiddler", "--layers", "2", "--scale", SCALE,
            "--dtype", "fp32", "--device", "cpu", "--cpu-threads", "1", "--accel-threads", "1",
            "--hardware", str(profile), "--batch-size", "2"]
    # the default split: the first of the 3 sequences profiles (fiddler's popular set), 2 are replayed; the
    # batch cannot exceed them
    r = _invoke(*args[:-1], "3")
    assert r.exit_code == 1 and "batch size 3 exceeds the 2 sequence(s) evaluated" in r.output
    r = _invoke(*args, "--timeline", str(tl), "--csv", str(csv))
    assert r.exit_code == 0, r.output
    assert "overhead per layer: decisions" in r.output and "executed on" in r.output
    if not torch.cuda.is_available():  # the CPU device is not reported as the profile's GPU
        first = r.output.splitlines()[0]
        assert first.startswith("system fiddler executed on CPU device")
        assert "policies' costs from measured-mixtral-8x7b-x0.015625-cpu" in first
        busy = next(line for line in r.output.splitlines() if line.startswith("busy:"))
        assert "ACCEL (CPU device)" in busy and "GPU" not in busy
    events = json.loads(tl.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("dense L1") for e in events)
    assert csv.read_text().splitlines()[0].startswith("layer,activated,hits")
    r = _invoke(*args, "--json")
    out = json.loads(r.output)
    assert out["system"] == "fiddler" and out["executor"]["device"] == "cpu" and out["sequences"] == 2
    assert out["manifest"]["profiling"]["source"] == "split" and out["config"]["profiling"]["share"] == 0.25
    assert out["manifest"]["executor"]["replay"]["scale"] == 1 / 64


def test_exec_run_errors_are_one_line():
    r = CliRunner().invoke(cli, ["exec", "run", "--trace", GPT_OSS, "--system", "gpu-lru", "--model-shape",
                                 "mixtral-8x7b", "--device", "cpu"])
    assert r.exit_code == 1 and r.output.startswith("Error: --model-shape mixtral-8x7b")
    r = CliRunner().invoke(cli, ["exec", "run", "--trace", GPT_OSS, "--system", "gpu-lru", "--scale", "2"])
    assert r.exit_code == 1 and "scale must lie in (0, 1]" in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(cli, ["exec", "run", "--trace", GPT_OSS, "--system", "gpu-lru", "--device", "cuda",
                                     "--layers", "1", "--scale", "0.05", "--sequences", "1", "--max-tokens", "1"])
        assert r.exit_code == 1 and "CUDA is not available" in r.output


def test_expert_share_and_fixed_part_of_a_grouped_call(monkeypatch):
    """A call of g experts with n tokens each taking fixed + g * per(n) seconds gives back per(n) as the
    expert table and fixed as the lane's part per layer; the grouped op computes each expert on its own
    tokens, as one call per expert does."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    worker = CpuWorker(1)
    try:
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, MicroSettings(repeats=1, warmup=0))
        assert bench.group_sizes() == (1, 2, 4, 8)  # capped at the model's 8 experts
        y1, y8 = bench.expert_op("cpu", 3, 1)(0), bench.expert_op("cpu", 3, 8)(0)
        assert y1.shape == (3, 64) and y8.shape == (3 * 8, 64)
        monkeypatch.setattr(micro.Microbench, "expert_op", lambda self, lane, n, group=1: (n, group))
        monkeypatch.setattr(micro.Microbench, "_timed", lambda self, lane, op: 7e-5 + op[1] * 1e-5 * op[0])
        per, fixed = bench.expert_seconds("cpu", [1, 4, 16])
        # one noisy call (a group of 8 taking 10% more per expert) leaves the share and the fixed part where the
        # other calls put them; a least-squares line would give a share 10% high and a negative intercept
        monkeypatch.setattr(micro.Microbench, "_timed",
                            lambda self, lane, op: 7e-5 + op[1] * 1e-5 + (8e-6 if op[1] == 8 else 0.0))
        noisy, noisy_fixed = bench.expert_seconds("cpu", [1])
        g = np.array([1.0, 2, 4, 8])
        lsq_slope = np.polyfit(g, 7e-5 + g * 1e-5 + np.where(g == 8, 8e-6, 0.0), 1)[0]
    finally:
        worker.close()
    assert per == pytest.approx([1e-5, 4e-5, 16e-5]) and fixed == pytest.approx(7e-5)
    assert noisy[0] == pytest.approx(1e-5, rel=0.02) and noisy_fixed == pytest.approx(7e-5, rel=0.05)
    assert lsq_slope > 1.08e-5  # (what the old fit made of it)


def test_both_lanes_expert_tables_are_timed_point_by_point_in_turn(monkeypatch):
    """Microbench.lanes_expert_seconds times each (tokens, group size) point on every lane before the next point,
    and fits each lane's line as expert_seconds does for that lane alone: a machine that slows down halfway
    through slows both lanes' tables alike (here the second half of the calls 1.5x, and both lanes' share and
    fixed part come out equal, where timing one lane's table after the other's would set them 1.5x apart)."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    worker = CpuWorker(1)
    order = []

    def timed(self, lane, op):
        order.append((lane, op))
        slow = 1.5 if len(order) > 8 else 1.0  # (16 calls: 2 token counts x 4 group sizes x 2 lanes)
        return slow * (7e-5 + op[1] * 1e-5 * op[0])
    try:
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, MicroSettings(repeats=1, warmup=0))
        monkeypatch.setattr(micro.Microbench, "expert_op", lambda self, lane, n, group=1: (n, group))
        monkeypatch.setattr(micro.Microbench, "_timed", timed)
        (gpu, gpu_fixed), (cpu, cpu_fixed) = bench.lanes_expert_seconds(("gpu", "cpu"), [1, 4])
        order.clear()
        alone = bench.expert_seconds("cpu", [1, 4])
    finally:
        worker.close()
    assert gpu == pytest.approx(cpu) and gpu_fixed == pytest.approx(cpu_fixed)
    assert gpu == pytest.approx([1e-5, 6e-5])  # (1 token at full speed, 4 tokens at 1.5x)
    assert gpu_fixed == pytest.approx(7e-5 * 1.25)  # (the median of the two lines' intercepts)
    assert alone == (pytest.approx([1e-5, 4e-5]), pytest.approx(7e-5))  # (its 8 calls all before the slowdown)
    order.clear()
    monkeypatch.setattr(micro.Microbench, "_timed", lambda self, lane, op: order.append(lane) or 1e-4)
    monkeypatch.setattr(micro.Microbench, "expert_op", lambda self, lane, n, group=1: (n, group))
    bench.lanes_expert_seconds(("gpu", "cpu"), [1])
    assert order == ["gpu", "cpu"] * 4


def test_calibration_draws_its_copy_sources_and_dense_blocks_once(monkeypatch):
    """A bench draws the host copies of its copy measurements and the dense blocks of its tables once and reuses
    them (drawing a Mixtral copy source took 0.77 s on the 2-core VM, and the contention rounds asked for 40):
    every copy op reads the same source into a destination of its own, every dense table of one device and kind
    times the same blocks, and what is timed still runs."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    model = scale_model(get_model("deepseek-v2-lite"), 1 / 64, 2, "fp32")  # (a dense block, then MoE blocks)
    made = []
    block = micro.DenseBlock

    def counted(*args, **kwargs):
        made.append(args[2])  # (moe or not)
        return block(*args, **kwargs)
    monkeypatch.setattr(micro, "DenseBlock", counted)
    worker = CpuWorker(1)
    try:
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker,
                                 MicroSettings(repeats=1, warmup=0, rotate_bytes=1 << 20))
        a, b = bench._copy_op(), bench._copy_op()
        src = bench._copy_src[0]
        assert bench._copy_op() is not a and bench._copy_src[0] is src  # (the same host copies)
        ya, yb = a(1), b(1)
        assert ya.data_ptr() != yb.data_ptr() and torch.equal(ya, src[1]) and torch.equal(yb, src[1])
        first = bench.dense_seconds("gpu", [1, 2], [1, 4])
        per_kind = len(made)
        bench.dense_seconds("cpu", [1], [2])  # (the CPU device: both lanes' tables time the same blocks)
        bench.prefill_seconds("gpu", [1], [2])
        assert len(made) == per_kind >= 2
        bench.dense_seconds("gpu", [1], [1], moe=False)
        dense_only = made.count(False)
        bench.dense_seconds("cpu", [2], [1], moe=False)
        assert made.count(True) == per_kind and made.count(False) == dense_only >= 2
    finally:
        worker.close()
    assert len(first) == 2 and all(len(row) == 2 and min(row) > 0 for row in first)


def test_tables_are_measured_in_rounds_and_each_point_keeps_its_median(monkeypatch):
    """Every table is measured once per round, round after round; a point slowed in one round of three (a
    spike of the shared machine) keeps the other rounds' value."""
    from dali_exec.calibrate import micro, profile

    assert profile.median_of_rounds([([1.0, 2.0], 0.1), ([9.0, 2.2], 0.3), ([1.2, 2.1], 0.2)]) == (
        pytest.approx([1.2, 2.1]), pytest.approx(0.2))
    assert profile.median_of_rounds([[[1.0, 5.0]], [[1.1, 50.0]], [[0.9, 5.5]]]) == [pytest.approx([1.0, 5.5])]
    calls = []

    def lanes_expert_seconds(self, lanes, tokens):
        calls.append(lanes)
        spike = [4.0 if (lane == "cpu" and len(calls) == 2) else 1.0 for lane in lanes]
        return tuple(([1e-4 * n * f for n in tokens], 1e-5) for f in spike)

    monkeypatch.setattr(micro.Microbench, "lanes_expert_seconds", lanes_expert_seconds)
    cfg = CalibrationConfig("mixtral-8x7b", scale=1 / 64, dtype="fp32", device="cpu", cpu_threads=1,
                            accel_threads=1, expert_tokens=(1, 2), dense_tokens=(1, 2), context_lens=(4,),
                            settings=MicroSettings(repeats=1, warmup=0, table_rounds=3), contention=False, host=None)
    p = calibrate(cfg)
    assert calls == [("gpu", "cpu")] * 3  # round by round, not one table three times in a row
    assert p.cpu_expert.seconds == pytest.approx((1e-4, 2e-4))
    with pytest.raises(ValueError, match="table_rounds must be >= 1"):
        MicroSettings(table_rounds=0)


def test_a_calibration_keeps_each_rounds_expert_tables_and_fixed_parts(monkeypatch):
    """The profile's expert tables and ``lanes`` are the rounds' medians; ``provenance.expert_rounds`` keeps every
    round's, lane by lane (what a validation simulates once per round: docs/validation.md, "The calibration's
    rounds")."""
    from dali_exec.calibrate import micro

    per_round = iter([((1.0, 2e-4), (1.0, 3.4e-4)), ((1.2, 2.1e-4), (0.8, 1.6e-4)), ((1.1, 2.2e-4), (0.9, 2e-4))])

    def lanes_expert_seconds(self, lanes, tokens):
        return tuple(([1e-4 * n * f for n in tokens], fixed) for f, fixed in next(per_round))

    monkeypatch.setattr(micro.Microbench, "lanes_expert_seconds", lanes_expert_seconds)
    cfg = CalibrationConfig("mixtral-8x7b", scale=1 / 64, dtype="fp32", device="cpu", cpu_threads=1,
                            accel_threads=1, expert_tokens=(1, 2), dense_tokens=(1, 2), context_lens=(4,),
                            settings=MicroSettings(repeats=1, warmup=0, table_rounds=3), contention=False, host=None)
    p = calibrate(cfg)
    assert p.lanes == {"gpu": pytest.approx(2.1e-4), "cpu": pytest.approx(2e-4)}
    assert p.gpu_expert.seconds == pytest.approx((1.1e-4, 2.2e-4))
    assert p.cpu_expert.seconds == pytest.approx((9e-5, 1.8e-4))
    rounds = p.provenance["expert_rounds"]
    assert rounds["gpu"]["fixed"] == [2e-4, 2.1e-4, 2.2e-4] and rounds["cpu"]["fixed"] == [3.4e-4, 1.6e-4, 2e-4]
    assert np.allclose(rounds["cpu"]["shares"], [[1e-4, 2e-4], [8e-5, 1.6e-4], [9e-5, 1.8e-4]])


def test_wake_up_cost_is_the_call_after_a_sleep_minus_the_call_straight_after_another(monkeypatch):
    """Microbench.wake_seconds: each round times the lane's call after ``wake_gap_s`` of sleep and straight
    (caches flushed both times) and keeps the median difference, never below 0."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    slept = []
    monkeypatch.setattr(micro.time, "sleep", lambda s: slept.append(s))

    def fake_time_call(after_sleep: float):
        def timed(fn, *, cuda, repeats, warmup, prepare=None):
            before = len(slept)
            if prepare is not None:
                prepare()
            return after_sleep if len(slept) > before else 1e-3
        return timed

    monkeypatch.setattr(micro, "time_call", fake_time_call(1.3e-3))
    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    worker = CpuWorker(1)
    try:
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker,
                                 MicroSettings(repeats=1, warmup=0, contention_rounds=3, wake_gap_s=0.004))
        assert bench.wake_seconds("cpu") == pytest.approx(3e-4)
        assert slept == [0.004] * 3
        monkeypatch.setattr(micro, "time_call", fake_time_call(0.9e-3))
        assert bench.wake_seconds("cpu") == 0.0  # (a faster call after the sleep is noise: clipped)
    finally:
        worker.close()
    with pytest.raises(ValueError, match="wake_gap_s"):
        MicroSettings(wake_gap_s=-1.0)


def test_beside_wake_cost_is_the_accelerator_call_as_the_worker_wakes_minus_it_beside_the_sleeping_worker(
        monkeypatch):
    """Microbench.beside_wake_seconds: each round times the accelerator lane's call with the CPU lane's worker
    handed a call just before it and with the worker left asleep, and keeps the median difference, never below
    0; the real measurement runs the worker's calls to completion."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    worker = CpuWorker(1)
    try:
        settings = MicroSettings(repeats=2, warmup=0, contention_rounds=3, wake_gap_s=0.001)
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, settings)
        assert bench.beside_wake_seconds() >= 0.0  # real calls: every submitted job finishes
        calls = []

        def fake_time_call(woken_s: float):
            def timed(fn, *, cuda, repeats, warmup, prepare=None):
                prepare()
                calls.append(prepare.__name__)
                return woken_s if prepare.__name__ == "woken" else 1e-3
            return timed

        monkeypatch.setattr(micro, "time_call", fake_time_call(1.4e-3))
        assert bench.beside_wake_seconds() == pytest.approx(4e-4)
        assert calls == ["asleep", "woken"] * 3
        monkeypatch.setattr(micro, "time_call", fake_time_call(0.8e-3))
        assert bench.beside_wake_seconds() == 0.0  # (faster beside a woken worker is noise: clipped)
    finally:
        worker.close()


def test_handoff_cost_is_the_median_submission_to_a_worker_asleep_after_a_flush(monkeypatch):
    """Microbench.handoff_seconds: ``contention_rounds`` x ``repeats`` hand-overs, each after the host's caches
    were flushed and the calling thread kept busy for ``wake_gap_s`` (the worker asleep meanwhile), each timed
    around the submission alone (not the job's run, not the wait for it); the median is kept. The real
    measurement hands real jobs over, each finished."""
    from dali_exec.calibrate import micro
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices

    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    settings = MicroSettings(repeats=2, warmup=0, contention_rounds=3, wake_gap_s=0.001)
    worker = CpuWorker(1)
    try:
        real = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, settings).handoff_seconds()
        assert 0.0 < real < 0.1
    finally:
        worker.close()

    clock, events = [0.0], []

    class Job:
        def result(self):
            events.append("result")
            clock[0] += 1.0  # (the wait for the job: not timed)

    class Worker:
        threads = 1
        costs = iter([5e-6, 9e-6, 7e-6, 30e-6, 6e-6, 8e-6])

        def submit(self, fn):
            fn()
            events.append("submit")
            clock[0] += next(self.costs)
            return Job()

    monkeypatch.setattr(micro.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(micro, "_busy", lambda s: events.append(("busy", s)))
    bench = micro.Microbench(model, Devices.create("cpu", "fp32"), Worker(), settings)
    flushes = []
    monkeypatch.setattr(bench, "flush", lambda lane: lambda: flushes.append(lane))
    assert bench.handoff_seconds() == pytest.approx(7.5e-6)  # the median of the six submissions
    assert events == [("busy", 0.001), "submit", "result"] * 6
    assert flushes == ["cpu"] * 6


def test_the_spinning_costs_are_measured_with_the_worker_still_spinning(monkeypatch):
    """Where the CPU lane's worker spins, the calibration also measures a hand-over that finds it spinning (its last
    job half its spin before, ``spin_gap_s``): the submission alone (no wake: the worker's wake count does not
    move), the CPU call after the worker spun instead of slept (the compiled spin, ``spin_for``), and the
    profile's ``lane_wake`` gets ``*_spinning`` entries; a worker that does not spin has none."""
    from dali_exec.calibrate import micro
    from dali_exec.calibrate.profile import _lane_wakes
    from dali_exec.executor.cpu_worker import CpuWorker
    from dali_exec.executor.devices import Devices
    from dali_exec.executor.doorbell import spin_available

    model = scale_model(get_model("mixtral-8x7b"), 1 / 64, None, "fp32")
    settings = MicroSettings(repeats=2, warmup=0, contention_rounds=2, wake_gap_s=0.05)
    if spin_available():
        class Worker(CpuWorker):
            woke: list = []

            def submit(self, fn, *args, **kwargs):
                before = self.wakes
                job = super().submit(fn, *args, **kwargs)
                self.woke.append(self.wakes - before)
                return job

        worker = Worker(1, 0.02)
        try:
            bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, settings)
            assert bench.spin_gap_s() == 0.01
            assert 0.0 < bench.handoff_seconds(spinning=True) < 0.1
            # (each timed submission follows an untimed job, which may wake it after the flush: that starts its spin)
            assert len(worker.woke) == 8 and worker.woke[1::2] == [0] * 4
            spun, slept = [], []
            monkeypatch.setattr(micro, "spin_for", spun.append)
            monkeypatch.setattr(micro.time, "sleep", slept.append)
            bench.wake_seconds("cpu", spinning=True)
            assert spun == [0.01] * 4 and slept == []  # (2 rounds of 2 timed calls)
        finally:
            worker.close()
    worker = CpuWorker(1, 0.0)
    try:
        bench = micro.Microbench(model, Devices.create("cpu", "fp32"), worker, settings)
        with pytest.raises(ValueError, match="does not spin"):
            bench.spin_gap_s()
    finally:
        worker.close()

    class Bench:
        def __init__(self, spin_s):
            self.worker = type("W", (), {"spin_s": spin_s})()

        def wake_seconds(self, lane, spinning=False):
            return 2.0 if spinning else 1.0

        def beside_wake_seconds(self, spinning=False):
            return 4.0 if spinning else 3.0

        def handoff_seconds(self, spinning=False):
            return 6.0 if spinning else 5.0

    assert _lane_wakes(Bench(0.0)) == {"cpu": 1.0, "gpu": 3.0, "host": 5.0}
    assert _lane_wakes(Bench(1e-3)) == {"cpu": 1.0, "gpu": 3.0, "host": 5.0, "cpu_spinning": 2.0,
                                        "gpu_spinning": 4.0, "host_spinning": 6.0}


def test_host_decisions_are_the_median_host_interval_of_a_replay_of_each_named_system(monkeypatch):
    """The calibrated decision time per layer visit is measured where the executor pays it, inside a replay
    (caches cold after each layer's work): the median of the replay's ``host`` intervals, one per visit, for
    exactly the named systems; a named system that cannot run is an error naming it."""
    import statistics
    import tempfile
    from pathlib import Path

    from dali_exec.calibrate import host
    from dali_exec.executor.devices import Devices
    from dali_exec.executor.problem import ReplayOptions, prepare_replay
    from dali_exec.executor.replay import ExecOptions, Replay
    from dali_exec.executor.store import HostExpertStore

    seen = {}
    real_run = Replay.run

    def run(self, *a, **kw):
        result = real_run(self, *a, **kw)
        w = self.setup.workload
        seen[self.setup.sysconf.name] = ([iv.end - iv.start for iv in result.intervals if iv.track == "host"],
                                         w.num_steps * w.num_layers)
        return result

    monkeypatch.setattr(Replay, "run", run)
    s = host.HostSettings(layers=2, sequences=2, prompt_tokens=3, decode_tokens=2, batch_sizes=(1,),
                          systems=("cpu-only", "dali"))
    devices = Devices.create("cpu", "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        trace = host.workload_trace(get_model("mixtral-8x7b"), s, Path(tmp))
        opts = ReplayOptions(scale=1 / 64, layers=2, dtype="fp32")
        store = HostExpertStore.random(prepare_replay(trace, "cpu-only", opts).model, devices.dtype, 0)
        run_opts = ExecOptions(device="cpu")
        out = host.decision_seconds(trace, opts, devices, run_opts, store, s)
        assert set(out) == set(seen) == {"cpu-only", "dali"}
        for system, (visits, expected) in seen.items():
            assert len(visits) == expected > 0  # one interval per layer visit
            assert out[system] == statistics.median(visits) > 0
        with pytest.raises(ValueError, match="host decisions of system 'no-such-system'"):
            host.decision_seconds(trace, opts, devices, run_opts, store,
                                  dataclasses.replace(s, systems=("no-such-system",)))


def test_calibrate_systems_option_names_the_presets_whose_decisions_are_measured(monkeypatch, tmp_path):
    """``--systems`` reaches the host settings (a replay of each named preset only); an unknown name is a
    one-line usage error naming the option, and nothing is written."""
    import dali_exec.calibrate as cal

    class Stop(Exception):
        pass

    seen = []

    def calibrate_to(path, cfg, **kw):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(cal, "calibrate_to", calibrate_to)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["exec", "calibrate", "--model-shape", "mixtral-8x7b", "--systems", "dali, cpu-only",
                                 "-o", str(out)])
    assert isinstance(r.exception, Stop), r.output
    assert seen[0].host.systems == ("dali", "cpu-only")
    r = _invoke("exec", "calibrate", "--model-shape", "mixtral-8x7b", "--systems", "dali,no-such", "-o", str(out))
    assert r.exit_code == 2 and "--systems" in r.output and "'no-such'" in r.output and not out.exists()
    assert seen[0].lanes.rounds == 5  # (the default: the two compute lanes measured in replays)
    for args, rounds in ((["--lane-rounds", "3"], 3), (["--lane-rounds", "0"], None)):
        seen.clear()
        r = CliRunner().invoke(cli, ["exec", "calibrate", "--model-shape", "mixtral-8x7b", *args, "-o", str(out)])
        assert isinstance(r.exception, Stop), r.output
        assert (seen[0].lanes.rounds if rounds else seen[0].lanes) == rounds
    r = _invoke("exec", "calibrate", "--model-shape", "mixtral-8x7b", "--lane-rounds", "-1", "-o", str(out))
    assert r.exit_code == 2 and "--lane-rounds" in r.output and not out.exists()


def _host_fit_rows(run, **kw):
    """The host fit's rows (``calibrate.host._bookkeeping_rows``) of a small Mixtral workload (2 layers at scale
    1/64, one batch size) on the CPU device with ``run``'s threads."""
    import tempfile
    from pathlib import Path

    from dali_exec.calibrate.host import HostSettings, _bookkeeping_rows, workload_trace
    from dali_exec.executor.devices import Devices
    from dali_exec.executor.problem import ReplayOptions, prepare_replay
    from dali_exec.executor.store import HostExpertStore

    s = HostSettings(layers=2, sequences=2, prompt_tokens=3, decode_tokens=2, batch_sizes=(1,))
    devices = Devices.create("cpu", "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        trace = workload_trace(get_model("mixtral-8x7b"), s, Path(tmp))
        opts = ReplayOptions(scale=1 / 64, layers=2, dtype="fp32")
        store = HostExpertStore.random(prepare_replay(trace, "cpu-only", opts).model, devices.dtype, 0)
        return _bookkeeping_rows(trace, opts, devices, run, store, s, **kw)


@pytest.mark.parametrize("accel_threads, handed", [(1, False), (2, True)])
def test_host_fit_takes_out_the_hand_overs_the_simulator_charges_apart(accel_threads, handed):
    """The host fit's rows leave out ``handoff_s`` per layer visit where cpu-only's replay hands its CPU lane to
    the worker (the lanes' threads differ: 1 against 2) and nowhere else (the same threads: the lane runs inline;
    the GPU-lane systems have no CPU lane): with 1 s per hand-over the cpu-only rows fall by 2 s (2 layers)."""
    from dali_exec.executor.replay import ExecOptions

    _, y = _host_fit_rows(ExecOptions(device="cpu", cpu_threads=1, accel_threads=accel_threads), handoff_s=1.0)
    steps = len(y) // 3
    cpu, gpu = y[:steps], y[steps:]
    assert (abs(gpu) < 0.5).all()  # (seconds of bookkeeping: far below the 2 s a hand-over would take out)
    assert ((cpu < -1.5) if handed else (abs(cpu) < 0.5)).all()


def test_host_fit_rows_count_every_on_demand_copy():
    """The host-cost replays: cpu-only rows count CPU experts, gpu-static rows GPU experts, and the
    serial gpu-lru rows (no cache, one staging buffer) count each GPU expert as one on-demand copy too,
    so ``copy_s`` is fitted from real staging turns; every row has its layer visits."""
    from dali_exec.executor.replay import ExecOptions

    X, y = _host_fit_rows(ExecOptions(device="cpu"))
    steps = len(y) // 3
    cpu, gpu, lru = X[:steps], X[steps:2 * steps], X[2 * steps:]
    assert (X[:, 0] == 2).all() and len(y) == 3 * steps
    assert (cpu[:, 1] == 0).all() and (cpu[:, 2] > 0).all() and (cpu[:, 3] == 0).all()
    assert (gpu[:, 1] > 0).all() and (gpu[:, 2] == 0).all() and (gpu[:, 3] == 0).all()
    assert (lru[:, 1] == lru[:, 3]).all() and (lru[:, 3] > 0).all() and (lru[:, 2] == 0).all()
    assert np.isfinite(y).all()
