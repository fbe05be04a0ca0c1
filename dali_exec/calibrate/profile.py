"""``calibrate()``: run the microbenchmarks for one model shape and write a measured hardware profile
(docs/hardware.md) that ``dali sim run --hardware PROFILE.json`` and ``dali exec run`` read.

Without CUDA the "gpu" tables are measured on the CPU device (the executor's accelerator there) and
the "h2d" table is a host copy: the profile says so in its device and link names and provenance.
"""

from __future__ import annotations

import datetime
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dali_exec.calibrate.host import HostSettings, measure_host_costs
from dali_exec.calibrate.lanes import LaneSettings, measure_lane_slowdowns
from dali_exec.calibrate.micro import Microbench, MicroSettings
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices, cpu_name, host_memory_bytes, lane_threads
from dali_exec.executor.doorbell import DEFAULT_SPIN_US, check_spin_us
from dali_exec.executor.problem import DTYPE_PRECISION, scale_model
from dali_exec.executor.replay import ExecOptions
from dali_sim import __version__
from dali_sim.hardware.measured import (
    CurveTable,
    DenseTable,
    MeasuredDevice,
    MeasuredProfile,
    ModelShape,
    PrefillTable,
    write_measured_profile,
)
from dali_sim.models.presets import get_model
from dali_sim.models.spec import ModelSpec

GIB = 1 << 30


@dataclass(frozen=True)
class CalibrationConfig:
    model_shape: str  # a preset name
    scale: float = 1.0  # as ``dali exec run --scale``: the profile is for the scaled shape
    dtype: str = "bf16"
    device: str | None = None  # cuda | cpu; None = CUDA if present
    cpu_threads: int | None = None  # CPU lane threads (default as `dali exec run`)
    accel_threads: int | None = None  # accelerator lane threads on the CPU device (default: the rest)
    spin_us: float = DEFAULT_SPIN_US  # the CPU lane's worker's spin (as `dali exec run --spin-us`)
    expert_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    dense_tokens: tuple[int, ...] = (1, 4, 16, 64)
    context_lens: tuple[int, ...] = (1, 256, 1024)
    # the dense tables in prefill layout: sequences x new tokens per sequence; both () = not measured
    prefill_sequences: tuple[int, ...] = (1, 4)
    prefill_queries: tuple[int, ...] = (1, 64, 256)
    transfer_sizes: tuple[float, ...] = (0.0625, 0.25, 1.0, 2.0)  # copies of these multiples of one expert's bytes
    settings: MicroSettings = field(default_factory=MicroSettings)
    name: str | None = None
    contention: bool = True  # measure how the lanes slow each other (MeasuredProfile.contention)
    #: the compute lanes side by side (the ``cpu+gpu`` entry) measured in replays (``calibrate.lanes``) on the host
    #: measurement's workload; None = by the loops, as the combinations with the copy lane are
    lanes: LaneSettings | None = field(default_factory=LaneSettings)
    host: HostSettings | None = field(default_factory=HostSettings)  # the executor's host costs; None = skip

    def __post_init__(self) -> None:
        check_spin_us(self.spin_us)
        if self.contention and 1e-6 * self.spin_us >= self.settings.wake_gap_s:
            raise ValueError(f"spin_us {self.spin_us:g} must be shorter than the wake measurement's gap "
                             f"({1e6 * self.settings.wake_gap_s:g} us): lane_wake is what waking a sleeping worker "
                             "costs")
        for key in ("expert_tokens", "dense_tokens", "context_lens", "transfer_sizes"):
            v = getattr(self, key)
            if len(v) < (1 if key == "context_lens" else 2) or any(b <= a for a, b in zip(v, v[1:])) or min(v) <= 0:
                raise ValueError(f"{key} must be strictly increasing positive numbers (at least 2; context_lens: "
                                 f"at least 1), got {list(v)}")
        seqs, queries = self.prefill_sequences, self.prefill_queries
        if seqs or queries:
            for key, v, least in (("prefill_sequences", seqs, 2), ("prefill_queries", queries, 1)):
                if len(v) < least or any(b <= a for a, b in zip(v, v[1:])) or min(v) <= 0:
                    raise ValueError(f"{key} must be strictly increasing positive integers (at least {least}), or "
                                     f"both prefill axes empty (no prefill tables), got {list(v)}")

    def full_model(self) -> ModelSpec:
        """The full-size model the calibrated shape is scaled from."""
        return get_model(self.model_shape)

    def model(self) -> ModelSpec:
        return scale_model(self.full_model(), self.scale, None, DTYPE_PRECISION[self.dtype])


def median_of_rounds(rounds: list):
    """Point by point, the median of one table's rounds (lists of seconds, nested lists, or a tuple of such
    parts, e.g. an expert table's (shares, fixed part))."""
    if isinstance(rounds[0], tuple):
        return tuple(median_of_rounds([r[i] for r in rounds]) for i in range(len(rounds[0])))
    m = np.median(np.asarray(rounds, dtype=float), axis=0)
    return m.tolist() if m.ndim else float(m)


def _lane_wakes(bench: Microbench) -> dict[str, float]:
    """``lane_wake``: a hand-over that wakes the sleeping CPU-lane worker (its spin over), and where the worker
    spins, one that finds it still spinning (``*_spinning``)."""
    out = {"cpu": bench.wake_seconds("cpu"), "gpu": bench.beside_wake_seconds(), "host": bench.handoff_seconds()}
    if bench.worker.spin_s > 0:
        out |= {"cpu_spinning": bench.wake_seconds("cpu", spinning=True),
                "gpu_spinning": bench.beside_wake_seconds(spinning=True),
                "host_spinning": bench.handoff_seconds(spinning=True)}
    return out


def calibrate(cfg: CalibrationConfig, *, command: str = "(python API)", progress: bool = False) -> MeasuredProfile:
    """Measure every table for ``cfg.model_shape`` (scaled) on this machine."""
    model = cfg.model()
    devices = Devices.create(cfg.device, cfg.dtype)
    cpu_threads, accel_threads = lane_threads(devices.is_cuda, cfg.cpu_threads, cfg.accel_threads)
    worker = CpuWorker(cpu_threads, 1e-6 * cfg.spin_us)
    prev = torch.get_num_threads()
    if accel_threads is not None:
        torch.set_num_threads(accel_threads)
    main_threads = torch.get_num_threads()  # (the replay's thread: whether the CPU lane's work may run inline)
    bench = Microbench(model, devices, worker, cfg.settings, accel_threads)
    xb = model.expert_bytes
    elem = torch.empty((), dtype=devices.dtype).element_size()
    sizes = sorted({max(elem, int(f * xb) // elem * elem) for f in cfg.transfer_sizes})
    toks, dtoks, ctxs = list(cfg.expert_tokens), list(cfg.dense_tokens), list(cfg.context_lens)
    tables = [("experts", lambda: bench.lanes_expert_seconds(("gpu", "cpu"), toks)),  # (both lanes interleaved)
              ("h2d", lambda: bench.transfer_seconds(sizes)),
              ("gpu_dense", lambda: bench.dense_seconds("gpu", dtoks, ctxs)),
              ("cpu_dense", lambda: bench.dense_seconds("cpu", dtoks, ctxs))]
    if model.num_dense_layers:
        tables += [("gpu_dense_block", lambda: bench.dense_seconds("gpu", dtoks, ctxs, moe=False)),
                   ("cpu_dense_block", lambda: bench.dense_seconds("cpu", dtoks, ctxs, moe=False))]
    pseqs, pqs = list(cfg.prefill_sequences), list(cfg.prefill_queries)
    if pqs:  # the same parts in prefill layout
        for moe in (True, False) if model.num_dense_layers else (True,):
            for lane in ("gpu", "cpu"):
                key = f"{lane}_dense{'' if moe else '_block'}_prefill"
                tables.append((key, lambda lane=lane, moe=moe: bench.prefill_seconds(lane, pseqs, pqs, moe)))
    act_sizes = sorted({max(elem, n * model.hidden_size * elem) for n in (1, *dtoks)})
    if devices.is_cuda:
        tables.append(("d2h", lambda: bench.d2h_seconds(act_sizes)))
    rounds = cfg.settings.table_rounds
    jobs = [(f"{key}#{r}", job) for r in range(rounds) for key, job in tables]  # round by round
    run = ExecOptions(device=str(devices.accel), cpu_threads=cpu_threads, accel_threads=accel_threads,
                      spin_us=cfg.spin_us)
    if cfg.contention:
        jobs.append(("contention", bench.contention))
        if cfg.lanes is not None:
            jobs.append(("lanes", lambda: measure_lane_slowdowns(cfg.full_model(), cfg.scale, cfg.dtype, devices, run,
                                                                 cfg.host or HostSettings(), cfg.lanes)))
        jobs.append(("lane_wake", lambda: _lane_wakes(bench)))
    if cfg.host is not None:
        # (after lane_wake, whose hand-over the simulator charges apart: the fit takes it out)
        jobs.append(("host", lambda: measure_host_costs(cfg.full_model(), cfg.scale, cfg.dtype, devices, run, cfg.host,
                                                        handoff_s=(results.get("lane_wake") or {}).get("host", 0.0))))
    results = {}
    spent: dict[str, float] = {}  # wall seconds per table, its rounds together (where a calibration's time goes)
    try:
        for key, job in tqdm(jobs, desc=f"calibrate {model.name}", unit="table", disable=not progress, leave=False):
            t0 = time.perf_counter()
            results[key] = job()
            table = key.split("#")[0]
            spent[table] = spent.get(table, 0.0) + time.perf_counter() - t0
    finally:
        torch.set_num_threads(prev)
        worker.close()
    # each lane's expert table and fixed part round by round (the profile keeps their medians): what a validation
    # simulates once per round, to show how far the calibration's own rounds move a prediction
    expert_rounds = {lane: {"shares": [results[f"experts#{r}"][j][0] for r in range(rounds)],
                            "fixed": [results[f"experts#{r}"][j][1] for r in range(rounds)]}
                     for j, lane in enumerate(("gpu", "cpu"))}
    for key, _ in tables:
        results[key] = median_of_rounds([results.pop(f"{key}#{r}") for r in range(rounds)])
    lanes = results.pop("lanes", None)
    if lanes is not None:  # the compute lanes side by side as a replay runs them, instead of the loops' reading
        lanes["loops_cpu+gpu"] = results["contention"]["cpu+gpu"]
        if isinstance(lanes["slowdowns"], dict):
            results["contention"] = results["contention"] | {"cpu+gpu": lanes["slowdowns"]}
        else:  # (kept from the loops, and said: in the provenance and here)
            warnings.warn(f"calibration: the lanes side by side were not measured ({lanes['slowdowns']}); cpu+gpu "
                          "contention is the loops' reading", RuntimeWarning, stacklevel=2)
    (gpu_expert, gpu_fixed), (cpu_expert, cpu_fixed) = results.pop("experts")
    tables = {
        "gpu_expert": CurveTable(tuple(map(float, toks)), tuple(gpu_expert)),
        "cpu_expert": CurveTable(tuple(map(float, toks)), tuple(cpu_expert)),
        "h2d": CurveTable(tuple(map(float, sizes)), tuple(results["h2d"])),
    }
    if "d2h" in results:
        tables["d2h"] = CurveTable(tuple(map(float, act_sizes)), tuple(results["d2h"]))
    for key in ("gpu_dense", "cpu_dense", "gpu_dense_block", "cpu_dense_block"):
        if key in results:
            tables[key] = DenseTable(tuple(map(float, dtoks)), tuple(map(float, ctxs)),
                                     tuple(tuple(r) for r in results[key]))
        if f"{key}_prefill" in results:
            tables[f"{key}_prefill"] = PrefillTable(tuple(map(float, pseqs)), tuple(map(float, pqs)),
                                                    tuple(tuple(r) for r in results[f"{key}_prefill"]))
    accel = devices.accel_name()
    cuda = devices.is_cuda
    link = (f"host-to-device copy to {accel} (pinned memory, copy stream)" if cuda
            else "host memory copy (no CUDA: the accelerator is the CPU device, there is no PCIe transfer)")
    provenance = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"dali": __version__, "torch": torch.__version__, "python": platform.python_version(),
                     **({"cuda": str(torch.version.cuda)} if cuda else {})},
        "devices": {"gpu": accel, "cpu": cpu_name(), "gpu_is_cpu_device": not cuda},
        "model_shape": cfg.model_shape, "scale": cfg.scale, "dtype": cfg.dtype,
        "seconds": {k: round(v, 3) for k, v in spent.items()},
        "threads": {"cpu_lane": cpu_threads, "accelerator_lane": accel_threads, "main_thread": main_threads},
        # how long the CPU lane's worker spins for its next job before it sleeps (in effect: 0 where it cannot spin):
        # the simulator charges lane_wake to hand-overs that find it asleep, lane_wake.*_spinning to the others
        # (dali_sim.hardware.cost.executor_on)
        "waiting": {"spin_s": worker.spin_s},
        "experts": f"each expert's share of a grouped call: the slope of a repeated-medians (Siegel) line through calls of "
                   f"{', '.join(map(str, bench.group_sizes()))} experts; its intercept is the lane's fixed part "
                   "per layer (lanes); the two lanes' calls interleaved, point by point",
        "expert_rounds": expert_rounds,  # (seconds; the tables and lanes keep their medians)
        "statistic": f"per point the median over {cfg.settings.table_rounds} rounds (every table in turn) of the "
                     f"median of {cfg.settings.repeats} runs after {cfg.settings.warmup} warm-up runs"
                     + (", caches flushed before each run" if cfg.settings.cold else ""),
        "contention": (f"each lane with a {cfg.settings.contention_tokens}-token expert (copy lane: one expert's "
                       "copy) while the other lanes of each combination loop theirs"
                       + ("; cpu+gpu: the compute lanes' expert calls side by side against apart in replays of "
                          f"{cfg.lanes.system} (half of each layer's experts resident) at batch {lanes['batch_size']} "
                          f"on the host measurement's random workload, {cfg.lanes.rounds} rounds "
                          "(dali_exec/calibrate/lanes.py; lanes_beside, which says why where the loops' reading is "
                          "kept)" if lanes is not None else "")
                       ) if cfg.contention else "not measured",
        # the slowdowns (or why there are none), each round's seconds of each lane's expert calls and of both at once,
        # and what the loops read for the pair
        **({"lanes_beside": lanes} if lanes is not None else {}),
        "host": "dali_exec/calibrate/host.py (replays of cpu-only, all-resident gpu-static and serial gpu-lru on a "
                "random workload; the decisions per layer visit in a replay of each preset)" if cfg.host is not None
                else "not measured",
        "dense_part": "dali_exec.executor.dense.DenseBlock (docs/executor.md), decode layout"
                      + (", and prefill layout (*_prefill)" if pqs else ""),
        "lane_wake": (f"cpu: a call of 2 one-token experts on the CPU lane after {cfg.settings.wake_gap_s * 1e3:g} ms "
                      "of sleep minus the same call straight after the previous one; gpu: the same call on the "
                      "accelerator lane as the sleeping CPU lane's worker is handed one, minus it beside the "
                      f"sleeping worker; each the median over {cfg.settings.contention_rounds} rounds; host: the "
                      "calling thread's hand-over of a job to the worker asleep as long, the median of "
                      f"{cfg.settings.contention_rounds * cfg.settings.repeats} hand-overs; *_spinning: the same "
                      f"with the worker still spinning for its next job, its last one {worker.spin_s * 5e5:g} us "
                      "before (half its spin)")
        if cfg.contention else "not measured",
    }
    gpu_name = accel if cuda else f"{accel} (measured as the executor's accelerator)"
    return MeasuredProfile(
        name=cfg.name or f"measured-{model.name}-{'cuda' if cuda else 'cpu'}",
        description=f"calibrated by dali exec calibrate for {model.name} ({cfg.dtype}) on {accel}",
        gpu=MeasuredDevice(gpu_name, devices.accel_memory_bytes() / GIB),
        cpu=MeasuredDevice(f"{cpu_name()}, {cpu_threads} threads", host_memory_bytes() / GIB),
        link_name=link, model=ModelShape.of(model), provenance=provenance, contention=results.get("contention"),
        host=results.get("host"), lanes={"gpu": gpu_fixed, "cpu": cpu_fixed},
        lane_wake=results.get("lane_wake"), **tables,
    )


def calibrate_to(path: str | Path, cfg: CalibrationConfig, *, command: str = "(python API)",
                 progress: bool = False) -> Path:
    """:func:`calibrate` and write the profile atomically (``write_measured_profile``)."""
    return write_measured_profile(path, calibrate(cfg, command=command, progress=progress))
