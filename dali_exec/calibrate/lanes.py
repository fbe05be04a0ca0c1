"""How much the two compute lanes slow each other in a replay: the ``cpu+gpu`` entry of a measured profile's
contention table (``MeasuredSlowdowns``).

The executor computes a layer's experts on both lanes at once: the CPU lane's grouped call on its worker thread
while the replay's thread computes the accelerator lane's (dali_exec/executor/runtime.py). Side by side, the two
threads take the GIL from each other between their torch calls and share the caches and the memory. The
microbenchmark loops (``Microbench.contention``: one one-token expert timed with the caches flushed while the other
lane loops its own) do not see it: on the 2-core development VM they read 1.00-1.09 for the two lanes, while the
same lanes' calls in replays of two-lane systems took 1.03-1.25x their time with the lanes apart
(docs/validation.md, "Two lanes side by side").

So this pair is measured as a replay incurs it: short replays of a static split (``LaneSettings.system``, by default
``ktransformers-best``: each layer's resident half of the experts on the accelerator lane, the rest on the CPU lane,
nothing copied) on the first MoE layers of the host calibration's random workload (``host.workload_trace``), round
by round with the lanes side by side (as the executor runs them) and apart (``OffloadRuntime.lanes_apart``: each
layer's CPU-lane job waited for before the accelerator lane starts; the same calls on the same threads, one after the
other). Per round and lane, with ``d`` the lane's expert seconds side by side minus apart and ``O`` the seconds both
lanes were busy at once side by side: the simulator slows a lane to a rate ``r`` while the other is busy, so the lane
did ``O - d`` seconds of its alone work within ``O``, and ``r = (O - d) / O``. The slowdown is one over the median rate
of the rounds (at least 1).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dali_exec.calibrate.host import HostSettings, workload_trace
from dali_exec.executor.dense import DenseWeights
from dali_exec.executor.devices import Devices
from dali_exec.executor.problem import ReplayOptions, prepare_replay
from dali_exec.executor.replay import ExecOptions, Replay
from dali_exec.executor.store import HostExpertStore
from dali_sim.models.spec import ModelSpec
from dali_sim.sim.busy import busy_by_kind, lanes_overlap_seconds
from dali_sim.workload.profiling import ProfileSpec

#: the modes of a round: the lanes as the executor runs them, and one after the other
MODES = ("beside", "apart")
#: the activity kinds of each lane's expert calls (``dali_sim.sim.busy.activity_kind``)
LANE_KINDS = {"gpu": "gpu_expert", "cpu": "cpu_expert"}


@dataclass(frozen=True)
class LaneSettings:
    rounds: int = 5  # rounds of the two replays (the modes' order alternates from round to round)
    batch_size: int = 4  # (at most the workload's sequences)
    layers: int = 2  # MoE layers replayed (a slowdown per call: more layers only lengthen the replays)
    #: a preset whose placement splits every layer without costs or copies: its resident experts (half of each
    #: layer's, ``memory.cache_experts``) on the accelerator lane, the others on the CPU lane
    system: str = "ktransformers-best"

    def __post_init__(self) -> None:
        if min(self.rounds, self.batch_size, self.layers) < 1:
            raise ValueError(f"lane measurement: rounds, batch_size and layers must be >= 1, got {self.rounds}, "
                             f"{self.batch_size} and {self.layers}")


def lane_busy(result) -> dict[str, float]:
    """Seconds of each lane's expert calls in a replay's timeline, and (``"both"``) the seconds both were busy."""
    kinds = busy_by_kind(result.intervals)
    both = lanes_overlap_seconds(result.intervals)
    return {lane: kinds[kind][1] for lane, kind in LANE_KINDS.items()} | {"both": both}


def slowdowns(rounds: list[dict[str, dict[str, float]]]) -> dict[str, float] | str:
    """Each lane's slowdown from rounds of ``{"beside": lane_busy, "apart": lane_busy}`` (module docstring), or why
    the rounds cannot give one: the lanes were never busy at once in a round, or a lane's median rate is at or below
    0 (its calls grew by more than the time the lanes overlapped: the machine's noise, not contention)."""
    out = {}
    for lane in LANE_KINDS:
        rates = []
        for i, r in enumerate(rounds):
            both = r["beside"]["both"]
            if not both > 0:
                return f"the lanes were never busy at once in round {i}"
            rates.append((both - (r["beside"][lane] - r["apart"][lane])) / both)
        rate = statistics.median(rates)
        if not rate > 0:
            return (f"the {lane} lane's calls grew by more than the lanes overlapped (rates "
                    f"{', '.join(f'{x:.3f}' for x in rates)}): too noisy to measure")
        out[lane] = max(1.0, 1.0 / rate)
    return out


def measure_lane_slowdowns(model: ModelSpec, scale: float, dtype: str, devices: Devices, run: ExecOptions,
                           host: HostSettings = HostSettings(), s: LaneSettings = LaneSettings()) -> dict:
    """``{"slowdowns": {"cpu": ..., "gpu": ...} or why there are none (:func:`slowdowns`), "rounds": [{"beside":
    lane_busy, "apart": lane_busy}, ...], "batch_size": the batch replayed}`` for ``model`` (full size) replayed at
    ``scale`` in ``dtype`` on its first ``s.layers`` MoE layers of the workload of ``host`` (its sequences and
    tokens)."""
    with tempfile.TemporaryDirectory(prefix="dali-lanes-") as tmp:
        trace = workload_trace(model, host, Path(tmp))
        opts = ReplayOptions(scale=scale, layers=min(s.layers, model.num_moe_layers), dtype=dtype)
        half = {"memory": {"gpu_memory_gib": repr(float(1 << 20)), "cache_experts": str(trace.num_experts // 2)}}
        # (every sequence replayed: the split needs no profile, and a short workload still fills the batch)
        batch = min(s.batch_size, host.sequences)
        setup = prepare_replay(trace, s.system, opts, batch_size=batch, overrides=half,
                               profiling=ProfileSpec(share=0.0))
        store = HostExpertStore.random(setup.model, devices.dtype, host.seed, pin=devices.is_cuda)
        dense = DenseWeights(setup.model, devices.dtype, host.seed)
        replay = Replay(setup, devices, dataclasses.replace(run, progress=False), seed=host.seed, store=store,
                        dense=dense)
        rounds = []
        try:
            replay.run()  # warm-up (lazy initialisation, first calls of each shape)
            for i in range(s.rounds):
                measured = {}
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    replay.runtime.lanes_apart = mode == "apart"
                    measured[mode] = lane_busy(replay.run())
                rounds.append(measured)
        finally:
            replay.close()
    return {"slowdowns": slowdowns(rounds), "rounds": rounds, "batch_size": batch}


__all__ = ["LANE_KINDS", "LaneSettings", "MODES", "lane_busy", "measure_lane_slowdowns", "slowdowns"]
