"""The task function every engine runs: several configurations on one trace and batching.

A :class:`SweepTask` names its trace by path (workers read it themselves; nothing large is pickled)
and carries the resolved configurations of one (trace, batch size, prefill chunk). The worker reads
the trace once with the columns any configuration of it needs, splits off its profiling sequences
(``profile_share``, as ``dali sim``), builds the :class:`Workload` of the evaluated ones once and
shares it across the task's systems (``simulate(..., workload=...)``: identical results), and returns
one :class:`Outcome` per configuration; a configuration that fails is an outcome with its error, not
an exception. Both are kept for the next task in the same process (a small per-process cache).
"""

from __future__ import annotations

import functools
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

from dali_sim.sweep.spec import RunConfig
from dali_sim.trace.reader import Needs


@dataclass(frozen=True)
class SweepTask:
    trace_path: str
    needs: Needs  # the columns every configuration of this trace reads (the same for all its tasks)
    batch_size: int
    prefill_chunk: int
    runs: tuple[RunConfig, ...]
    cost: float = 0.0  # estimated relative run time (longest tasks are handed out first)
    profile_share: float = 0.25  # the profiling split: the first share of the sequences profile


@dataclass
class Outcome:
    """What one configuration gave: ``status`` ``ok`` (with the run's summary, config and manifest) or
    ``error`` (with a one-line ``error`` and the traceback)."""

    config_hash: str
    status: str
    error: str = ""
    traceback: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    worker: dict[str, Any] = field(default_factory=dict)


def _worker_id() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def failed(task: SweepTask, message: str, tb: str = "") -> list[Outcome]:
    """Every configuration of ``task`` as failed with ``message`` (the task as a whole could not run)."""
    return [Outcome(r.hash, "error", message, tb, worker=_worker_id()) for r in task.runs]


@functools.lru_cache(maxsize=2)
def _trace(path: str, needs: Needs):
    from dali_sim.trace.reader import read_trace

    return read_trace(path, needs=needs)


@functools.lru_cache(maxsize=2)
def _profiled(path: str, needs: Needs, share: float):
    from dali_sim.workload.profiling import ProfileSpec, apply_profile

    return apply_profile(_trace(path, needs), ProfileSpec(share=share))


@functools.lru_cache(maxsize=2)
def _workload(path: str, needs: Needs, share: float, batch_size: int, prefill_chunk: int):
    from dali_sim.workload.builder import Workload, WorkloadConfig

    return Workload(_profiled(path, needs, share).evaluated, WorkloadConfig(batch_size, prefill_chunk),
                    predictors=needs.predictors)


@functools.lru_cache(maxsize=2)
def _future(path: str, needs: Needs, share: float, batch_size: int, prefill_chunk: int):
    from dali_sim.runtime.future import FutureDemand

    return FutureDemand.from_workload(_workload(path, needs, share, batch_size, prefill_chunk))


def clear_caches() -> None:
    """Drop the traces and workloads kept for the next task (the in-process engine calls it at the end)."""
    for cached in (_future, _workload, _profiled, _trace):
        cached.cache_clear()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def iter_task(task: SweepTask) -> Iterator[Outcome]:
    """The outcomes of ``task``'s configurations, one at a time, in the task's order."""
    from dali_sim.sim.simulate import simulate

    args = (task.trace_path, task.needs, task.profile_share, task.batch_size, task.prefill_chunk)
    try:
        profiled, workload = _profiled(*args[:3]), _workload(*args)
    except Exception as exc:  # the whole task fails: every configuration records why
        yield from failed(task, _one_line(exc), traceback.format_exc())
        return
    for run in task.runs:
        start = time.perf_counter()
        try:
            future = _future(*args) if run.needs_future else None
            r = simulate(profiled.evaluated, run.system, hardware=run.hardware_ref, batch_size=run.batch_size,
                         prefill_chunk=run.prefill_chunk, seed=run.seed, overrides=run.overrides,
                         precision=run.precision, timing=run.timing, workload=workload, future=future,
                         profiling=profiled)
            yield Outcome(run.hash, "ok", summary=r.summary, config=r.config, manifest=r.manifest,
                          wall_s=time.perf_counter() - start, worker=_worker_id())
        except Exception as exc:
            yield Outcome(run.hash, "error", _one_line(exc), traceback.format_exc(),
                          wall_s=time.perf_counter() - start, worker=_worker_id())


def run_task(task: SweepTask) -> list[Outcome]:
    """:func:`iter_task` as a list: the task function of the process pool and of Ray."""
    return list(iter_task(task))


__all__ = ["Outcome", "SweepTask", "clear_caches", "failed", "iter_task", "run_task"]
