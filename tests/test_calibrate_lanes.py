"""The compute lanes side by side, measured in replays (``dali_exec.calibrate.lanes``): the runtime's lanes-apart
mode, the slowdowns from the rounds' seconds, and the profile's ``cpu+gpu`` entry taken from them."""

import dataclasses
import tempfile
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dali_exec.calibrate import CalibrationConfig, MicroSettings, calibrate  # noqa: E402
from dali_exec.calibrate import lanes as lanes_mod  # noqa: E402
from dali_exec.calibrate import profile as profile_mod  # noqa: E402
from dali_exec.calibrate.host import HostSettings, workload_trace  # noqa: E402
from dali_exec.executor.devices import Devices  # noqa: E402
from dali_exec.executor.problem import ReplayOptions, prepare_replay  # noqa: E402
from dali_exec.executor.replay import ExecOptions, Replay  # noqa: E402
from dali_exec.executor.store import HostExpertStore  # noqa: E402
from dali_sim.models.presets import get_model  # noqa: E402
from dali_sim.sim.busy import lanes_overlap_seconds  # noqa: E402

SMALL = HostSettings(layers=2, sequences=4, prompt_tokens=3, decode_tokens=3)


def _rounds(*pairs):
    """Rounds from (beside gpu, beside cpu, both, apart gpu, apart cpu) tuples."""
    return [{"beside": {"gpu": bg, "cpu": bc, "both": both}, "apart": {"gpu": ag, "cpu": ac, "both": 0.0}}
            for bg, bc, both, ag, ac in pairs]


def test_slowdowns_are_one_over_the_median_rate_within_the_overlap():
    # gpu: 2 s more side by side within 8 s together -> it did 6 s of its alone work there: rate 0.75, 1/0.75;
    # cpu: 1 s more (rate 7/8) in two rounds, 4 s more in the third (the median ignores it)
    got = lanes_mod.slowdowns(_rounds((12, 11, 8, 10, 10), (12, 11, 8, 10, 10), (12, 14, 8, 10, 10)))
    assert got == {"gpu": pytest.approx(4 / 3), "cpu": pytest.approx(8 / 7)}
    # a lane faster side by side (noise) is no speed-up: 1
    assert lanes_mod.slowdowns(_rounds((9, 10, 8, 10, 10)))["gpu"] == 1.0


def test_slowdowns_say_why_the_rounds_cannot_give_one():
    assert "never busy at once in round 1" in lanes_mod.slowdowns(_rounds((12, 11, 8, 10, 10), (12, 11, 0, 10, 10)))
    noisy = lanes_mod.slowdowns(_rounds((19, 11, 8, 10, 10)))  # 9 s more than apart, within 8 s together
    assert "gpu lane's calls grew by more than the lanes overlapped" in noisy and "-0.125" in noisy
    with pytest.raises(ValueError, match="rounds, batch_size and layers must be >= 1"):
        lanes_mod.LaneSettings(layers=0)


def _split_replay(tmp: str):
    """A replay of the measurement's static split on a small random workload (Mixtral shape at 1/64, fp32)."""
    trace = workload_trace(get_model("mixtral-8x7b"), SMALL, Path(tmp))
    opts = ReplayOptions(scale=1 / 64, layers=2, dtype="fp32")
    half = {"memory": {"gpu_memory_gib": "1024", "cache_experts": str(trace.num_experts // 2)}}
    setup = prepare_replay(trace, lanes_mod.LaneSettings().system, opts, batch_size=2, overrides=half)
    store = HostExpertStore.random(setup.model, torch.float32, 0)
    return Replay(setup, Devices.create("cpu", "fp32"), ExecOptions(device="cpu", cpu_threads=1, accel_threads=1),
                  store=store)


def test_lanes_apart_runs_each_layers_cpu_lane_before_its_accelerator_lane_with_the_same_outputs():
    """``OffloadRuntime.lanes_apart``: the same calls and outputs, the CPU lane's job finished before the accelerator
    lane's experts start (never both busy at once)."""
    with tempfile.TemporaryDirectory() as tmp:
        replay = _split_replay(tmp)
        outputs = {}
        try:
            for apart in (False, True):
                replay.runtime.lanes_apart = apart
                seen = []
                result = replay.run(lambda rec: seen.append(rec.output.clone()))
                outputs[apart] = (seen, result)
        finally:
            replay.close()
    (beside, r_beside), (apart, r_apart) = outputs[False], outputs[True]
    assert len(beside) == len(apart) > 0 and all(torch.equal(a, b) for a, b in zip(beside, apart))
    assert r_beside.summary["cpu_experts"] == r_apart.summary["cpu_experts"] > 0
    assert r_beside.summary["gpu_experts"] == r_apart.summary["gpu_experts"] > 0
    assert lanes_overlap_seconds(r_apart.intervals) == 0.0
    cpu_end, gpu_start = {}, {}
    for iv in r_apart.intervals:
        key = (iv.args["step"], iv.name.split(" ")[0])  # (step, "L<layer>")
        if iv.track == "cpu":
            cpu_end[key] = max(cpu_end.get(key, 0.0), iv.end)
        elif iv.track == "gpu" and iv.name.startswith("L"):
            gpu_start[key] = min(gpu_start.get(key, float("inf")), iv.start)
    both = set(cpu_end) & set(gpu_start)
    assert both and all(cpu_end[k] <= gpu_start[k] for k in both)


def test_the_measurement_alternates_the_modes_and_reads_each_lanes_expert_seconds(monkeypatch):
    modes = []
    real_run = Replay.run

    def run(self, *a, **kw):
        modes.append(self.runtime.lanes_apart)
        return real_run(self, *a, **kw)

    monkeypatch.setattr(Replay, "run", run)
    # (a workload of 2 sequences: every one replayed, the batch cut to them)
    out = lanes_mod.measure_lane_slowdowns(get_model("mixtral-8x7b"), 1 / 64, "fp32", Devices.create("cpu", "fp32"),
                                           ExecOptions(device="cpu", cpu_threads=1, accel_threads=1),
                                           dataclasses.replace(SMALL, sequences=2), lanes_mod.LaneSettings(rounds=3))
    assert modes == [False, False, True, True, False, False, True]  # warm-up, then beside/apart, apart/beside, ...
    assert len(out["rounds"]) == 3 and out["batch_size"] == 2  # (LaneSettings' 4, cut to the 2 sequences)
    for r in out["rounds"]:
        assert r["apart"]["both"] == 0.0 and all(r[m][lane] > 0 for m in lanes_mod.MODES for lane in ("gpu", "cpu"))
    assert out["slowdowns"] == lanes_mod.slowdowns(out["rounds"])


def _quick_config(**kw):
    return CalibrationConfig("mixtral-8x7b", scale=1 / 64, dtype="fp32", device="cpu", cpu_threads=1, accel_threads=1,
                             expert_tokens=(1, 4), dense_tokens=(1, 4), context_lens=(1,), prefill_sequences=(),
                             prefill_queries=(),
                             settings=MicroSettings(repeats=1, warmup=0, contention_rounds=1, table_rounds=1),
                             host=None, **kw)


def test_the_profiles_cpu_gpu_contention_is_the_lanes_measurement(monkeypatch):
    rounds = _rounds((12, 11, 8, 10, 10))
    monkeypatch.setattr(profile_mod, "measure_lane_slowdowns",
                        lambda *a, **k: {"slowdowns": {"gpu": 1.3, "cpu": 1.2}, "rounds": rounds, "batch_size": 4})
    p = calibrate(_quick_config())
    assert p.contention["cpu+gpu"] == {"gpu": 1.3, "cpu": 1.2}
    beside = p.provenance["lanes_beside"]
    assert beside["rounds"] == rounds and set(beside["loops_cpu+gpu"]) == {"gpu", "cpu"}
    assert "cpu+gpu: the compute lanes' expert calls side by side" in p.provenance["contention"]
    assert "at batch 4 " in p.provenance["contention"]
    assert all(set(f) == set(key.split("+")) for key, f in p.contention.items())  # the other combinations: the loops'


def test_a_lanes_measurement_without_slowdowns_keeps_the_loops_reading_and_says_so(monkeypatch):
    monkeypatch.setattr(profile_mod, "measure_lane_slowdowns",
                        lambda *a, **k: {"slowdowns": "the lanes were never busy at once in round 0", "rounds": [],
                                         "batch_size": 4})
    with pytest.warns(RuntimeWarning, match="never busy at once in round 0.*the loops' reading"):
        p = calibrate(_quick_config())
    assert p.contention["cpu+gpu"] == p.provenance["lanes_beside"]["loops_cpu+gpu"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = calibrate(dataclasses.replace(_quick_config(), lanes=None))  # (measured by the loops only: no warning)
    assert not [w for w in caught if "side by side" in str(w.message)]
    assert "lanes_beside" not in off.provenance and "side by side" not in off.provenance["contention"]
