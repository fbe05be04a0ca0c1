"""``validate()``: run the executor and the simulator on identical inputs and compare them (docs/validation.md).

Per system: the same reduced trace, the same resolved system (hence the same policies, parameters and
scaled memory plan), the same batch size, chunking and seed, via :func:`prepare_replay`; the executor
replays it on this machine (:class:`Replay`), the simulator times the same plans with a hardware
profile measured on this machine for the replay model's shape (calibrated first unless given). The
host weights are drawn once and shared by every system's replay; each system gets a short untimed
warm-up replay first (the first batch's prefill and two decode steps). With ``replays`` > 1 every
system is replayed that many times, round by round over the systems (so a slow phase of the machine
falls on all of them), and is compared by the median: its total the median of the replays' totals, each
step the median of that step's times.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from dali_exec.calibrate import CalibrationConfig, MicroSettings, calibrate
from dali_exec.calibrate.host import HostSettings
from dali_exec.calibrate.micro import llc_bytes
from dali_exec.executor.dense import DenseWeights
from dali_exec.executor.devices import Devices, cpu_name
from dali_exec.executor.doorbell import spin_in_effect
from dali_exec.executor.problem import ReplayOptions, ReplaySetup, prepare_replay
from dali_exec.executor.replay import ExecOptions, Replay
from dali_exec.executor.store import HostExpertStore
from dali_exec.validate.compare import Thresholds, compare, lanes_overlap_seconds, rank_agreement, verdict
from dali_exec.validate.drift import ProbeReading, SpeedProbe, drift_warning, overlap_warning, spread_warnings
from dali_exec.validate.rounds import round_profiles, rounds_warning
from dali_sim import __version__
from dali_sim.hardware.measured import MeasuredProfile, ModelShape, prefill_layout, write_measured_profile
from dali_sim.hardware.profile import load_profile
from dali_sim.models.spec import ModelSpec
from dali_sim.registry import UnknownNameError
from dali_sim.runtime.future import write_future
from dali_sim.sim.simulate import DEFAULT_HARDWARE, simulate
from dali_sim.sim.timeline import write_timeline
from dali_sim.trace.reader import Trace, read_trace
from dali_sim.trace.schema import TraceError
from dali_sim.workload.builder import Workload
from dali_sim.workload.profiling import ProfileSpec

#: calibration settings of a validation (fewer repeats than `dali exec calibrate`'s default: the points
#: are those the workload needs, see :func:`calibration_points`)
VALIDATION_MICRO = MicroSettings(repeats=3, warmup=1)

#: below this many last-level caches of expert weights read per step, a replay's expert calls can find their
#: weights in the cache, which the calibration's calls (caches flushed) never do: :func:`cache_caution`
CACHE_CAUTION_FACTOR = 2


@dataclass(frozen=True)
class ValidationConfig:
    """What to compare and how (CLI: ``dali exec validate``)."""

    systems: tuple[str, ...]
    replay: ReplayOptions = ReplayOptions()
    run: ExecOptions = ExecOptions()
    profile: str | None = None  # a profile measured on this machine for the replay shape; None = calibrate
    batch_size: int = 1
    prefill_chunk: int = 0
    seed: int = 0
    gpu_memory_gib: float | None = None  # the full-size model's budget; None = the default profile's GPU (24 GiB)
    #: section -> key -> value for every system, or system name -> such overrides (per system, e.g. from
    #: `--set SYSTEM:section.key=value`); the budget (``memory.gpu_memory_gib``) is added unless given
    overrides: Mapping[str, Mapping[str, Any]] | None = None
    warmup: bool = True  # an untimed warm-up replay before each system's measured one
    replays: int = 1  # measured replays per system, round by round over the systems; compared by their medians
    calibration: MicroSettings = VALIDATION_MICRO
    time_budget_s: float | None = None  # start no further system once this is likely to be exceeded
    timelines: bool = True
    plot: bool = True
    thresholds: Thresholds = Thresholds()  # when the validation fails (docs/validation.md, "Verdict")
    #: the profiling input of frequency choices (as `dali sim`'s); None = the first 25% of the sequences
    profiling: ProfileSpec | None = None
    #: time a probe (:class:`~dali_exec.validate.drift.SpeedProbe`) before the calibration (or the first replay)
    #: and after the last replay; a warning when its speed or its lanes' overlap moved by more than ``max_drift``,
    #: or when a system's replays spread by more than that
    drift_probe: bool = True
    max_drift: float = 0.10

    def __post_init__(self) -> None:
        if not self.systems:
            raise ValueError("give at least one system")
        if len(set(self.systems)) != len(self.systems):
            raise ValueError(f"systems must be distinct, got {', '.join(self.systems)}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if isinstance(self.replays, bool) or not isinstance(self.replays, int) or self.replays < 1:
            raise ValueError(f"replays must be an integer >= 1, got {self.replays!r}")
        if not self.max_drift > 0:
            raise ValueError(f"max_drift must be > 0, got {self.max_drift}")


@dataclass
class ValidationReport:
    """One comparison per system (:func:`dali_exec.validate.compare.compare`), plus the settings."""

    settings: dict[str, Any]
    systems: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)  # system, error (the others still ran)
    ranking: dict[str, Any] = field(default_factory=dict)
    verdict: dict[str, Any] = field(default_factory=dict)  # ok, failures, thresholds
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # cautions that do not change the verdict

    @property
    def ok(self) -> bool:
        """Every system ran and the verdict holds."""
        return bool(self.verdict.get("ok")) and not self.failed

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [s["row"] for s in self.systems]


def step_expert_bytes(w: Workload, expert_bytes: int) -> float:
    """Bytes of the distinct experts one step of ``w`` reads, the median over its steps: how much other expert
    data passes through the cache between two reads of an expert that consecutive steps use."""
    ptr, L = w.actual.ptr, w.num_layers
    per_step = ptr[L::L][:w.num_steps] - ptr[:-1:L][:w.num_steps]
    return float(np.median(per_step)) * expert_bytes


def cache_caution(step_bytes: float, cache_bytes: int) -> str | None:
    """A warning when the expert weights a replay's step reads (``step_bytes``, :func:`step_expert_bytes`) are
    less than :data:`CACHE_CAUTION_FACTOR` times the last-level cache that serves them (``cache_bytes``), else
    None. The calibration times each expert call after flushing that cache; a replay's expert reused by the
    next step comes back after one step's other weights, and part of it can still be in the cache. Measured
    on a host with a 480 MiB L3 (docs/validation.md, "A run on another host"): one-token DeepSeek-V2-Lite
    calls 1.42x faster warm than flushed, and replays whose steps read 117 and 468 MiB simulated 33-50% slow,
    one whose steps read 945 MiB (Mixtral) within 15%; on a host with 32 MiB, 117 MiB per step showed no
    common error."""
    if step_bytes >= CACHE_CAUTION_FACTOR * cache_bytes:
        return None
    return (f"the expert weights a replay step reads ({step_bytes / 2**20:,.0f} MiB, the median) are less than "
            f"{CACHE_CAUTION_FACTOR}x the host's last-level cache ({cache_bytes / 2**20:,.0f} MiB): experts reused by "
            "the next step can be read from the cache, which the calibration's calls (caches flushed) are not; measured "
            "times may be shorter than simulated (more layers, --layers, or a larger --scale make a step read more)")


def _pow2_points(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= ``top`` (at least two points)."""
    pts, p = [1], 2
    while pts[-1] < max(top, 2):
        pts.append(p)
        p *= 2
    return tuple(pts)


def calibration_points(w: Workload) -> dict[str, tuple[int, ...]]:
    """The calibration axes a workload needs, so the simulator interpolates instead of extrapolating:
    expert tokens 1, 2, 4, ... past the largest expert workload; for the steps that read the decode-layout
    dense tables (decode steps, and prefill chunks after cached tokens), dense tokens likewise past the
    largest step and context lengths 1, half and all of the largest mean context of a step; for prefill
    steps (:func:`prefill_layout`), sequences 1, 2, 4, ... past the most of a step and new tokens per
    sequence 1, half and all of the most (both empty without prefill steps)."""
    shared, seqs, queries, cached = prefill_layout(w.step_tokens, w.step_context, w.step_kv)
    decode = ~shared | (cached > 0)
    tokens, context = w.step_tokens[decode], w.step_context[decode]
    ctx = max(1, int(math.ceil(float(context.max())))) if decode.any() else 1
    points = {"expert_tokens": _pow2_points(int(w.actual.count.max())),
              "dense_tokens": _pow2_points(int(tokens.max()) if decode.any() else 1),
              "context_lens": tuple(sorted({1, max(1, ctx // 2), ctx})),
              "prefill_sequences": (), "prefill_queries": ()}
    if shared.any():
        q = int(math.ceil(float(queries[shared].max()) - 1e-9))
        points["prefill_sequences"] = _pow2_points(int(math.ceil(float(seqs[shared].max()) - 1e-9)))
        points["prefill_queries"] = tuple(sorted({1, max(1, q // 2), q}))
    return points


@dataclass(frozen=True)
class _SpecCalibration(CalibrationConfig):
    """A calibration of a given model spec (a trace's own model need not be a preset)."""

    spec: ModelSpec | None = None

    def full_model(self) -> ModelSpec:
        return self.spec


def check_profile(profile: Any, model: ModelSpec, devices: Devices, threads: tuple[int, int | None],
                  dtype: str, path: str, spin_s: float = 0.0) -> None:
    """A validation's profile must be measured (not analytic), for the replay model's shape, on this
    machine's devices, with the replay's thread counts, dtype and CPU-lane worker's spin in effect (``spin_s``;
    a profile from before the worker could spin was measured with none); raise naming every mismatch."""
    if not isinstance(profile, MeasuredProfile):
        raise ValueError(f"--profile {path}: an analytic profile; a validation needs a profile measured on this "
                         "machine (omit --profile to calibrate first, or use `dali exec calibrate`)")
    want, have = ModelShape.of(model), profile.model
    wrong = [f"model.{f} ({getattr(have, f)!r} there, {getattr(want, f)!r} here)"
             for f in ModelShape.__dataclass_fields__ if f != "model" and getattr(want, f) != getattr(have, f)]
    prov = profile.provenance
    if wrong and "scale" in prov:
        wrong.insert(0, f"calibrated for {prov.get('model_shape')} at scale {prov['scale']:g}, the replay is "
                        f"{model.name}")
    dev, thr = prov.get("devices", {}), prov.get("threads", {})
    # (the replay's thread: the accelerator lane's threads on the CPU device, else unchanged; profiles from before
    # main_thread was recorded are not checked for it)
    main = threads[1] if threads[1] is not None else torch.get_num_threads()
    for key, value, mine in (("devices.gpu", dev.get("gpu"), devices.accel_name()),
                             ("devices.cpu", dev.get("cpu"), cpu_name()),
                             ("threads.cpu_lane", thr.get("cpu_lane"), threads[0]),
                             ("threads.accelerator_lane", thr.get("accelerator_lane"), threads[1]),
                             ("threads.main_thread", thr.get("main_thread", main), main),
                             ("dtype", prov.get("dtype"), dtype),
                             ("waiting.spin_s", prov.get("waiting", {}).get("spin_s", 0.0), spin_s)):
        if value != mine:
            wrong.append(f"{key} ({value!r} there, {mine!r} here)")
    if wrong:
        raise ValueError(f"--profile {path}: not measured for this replay on this machine: {'; '.join(wrong)}. "
                         f"Calibrate with the replay's --scale, --dtype, thread counts and --spin-us (omit --profile "
                         "to do so first)")


OVERRIDE_SECTIONS = ("placement", "cache", "prefetch", "memory", "system")


def _budget_overrides(cfg: ValidationConfig, system: str) -> dict[str, dict[str, str]]:
    given = cfg.overrides or {}
    if given and set(given).isdisjoint(OVERRIDE_SECTIONS):  # keyed by system
        given = given.get(system, {})
    over = {k: dict(v) for k, v in given.items()}
    mem = over.setdefault("memory", {})
    if "gpu_memory_gib" not in mem:
        gib = cfg.gpu_memory_gib if cfg.gpu_memory_gib is not None else \
            load_profile(DEFAULT_HARDWARE).gpu_memory_bytes / 2**30
        mem["gpu_memory_gib"] = repr(float(gib))
    return over


def _warmup_options(setup: ReplaySetup, opts: ReplayOptions) -> ReplayOptions:
    """The first batch's sequences cut to their shortest prompt + 2 tokens (its prefill and two decode steps)."""
    seqs = setup.workload.sequences
    first = seqs[seqs["batch"] == 0]
    tokens = int(first["prompt_tokens_traced"].min()) + 2
    if opts.max_tokens is not None:
        tokens = min(tokens, opts.max_tokens)
    return dataclasses.replace(opts, sequences=len(first), max_tokens=tokens)


def _simulate(setup: ReplaySetup, profile: str, cfg: ValidationConfig, tmp: Path, timeline: bool = True):
    w = setup.workload.config
    kw = {}
    s = setup.sysconf
    if s.needs_future:  # bounds that read next-use times (`dali trace enrich`) get them for the reduced trace
        kw["future"] = write_future(setup.trace, w, out=tmp / f"{s.name}.future.parquet", share=0.0)
    # the executor's evaluated (reduced) trace with its profiling input: the simulator sees what it replayed
    return simulate(setup.trace, setup.sysconf, hardware=profile, batch_size=w.batch_size,
                    prefill_chunk=w.prefill_chunk, seed=cfg.seed, timeline=timeline, profiling=setup.profiled, **kw)


def _execute(trace: Trace, system: str, opts: ReplayOptions, run: ExecOptions, kw: dict, devices: Devices,
             store: HostExpertStore, dense: DenseWeights, profile_path: str, cfg: ValidationConfig):
    """Warm up and execute one system once: (setup, executed result)."""
    setup = prepare_replay(trace, system, opts, hardware=profile_path, **kw)
    if cfg.warmup:
        wsetup = prepare_replay(trace, system, _warmup_options(setup, opts), hardware=profile_path, **kw)
        warm = Replay(wsetup, devices, dataclasses.replace(run, progress=False), seed=cfg.seed, store=store,
                      dense=dense)
        try:
            warm.run()
        finally:
            warm.close()
        del warm
    replay = Replay(setup, devices, run, seed=cfg.seed, store=store, dense=dense)
    try:
        executed = replay.run()
        len(executed.intervals)  # resolved now: unresolved, they hold the copies' tickets, hence the run's slots
    finally:
        replay.close()
    del replay  # its accelerator slots go before the next system's are allocated
    return setup, executed


def _median_run(runs: list) -> tuple[Any, np.ndarray | None]:
    """Of one system's replays: the one with the median total (the lower middle of an even number), and with
    more than one the per-step medians of the step times (None with one)."""
    totals = [float(r.summary["makespan_s"]) for r in runs]
    median = runs[sorted(range(len(runs)), key=totals.__getitem__)[(len(runs) - 1) // 2]]
    if len(runs) == 1:
        return median, None
    return median, np.median(np.stack([r.per_step["time_s"].to_numpy() for r in runs]), axis=0)


def validate(trace: Trace | str | Path, cfg: ValidationConfig, out: str | Path, *,
             command: str = "(python API)", log: Callable[[str], None] | None = None,
             progress: bool = False) -> ValidationReport:
    """Compare executor and simulator for every system of ``cfg``; write the report files into ``out``
    (docs/validation.md) after each system, the plot at the end."""
    from dali_exec.validate.report import write_plot, write_tables

    say = log or (lambda _msg: None)
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not isinstance(trace, Trace):
        trace = read_trace(trace)
    opts, run = cfg.replay, dataclasses.replace(cfg.run, progress=progress)
    kw = {system: dict(batch_size=cfg.batch_size, prefill_chunk=cfg.prefill_chunk, profiling=cfg.profiling,
                       overrides=_budget_overrides(cfg, system)) for system in cfg.systems}
    # every system is prepared first, so a bad name, a missing lookahead column or an impossible budget
    # fails before anything is measured (the profile does not change the plans' memory: the budget is set)
    prepared = []
    for system in cfg.systems:
        try:
            prepared.append(prepare_replay(trace, system, opts, hardware=DEFAULT_HARDWARE, **kw[system]))
        except (ValueError, KeyError, TraceError, UnknownNameError) as exc:
            raise ValueError(f"system {system}: {exc}") from None
    setup0 = prepared[0]
    devices = Devices.create(run.device, opts.dtype)
    threads = run.threads(devices)
    model = setup0.model
    probe_before = _probe(model, devices) if cfg.drift_probe else None

    if cfg.profile is None:
        points = calibration_points(setup0.workload)
        say(f"calibrating {model.name} on {devices.accel_name()} (expert tokens {list(points['expert_tokens'])}, "
            f"dense tokens {list(points['dense_tokens'])}, contexts {list(points['context_lens'])}, prefill "
            f"sequences {list(points['prefill_sequences'])} x tokens {list(points['prefill_queries'])})")
        cal = _SpecCalibration(opts.model_shape or setup0.full_model.name, scale=opts.scale, dtype=opts.dtype,
                               device=str(devices.accel), cpu_threads=threads[0], accel_threads=threads[1],
                               spin_us=run.spin_us, settings=cfg.calibration, name=f"validation-{model.name}",
                               spec=setup0.full_model,
                               host=HostSettings(systems=tuple(cfg.systems)), **points)
        measured = calibrate(cal, command=command)
        spent = measured.provenance["seconds"]
        say(f"calibrated in {sum(spent.values()):.0f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in spent.items()) + ")")
        profile_path = str(write_measured_profile(out / "profile.json", measured))
    else:
        profile_path = str(cfg.profile)
    profile = load_profile(profile_path)
    check_profile(profile, model, devices, threads, opts.dtype, profile_path, spin_s=spin_in_effect(run.spin_us))

    say(f"drawing the host weights of {model.name} ({model.num_moe_layers} x {model.num_experts} experts, "
        f"{model.expert_bytes * model.num_moe_layers * model.num_experts / 2**30:.2f} GiB)")
    t_draw = time.perf_counter()
    store = HostExpertStore.random(model, devices.dtype, cfg.seed, pin=devices.is_cuda, progress=progress)
    say(f"drew them in {time.perf_counter() - t_draw:.1f} s")
    dense = DenseWeights(model, devices.dtype, cfg.seed)  # (drawn by the first replay on each device)
    report = ValidationReport(settings={
        "command": command, "dali_version": __version__,
        "trace": str(trace.path) if trace.path else None, "full_model": setup0.full_model.name,
        "replay_model": model.name, "scale": opts.scale, "layers": model.num_moe_layers,
        "sequences": opts.sequences, "max_tokens": opts.max_tokens, "dtype": opts.dtype,
        "batch_size": cfg.batch_size, "prefill_chunk": cfg.prefill_chunk, "seed": cfg.seed,
        "gpu_memory_gib": float(kw[cfg.systems[0]]["overrides"]["memory"]["gpu_memory_gib"]),
        "replay_budget_gib": setup0.memory.budget_bytes / 2**30,
        "steps": setup0.workload.num_steps, "tokens": int(setup0.workload.step_tokens.sum()),
        "device": str(devices.accel), "device_name": devices.accel_name(), "host": cpu_name(),
        "cpu_threads": threads[0], "accel_threads": threads[1], "profile": profile_path,
        "profiling": setup0.profiled.record,
        "calibrated_here": cfg.profile is None, "warmup": cfg.warmup, "replays": cfg.replays,
        "systems": list(cfg.systems),
        "host_expert_bytes": store.nbytes, "step_expert_bytes": step_expert_bytes(setup0.workload, model.expert_bytes),
        "host_llc_bytes": llc_bytes(),
    })
    if (caution := cache_caution(report.settings["step_expert_bytes"], report.settings["host_llc_bytes"])) is not None:
        report.warnings.append(caution)
        say(f"WARNING: {caution}")
    longest = 0.0  # the slowest replay of a system so far (warm-up, replay and, in the first round, simulation)
    runs: dict[str, list] = {}  # system -> its executed results, round by round
    simulated: dict[str, Any] = {}
    by_round: dict[str, list[float]] = {}  # system -> its simulated totals with each calibration round's tables
    with tempfile.TemporaryDirectory(prefix="dali-validate-") as tmpdir:
        variants = round_profiles(profile, Path(tmpdir))
        for round_ in range(cfg.replays):
            systems = [s for s in cfg.systems if s in runs] if round_ else list(cfg.systems)
            elapsed = time.perf_counter() - t_start
            if round_ and cfg.time_budget_s is not None and elapsed + longest * len(systems) > cfg.time_budget_s:
                report.settings["replays_done"] = round_
                say(f"replay round {round_ + 1} of {cfg.replays} not started: time budget {cfg.time_budget_s:g} s, "
                    f"{elapsed:.0f} s used")
                break
            for system in systems:
                elapsed = time.perf_counter() - t_start
                if not round_ and cfg.time_budget_s is not None and runs and elapsed + longest > cfg.time_budget_s:
                    why = (f"time budget {cfg.time_budget_s:g} s: {elapsed:.0f} s used, the slowest system took "
                           f"{longest:.0f} s")
                    report.skipped.append({"system": system, "reason": why})
                    say(f"{system}: skipped ({report.skipped[-1]['reason']})")
                    continue
                t0 = time.perf_counter()
                try:
                    setup, executed = _execute(trace, system, opts, run, kw[system], devices, store, dense,
                                               profile_path, cfg)
                    if not round_:
                        simulated[system] = _simulate(setup, profile_path, cfg, Path(tmpdir))
                        by_round[system] = [float(_simulate(setup, v, cfg, Path(tmpdir), timeline=False)
                                                  .summary["makespan_s"]) for v in variants]
                except Exception as exc:  # one system's failure must not lose the others (KeyboardInterrupt passes)
                    runs.pop(system, None)
                    report.failed.append({"system": system, "error": f"{type(exc).__name__}: {exc}"})
                    say(f"{system}: FAILED ({report.failed[-1]['error']})")
                    _report_systems(report, cfg, runs, simulated, by_round, command)
                    write_tables(report, out)
                    continue
                executed.manifest["command"] = command
                runs.setdefault(system, []).append(executed)
                longest = max(longest, time.perf_counter() - t0)
                r = compare(executed, simulated[system])["row"]
                say(f"{system}{f' (replay {round_ + 1} of {cfg.replays})' if cfg.replays > 1 else ''}: executed "
                    f"{r['exec_s']:.3f} s, simulated {r['sim_s']:.3f} s ({100 * r['total_rel_err']:+.1f}%), per-step "
                    f"|error| median {100 * r['step_abs_err_median']:.1f}%, counters "
                    f"{'exact' if r['exact'] else 'DIFFER: ' + ', '.join(r['counters_differ'])}")
                _report_systems(report, cfg, runs, simulated, by_round, command)
                report.settings["elapsed_s"] = time.perf_counter() - t_start
                write_tables(report, out)
        else:
            report.settings["replays_done"] = cfg.replays
        if cfg.timelines:
            for system, system_runs in runs.items():
                for which, res in (("exec", _median_run(system_runs)[0]), ("sim", simulated[system])):
                    path = write_timeline(out / f"{system}.{which}.timeline.json", res.intervals,
                                          f"dali {which} {system} on {model.name}")
                    report.files.append(path.name)
    late = []
    if probe_before is not None:
        after = _probe(model, devices)
        report.settings.update(probe_before_s=probe_before.seconds, probe_after_s=after.seconds,
                               machine_drift=after.seconds / probe_before.seconds - 1,
                               overlap_before=probe_before.overlap, overlap_after=after.overlap)
        both = [system for system, system_runs in runs.items()  # (1% of its time or more with both lanes busy)
                if lanes_overlap_seconds((r := _median_run(system_runs)[0]).intervals)
                > 0.01 * float(r.summary["makespan_s"])]
        warned = (drift_warning(probe_before.seconds, after.seconds, cfg.max_drift),
                  overlap_warning(probe_before.overlap, after.overlap, cfg.max_drift, both))
        late += [w for w in warned if w is not None]
    late += spread_warnings(report.rows, cfg.max_drift)
    late += [w for s in report.systems if s["sim_s_rounds"] and
             (w := rounds_warning(s["row"]["system"], s["row"]["sim_s"], s["sim_s_rounds"], cfg.max_drift))]
    for w in late:
        say(f"WARNING: {w}")
    report.warnings += late
    if cfg.plot and report.systems:
        write_plot(report, out / "validation.png")
    report.settings["elapsed_s"] = time.perf_counter() - t_start
    write_tables(report, out)
    return report


def _probe(model: ModelSpec, devices: Devices) -> ProbeReading:
    """One reading of a fresh :class:`SpeedProbe` (made and freed around it: its weights do not take the replays'
    memory)."""
    with SpeedProbe(model, devices) as probe:
        return probe.read()


def _report_systems(report: ValidationReport, cfg: ValidationConfig, runs: dict[str, list],
                    simulated: dict[str, Any], by_round: dict[str, list[float]], command: str) -> None:
    """The report's comparisons, ranking and verdict from the replays so far (each system by its median; with its
    totals simulated with each calibration round's tables, ``sim_s_rounds``, where the profile kept them)."""
    report.systems = []
    for system in cfg.systems:
        if system not in runs:
            continue
        executed, step_s = _median_run(runs[system])
        cmp = compare(executed, simulated[system], exec_step_s=step_s)
        totals = [float(r.summary["makespan_s"]) for r in runs[system]]
        rounds = by_round.get(system, [])
        cmp["row"].update(replays=len(totals), exec_s_min=min(totals), exec_s_max=max(totals),
                          sim_s_rounds_min=min(rounds, default=math.nan),
                          sim_s_rounds_max=max(rounds, default=math.nan))
        cmp["sim_s_rounds"] = rounds
        cmp["config"] = {"system": executed.config["system"], "memory": executed.manifest["memory"]}
        report.systems.append(cmp)
    report.ranking = rank_agreement(report.rows)
    report.verdict = verdict(report.rows, cfg.thresholds)


__all__ = ["CACHE_CAUTION_FACTOR", "VALIDATION_MICRO", "ValidationConfig", "ValidationReport", "cache_caution",
           "calibration_points", "check_profile", "step_expert_bytes", "validate"]
