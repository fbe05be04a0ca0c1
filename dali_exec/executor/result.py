"""An executed run as the simulator's :class:`SimResult` (same summary keys, tables, manifest), plus
what only a real run has: measured overheads and the devices it ran on (``summary["executor"]``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from dali_exec.executor.problem import ReplaySetup
from dali_sim.runtime.controller import Controller
from dali_sim.sim.counters import PlanCounters, ratio
from dali_sim.sim.engine import EngineOutput
from dali_sim.sim.simulate import SimResult, profile_config, result_tables, run_manifest


def overhead_summary(per_layer: pd.DataFrame, visits: int, per_visit: np.ndarray | None = None,
                     prefetching: np.ndarray | None = None) -> dict[str, float]:
    """Decisions (the policies, through the controller) and bookkeeping (the executor's own host work:
    routing indices, slot table, issuing copies, choosing the next expert) per layer visit in
    microseconds, and their share of the time spent in MoE layers; wall clock, and thread CPU time
    (``*_cpu``: what the code itself costs, insensitive to a busy machine). ``per_visit``: (2, visits) seconds
    of decision + bookkeeping of each visit (wall clock, thread CPU), for their median and 90th percentile
    (``overhead{,_cpu}_us_median`` / ``_p90``; the means above let one slow visit count in full).
    ``prefetching``: (visits,) whether each visit's plan issues prefetches; where some do, also the share of
    those visits (``prefetching_visits``) and the median of each kind (``overhead{,_cpu}_us_median_prefetching``
    / ``_other``): a visit that issues prefetches also decides which (a prefetcher's search) and hands them to
    the copy thread, so the two kinds can cost about twice apart and the median of all of them then moves
    between theirs with a few visits."""
    time_s = float(per_layer["time_s"].sum())
    out: dict[str, float] = {"layer_visits": visits, "layer_time_us": 1e6 * ratio(time_s, visits)}
    for i, suffix in enumerate(("", "_cpu")):
        decision = float(per_layer[f"decision{suffix}_s"].sum())
        book = float(per_layer[f"bookkeeping{suffix}_s"].sum())
        out[f"decision{suffix}_us_per_layer"] = 1e6 * ratio(decision, visits)
        out[f"bookkeeping{suffix}_us_per_layer"] = 1e6 * ratio(book, visits)
        out[f"overhead{suffix}_us_per_layer"] = 1e6 * ratio(decision + book, visits)
        out[f"fraction{suffix}_of_layer_time"] = ratio(decision + book, time_s)
        if per_visit is not None and per_visit.shape[1]:
            median, p90 = np.percentile(per_visit[i], [50, 90])
            out[f"overhead{suffix}_us_median"], out[f"overhead{suffix}_us_p90"] = 1e6 * median, 1e6 * p90
            if prefetching is not None and prefetching.any():
                out["prefetching_visits"] = float(prefetching.mean())
                for kind, which in (("prefetching", prefetching), ("other", ~prefetching)):
                    out[f"overhead{suffix}_us_median_{kind}"] = 1e6 * float(np.median(per_visit[i][which])) \
                        if which.any() else math.nan
    return out


def executor_summary(executor: dict[str, Any]) -> dict[str, Any]:
    """``summary["executor"]``: the device, and the grouped calls per lane with the experts they computed
    (docs/executor.md: one call per group of experts whose weights are present)."""
    return {"device": executor["devices"]["accelerator"], "device_name": executor["devices"]["accelerator_name"],
            "grouped_calls": executor["grouped_calls"]}


def assemble_result(setup: ReplaySetup, controller: Controller, counters: PlanCounters, out: EngineOutput, *,
                    decision_s: np.ndarray, bookkeeping_s: np.ndarray, batch_size: int, prefill_chunk: int,
                    seed: int, executor: dict[str, Any], per_visit_s: np.ndarray | None = None,
                    prefetching: np.ndarray | None = None) -> SimResult:
    """The :func:`dali_sim.sim.simulate` result layout for an executed run. ``decision_s`` and
    ``bookkeeping_s``: (2, L) wall-clock and thread-CPU seconds per MoE layer; ``per_visit_s``: (2, visits)
    decision + bookkeeping seconds of each layer visit and ``prefetching`` whether its plan issued prefetches
    (:func:`overhead_summary`)."""
    w, model, sysconf, profile = setup.workload, setup.model, setup.sysconf, setup.profile
    summary, per_layer, per_seq, per_step = result_tables(
        w, counters, out, model, system=sysconf.name, hardware=profile.name, batch_size=batch_size,
        bounds=controller.bounds, oracles=controller.oracles)
    per_layer["decision_s"], per_layer["decision_cpu_s"] = decision_s
    per_layer["bookkeeping_s"], per_layer["bookkeeping_cpu_s"] = bookkeeping_s
    summary["overhead"] = overhead_summary(per_layer, w.num_steps * w.num_layers, per_visit_s, prefetching)
    summary["executor"] = executor_summary(executor)
    manifest = run_manifest(setup.trace, seed, profile, model, setup.memory, True, sysconf.implementation,
                            profiling=setup.profiled.record)
    manifest["executor"] = {**executor, "replay": setup.describe()}
    config = {"system": sysconf.to_dict(), "hardware": setup.hardware, "batch_size": batch_size,
              "prefill_chunk": prefill_chunk, "seed": seed, "precision": model.precision_label, "timing": True,
              "profiling": profile_config(setup.profiled),
              "executor": {k: executor[k] for k in ("options", "cpu_threads", "accel_threads")}}
    return SimResult(summary, per_layer, per_seq, per_step, config, manifest, out.intervals)
