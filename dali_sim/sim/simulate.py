"""``simulate()``: trace + system + hardware -> :class:`SimResult` (metrics in docs/metrics.md)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
from tqdm import tqdm

from dali_sim import __version__
from dali_sim.hardware.cost import CostModel
from dali_sim.hardware.implementation import ANY, EXECUTOR, implementation_names
from dali_sim.jsonsafe import json_safe
from dali_sim.hardware.profile import DEFAULT_HARDWARE, load_profile
from dali_sim.models.presets import apply_precision
from dali_sim.policies.systems import SystemConfig, resolve_system
from dali_sim.runtime.controller import Controller
from dali_sim.runtime.future import FutureDemand, future_path, load_future
from dali_sim.runtime.memory import plan_memory
from dali_sim.sim.counters import COUNTERS, PlanCounters, derived, ratio
from dali_sim.sim.engine import EngineOutput, Interval, SimEngine
from dali_sim.sim.lower_bound import bound_memory, time_lower_bound
from dali_sim.trace.provenance import file_sha256
from dali_sim.trace.reader import Needs, Trace, read_meta, read_trace
from dali_sim.trace.schema import DECODE, PREFILL
from dali_sim.workload.builder import Workload, WorkloadConfig
from dali_sim.workload.profiling import ProfiledTrace, ProfileSpec, apply_profile, check_batch_size



@dataclass
class SimResult:
    summary: dict[str, Any]
    per_layer: pd.DataFrame
    per_sequence: pd.DataFrame
    per_step: pd.DataFrame
    config: dict[str, Any]
    manifest: dict[str, Any]
    intervals: list[Interval] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary, "config": self.config, "manifest": self.manifest}

    def to_json(self) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=2, allow_nan=False)


def per_sequence(w: Workload, out: EngineOutput | None) -> pd.DataFrame:
    """One row per sequence of ``w``; with engine output, its TTFT, TPOT and tokens/s (docs/metrics.md)."""
    seq = w.sequences.copy()
    if out is None:
        return seq
    start, end = out.step_start, out.step_end
    batch_start = start[np.searchsorted(w.step_batch, seq["batch"])]  # steps are ordered by batch
    has_pre = seq["first_prefill_step"] >= 0
    has_dec = seq["first_decode_step"] >= 0
    pre_end = np.where(has_pre, end[seq["last_prefill_step"].clip(lower=0)], np.nan)
    pre_time = pre_end - batch_start
    dec_start = np.where(has_dec, start[seq["first_decode_step"].clip(lower=0)], np.nan)
    dec_end = np.where(has_dec, end[seq["last_decode_step"].clip(lower=0)], np.nan)
    dec_time = dec_end - dec_start
    seq["ttft_s"] = np.where(has_pre, pre_time, np.nan)
    seq["prefill_tokens_per_s"] = np.where(has_pre, seq["prompt_tokens_traced"] / pre_time, np.nan)
    seq["decode_time_s"] = np.where(has_dec, dec_time, np.nan)
    seq["tpot_s"] = np.where(has_dec, dec_time / seq["decode_tokens"].clip(lower=1), np.nan)
    seq["decode_tokens_per_s"] = np.where(has_dec, seq["decode_tokens"] / dec_time, np.nan)
    return seq


def _mean(x) -> float:
    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else float("nan")


def simulate(
    trace: Trace | str | Path,
    system: str | SystemConfig,
    *,
    hardware: str | Path = DEFAULT_HARDWARE,
    batch_size: int = 1,
    prefill_chunk: int = 0,
    seed: int = 0,
    overrides: Mapping[str, Mapping[str, str]] | None = None,
    precision: str | None = None,
    timing: bool = True,
    timeline: bool = False,
    progress: bool = False,
    future: str | Path | FutureDemand | None = None,
    workload: Workload | None = None,
    profiling: ProfileSpec | ProfiledTrace | None = None,
) -> SimResult:
    """Replay ``trace`` under ``system`` on ``hardware``. ``timing=False`` is the fast no-timing path:
    the same decisions and counts, no SimPy, no times. ``future``: the next-use file of a policy that
    needs one (``belady``); default: the one ``dali trace enrich`` wrote beside the trace; or next-use
    times already computed (``FutureDemand.from_workload`` of the evaluated sequences' workload).

    ``profiling``: the profiling input of frequency-based choices (``dali_sim.workload.profiling``); default
    ``ProfileSpec()``: the first 25% of the trace's sequences profile, the rest are evaluated. A
    :class:`ProfiledTrace` made once by :func:`apply_profile` (for several systems) must come with its own
    evaluated trace as ``trace``. A batch size above the evaluated sequences is an error.

    A trace given by path is read with only the columns the system needs (:func:`trace_needs`).
    ``workload``: one already built from the evaluated trace for this batching, to share it between runs
    (it must hold the lookahead predictors the system reads; it may hold more): the results are those of
    a run that builds its own."""
    if not isinstance(trace, Trace):
        meta = read_meta(trace)
        sysconf = system if isinstance(system, SystemConfig) else resolve_system(system, overrides, meta.model)
        trace = read_trace(trace, needs=trace_needs([sysconf]))
    profiled = profiled_input(trace, profiling)
    trace = profiled.evaluated
    check_batch_size(batch_size, trace.num_sequences, str(trace.path or "the trace"))
    model = apply_precision(trace.model, precision)
    sysconf = system if isinstance(system, SystemConfig) else resolve_system(system, overrides, model)
    profile = load_profile(hardware)
    config = WorkloadConfig(batch_size, prefill_chunk)
    if workload is not None and (workload.config != config or workload.trace_path != trace.path
                                 or len(workload.sequences) != trace.num_sequences):
        raise ValueError(f"the workload given was built for {len(workload.sequences)} sequences of "
                         f"{workload.trace_path} with {workload.config}, not for the {trace.num_sequences} evaluated "
                         f"sequences of {trace.path} with {config}")
    if sysconf.time_bound:
        if not timing:
            raise ValueError(f"system {sysconf.name!r} is a time bound: it has no counts-only mode (drop --no-timing)")
        return _time_bound(trace, sysconf, model, profile, config, seed=seed, hardware=hardware,
                           profiled=profiled, workload=workload.with_predictors(()) if workload is not None else None)
    sysconf, impl_note = implementation_for(sysconf, profile)
    costs = CostModel(profile, model, implementation=sysconf.implementation, system=sysconf.name)
    placement, cache, prefetch = (c.build() for c in (sysconf.placement, sysconf.cache, sysconf.prefetch))
    if workload is None:
        workload = Workload(trace, config, predictors=prefetch.required_predictors())
    else:
        workload = workload.with_predictors(prefetch.required_predictors())
    mem = plan_memory(model, sysconf.memory, profile.gpu_memory_bytes, workload.max_batch_context,
                      required=placement.required_capacities(workload.num_layers, workload.num_experts))
    needers = [p for p in (placement, cache, prefetch) if p.needs_future]
    share = profiled.record["share"]
    next_uses = None
    if needers:
        next_uses = future if isinstance(future, FutureDemand) else \
            load_future(trace, workload.config, future, needed_by=f"{needers[0].name!r}", share=share)
    controller = Controller(workload, costs, placement, cache, prefetch, mem.capacities,
                            cache_init=sysconf.memory.cache_init, prefetch_slots=mem.prefetch_slots,
                            staging_slots=mem.staging_slots, seed=seed, future=next_uses,
                            frequencies=profiled.frequencies)
    counters = PlanCounters(workload.num_layers)
    # the bar appears only for runs longer than 2 s
    bar = tqdm(total=workload.num_steps, desc=f"{'sim' if timing else 'replay'} {sysconf.name}", unit="step",
               disable=not progress, delay=2, leave=False)
    out: EngineOutput | None = None
    if timing:
        engine = SimEngine(workload, controller, costs, counters, dense_device=sysconf.dense_device,
                           staging_slots=mem.staging_slots, record=timeline, on_step=bar.update)
        out = engine.run()
    else:
        for step in range(workload.num_steps):
            for layer in range(workload.num_layers):
                counters.add(controller.plan(step, layer))
            bar.update()
    bar.close()

    summary, per_layer, per_seq, per_step = result_tables(
        workload, counters, out, model, system=sysconf.name, hardware=profile.name, batch_size=batch_size,
        bounds=controller.bounds, oracles=controller.oracles)
    manifest = run_manifest(trace, seed, profile, model, mem, timing, sysconf.implementation, impl_note,
                            profiled.record)
    if isinstance(future, FutureDemand):
        manifest["future"] = {"computed": "from the evaluated sequences' workload (FutureDemand.from_workload)"}
    elif next_uses is not None:
        used = Path(future) if future is not None else future_path(trace.path, workload.config, share)
        manifest["future"] = {"path": str(used), "sha256": file_sha256(used)}
    config = {"system": sysconf.to_dict(), "hardware": str(hardware), "batch_size": batch_size,
              "prefill_chunk": prefill_chunk, "seed": seed, "precision": model.precision_label, "timing": timing,
              "profiling": profile_config(profiled)}
    return SimResult(summary, per_layer, per_seq, per_step, config, manifest, out.intervals if out else [])


def profiled_input(trace: Trace, profiling: ProfileSpec | ProfiledTrace | None) -> ProfiledTrace:
    """``profiling`` applied to ``trace``; a :class:`ProfiledTrace` is taken as it is when ``trace`` is its
    evaluated trace."""
    if isinstance(profiling, ProfiledTrace):
        if profiling.evaluated is not trace:
            raise ValueError("a ProfiledTrace comes with its own evaluated trace: pass its .evaluated as the trace")
        return profiling
    return apply_profile(trace, profiling)


def profile_config(profiled: ProfiledTrace) -> dict[str, Any]:
    """The run config's account of its profiling input (the manifest has the full record)."""
    r = profiled.record
    return {"source": r["source"], "share": r["share"], **({"trace": r["trace"]} if "trace" in r else {}),
            "evaluated_sequences": r["evaluated_sequences"]["count"]}


def _time_bound(trace: Trace, sysconf: SystemConfig, model, profile, config: WorkloadConfig, *,
                seed: int, hardware, profiled: ProfiledTrace, workload: Workload | None = None) -> SimResult:
    """A time bound's result (``dali_sim.sim.lower_bound``) in the simulator's layout: the times are
    bounds; the cache and transfer counters do not apply (NaN). Its costs are the least over
    :func:`bound_implementations` (every term separately), so no system run by one of them is faster."""
    names = bound_implementations(sysconf, profile)
    costs = [CostModel(profile, model, implementation=n, system=sysconf.name) for n in names]
    w = workload if workload is not None else Workload(trace, config)
    memory = bound_memory(model, sysconf.memory, profile.gpu_memory_bytes, w.max_batch_context)
    lb = time_lower_bound(w, costs, memory.expert_slots)
    counters = PlanCounters(w.num_layers)
    counters.c["activated"] += np.bincount(np.arange(w.num_steps * w.num_layers).repeat(np.diff(w.actual.ptr))
                                           % w.num_layers, minlength=w.num_layers)
    out = EngineOutput(lb.step_start, lb.step_end, lb.layer_s, np.full(w.num_layers, np.nan), {}, 0, [])
    summary, per_layer, per_seq, per_step = result_tables(
        w, counters, out, model, system=sysconf.name, hardware=profile.name, batch_size=config.batch_size,
        bounds={"time": sysconf.name})
    na = [k for k in summary if k in COUNTERS and k != "activated"] + list(derived(counters.totals(), 1))
    summary.update(dict.fromkeys(na, float("nan")))
    per_layer[[c for c in per_layer.columns if c not in ("activated", "time_s")]] = np.nan
    summary["lower_bound"] = lb.details
    manifest = run_manifest(trace, seed, profile, model, memory, True, ",".join(names),
                            f"a time bound over implementations {', '.join(names)}" if len(names) > 1 else "",
                            profiled.record)
    config_out = {"system": sysconf.to_dict(), "hardware": str(hardware), "batch_size": config.batch_size,
                  "prefill_chunk": config.prefill_chunk, "seed": seed, "precision": model.precision_label,
                  "timing": True, "profiling": profile_config(profiled)}
    return SimResult(summary, per_layer, per_seq, per_step, config_out, manifest)


def trace_needs(systems) -> Needs:
    """The trace columns the runs of ``systems`` (resolved :class:`SystemConfig`) read: the routing and the
    lookahead predictors their prefetch policies name (no gate weights, router logits or other columns)."""
    names: set[str] = set()
    for sysconf in systems:
        if sysconf.prefetch is not None:
            names.update(sysconf.prefetch.build().required_predictors())
    return Needs(predictors=tuple(sorted(names)))


def implementation_for(sysconf: SystemConfig, profile) -> tuple[SystemConfig, str]:
    """The implementation a run times: the system's own on an analytic profile; on a measured profile
    (dali's executor measured on a machine) the executor's, unless the run asks for ``bare`` (the policies
    alone). Returns the system to run and a note when it was changed."""
    if profile.kind == "analytic" or sysconf.implementation in (EXECUTOR, "bare"):
        return sysconf, ""
    note = (f"measured profile {profile.name!r} describes dali's executor: implementation {EXECUTOR!r} instead of "
            f"the system's {sysconf.implementation!r}")
    return dataclasses.replace(sysconf, implementation=EXECUTOR), note


def bound_implementations(sysconf: SystemConfig, profile) -> list[str]:
    """The implementations a time bound takes the least of: the one it names, or for ``any`` every
    implementation the profile can price (a measured profile: dali's executor and ``bare``; an analytic
    one: all but the executor, whose host costs only a measured profile has)."""
    if sysconf.implementation != ANY:
        return [implementation_for(sysconf, profile)[0].implementation]
    if profile.kind != "analytic":
        return [EXECUTOR, "bare"]
    return [n for n in implementation_names() if n != EXECUTOR]


def run_manifest(trace: Trace, seed: int, profile, model, memory, timing: bool, implementation: str,
                 implementation_note: str = "", profiling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a run used (inputs with their hashes, versions, memory plan, implementation, profiling input):
    simulator and executor alike."""
    return {
        "profiling": dict(profiling) if profiling is not None else None,
        "implementation": {"name": implementation, **({"note": implementation_note} if implementation_note else {})},
        "dali_version": __version__,
        "trace": str(trace.path) if trace.path else None,
        "trace_sha256": trace.sha256 if trace.path else None,
        "seed": seed,
        "hardware": {"name": profile.name, "path": str(getattr(profile, "path", "") or "")},
        "model": model.to_dict(),
        "memory": memory.describe(),
        "timing": timing,
    }


def result_tables(w: Workload, counters: PlanCounters, out: EngineOutput | None, model, *, system: str,
                  hardware: str, batch_size: int, bounds: dict[str, str], oracles: dict[str, str] | None = None):
    """(summary, per_layer, per_sequence, per_step) of a run, timed when ``out`` is given: one layout
    for the simulator and the executor, so both report every metric of docs/metrics.md the same way.
    ``bounds`` / ``oracles``: family -> policy of the run's bounds and oracle heuristics (docs/policies.md)."""
    totals = counters.totals()
    per_layer = counters.frame(model.moe_layers)
    per_layer["hit_rate"] = per_layer["hits"] / per_layer["activated"].replace(0, np.nan)
    summary: dict[str, Any] = {"system": system, "hardware": hardware, "model": model.name,
                               "batch_size": batch_size, "bounds": bounds, "oracles": oracles or {},
                               **w.describe(), **totals,
                               **derived(totals, model.expert_bytes)}
    per_seq = per_sequence(w, out)
    per_step = pd.DataFrame({"phase": np.where(w.step_phase == PREFILL, "prefill", "decode"),
                             "batch": w.step_batch, "tokens": w.step_tokens})
    if out is not None:
        per_step["start_s"], per_step["time_s"] = out.step_start, out.step_end - out.step_start
        per_layer["time_s"] = out.layer_time
        per_layer["gpu_wait_s"] = out.layer_wait
        summary |= timed_summary(w, out, per_seq)
    return summary, per_layer, per_seq, per_step


def timed_summary(w: Workload, out: EngineOutput, per_seq: pd.DataFrame) -> dict[str, Any]:
    """The time metrics of docs/metrics.md (``per_seq`` from :func:`per_sequence`)."""
    dur = out.step_end - out.step_start
    makespan = float(out.step_end[-1])
    pre, dec = w.step_phase == PREFILL, w.step_phase == DECODE
    return {
        "makespan_s": makespan,
        "prefill_s": float(dur[pre].sum()),
        "decode_s": float(dur[dec].sum()),
        "prefill_tokens_per_s": _mean(per_seq["prefill_tokens_per_s"]),
        "decode_tokens_per_s": _mean(per_seq["decode_tokens_per_s"]),
        "prefill_throughput": ratio(w.step_tokens[pre].sum(), dur[pre].sum()),
        "decode_throughput": ratio(w.step_tokens[dec].sum(), dur[dec].sum()),
        "ttft_s": _mean(per_seq["ttft_s"]),
        "tpot_s": _mean(per_seq["tpot_s"]),
        "busy": {k: ratio(v, makespan) for k, v in out.busy.items()},
        "events": out.events,
        "handoffs": dict(out.handoffs),
        "prefetches_waited": out.prefetches_waited,
    }

__all__ = ["DEFAULT_HARDWARE", "SimResult", "implementation_for", "per_sequence", "profile_config", "profiled_input",
           "result_tables", "run_manifest", "simulate", "timed_summary", "trace_needs"]
