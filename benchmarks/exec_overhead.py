"""Executor overhead: the executor's own decision and bookkeeping time per MoE layer, in microseconds
and as a fraction of the time spent in the layer (the DALI paper reports 4.5% scheduling overhead).

    python benchmarks/exec_overhead.py                 # gpt-oss-20b trace, scale 1/8, 8 layers (a few minutes on 2 cores)
    python benchmarks/exec_overhead.py --quick         # smaller: seconds
    python benchmarks/exec_overhead.py --device cuda --scale 1 --layers 24 --json out.json
    python benchmarks/exec_overhead.py --shape qwen3-30b-a3b --batch-size 32 --sequences 32   # 128 experts, top-8

Per system, ``dali_exec.executor.execute`` replays the same reduced trace ``--repeats`` times (after one
warm-up run) and reports, per column, the median over those runs of the per-visit means (of the median
visit for ``overhead_cpu_median_us``):

* ``decision``: ``Controller.plan`` (the policies, shared with the simulator) and ``PlanCounters.add``;
* ``bookkeeping``: the executor's host work around the computes: grouping the routing by expert and
  checking it against the plan, index tensors, the slot table, issuing copies, choosing the next expert,
  freeing buffers (not the computes, activation transfers or waits for copies, nor the lookup of the
  step's routing in the trace, the replay's stand-in for the router; the stopwatch itself, about 1 us
  per segment, is included: a few segments per layer and one per group, none per staging turn);
* ``layer``: wall time of the MoE layer (dense part + both lanes + combine, the device synchronised).

Both are given as wall clock and as thread CPU time (``*_cpu``): on a busy machine the wall clock also
counts time the thread waits for a core or for the GIL (the copy and CPU-lane threads hold it between
their torch calls); CPU time is what the code costs. ``plan_only_us`` times the controller alone on the
same workload (no execution, no other threads): the policies' cost without interference.
``plan_after_layer_us`` times the same plans, each after a spin on the clock as long as the system's median
layer (thread CPU per plan): the policies' cost when only time has passed since the last one, with no
tensor work. On a machine whose physical core is shared (a virtual machine), time alone leaves the
caches cold (benchmarks/cold_host.py), and this column, not ``plan_only_us``, is what to compare
``decision_cpu_us`` with.

``overhead_cpu_us`` is decision + bookkeeping in thread CPU per visit, their mean over the visits (as the
columns before it); ``overhead_cpu_median_us`` is the median visit's (each visit's decision and bookkeeping
summed, then the median over the visits; ``overhead_cpu_p90_us`` in ``--json``: the 90th percentile), also the
median over the runs. For a system whose plans issue prefetches in some visits, the printed line and ``--json``
add the share of those visits (``prefetching_visits``) and the median of each kind
(``overhead_cpu_median_prefetching_us``, ``overhead_cpu_median_other_us``): such a visit also runs the prefetcher's
search and hands its copies to the copy thread, and where the two kinds are about as many and twofold apart
(hybrimoe on the Qwen3 shape) the median of all visits lies between them and moves with a few visits from run to
run. ``--shape PRESET`` runs every system (``--systems`` and ``--lookahead-systems``) on a
synthetic trace of that model preset (decode only, lookahead columns residual, next-gate, gate2 and gate3)
instead of ``--trace``. ``limit_us`` is the target of the runtime issue for the thread-CPU overhead per layer
visit (decision + bookkeeping, the median visit): 60 us for cpu-only, gpu-lru, llamacpp, fiddler and
ktransformers, 100 us for dali and hybrimoe; ``ok`` says whether ``overhead_cpu_median_us`` meets it.

``--no-tensor-work`` replaces the expert computes, the dense blocks and the expert copies by no-ops
(the layouts return their input, the copies copy nothing) and leaves every decision and every line of
bookkeeping as it is: what the host work costs when the core that runs it does not also run the tensor
work, as on an accelerator that computes and copies by itself. On the CPU device the difference from a
normal run is the cost of the caches the tensor work evicts, or, on a machine whose core is shared, that
the time it takes lets the machine evict (benchmarks/README.md, "Executor overhead" and "Time alone
empties the caches here"). Its layer times and tokens/s mean nothing. CPU device only: on CUDA the tensor
work does not run on the host's core in the first place. With it, ``--idle-us N`` adds a busy wait of N us after
each layer visit, outside every stopwatch (compiled register-only work: it touches no memory), as a GPU host
waits while the accelerator computes the layer: what the host work costs once that much time has passed
(benchmarks/README.md, "The whole visit, after time alone"). It also adds ``visit_cpu_median_us``: this thread's
CPU time of the whole visit, from the decision's start to the experts' return, stopwatches or not (the median
visit, the median over the runs). With no tensor work all of it is host work, including what the stopwatches
leave out as device work (the per-expert loop of one-expert turns, the tiny gathers and scatters).

``--count-calls`` adds ``calls_per_visit``: the Python functions and C calls (torch, NumPy, built-ins) the
lane's thread makes while an executor stopwatch runs, per layer visit, counted in one more replay of each
system (``sys.setprofile``; the copy thread and the CPU worker are not counted). A count does not move with
the machine's speed, so a change of the host path reads in it on a machine whose timings move 10-50% from one
run to the next; ``--json`` lists the ``--count-calls N`` most frequent per visit. The counting slows that replay,
not the timed ones.

``--segments`` adds ``segments_us_per_visit``: in one more replay of each system, every stopwatch segment's thread
CPU, exactly as the stopwatches count it, named by the function:line that starts it and the one that ends it (a
start, stop or hand-over), per layer visit (its median duration times its occurrences per visit); the table is
followed by each system's five largest. Which part of the runtime the counted time falls in, without probes.

``--floor route`` and ``--floor none`` replay each system with the least host work per visit this design can
have, to tell how much of the counted figure any rewrite of the lanes' bookkeeping could remove: the stopwatch
counts the decision, ``start_layer`` and, with ``route``, the route's compiled call and the lane split (grouping
and checking the routing, evictions, admissions), with ``none`` nothing more; then every routed expert is
computed from host memory as one grouped call outside the stopwatches (the CPU lane's call: the same tensor
work as cpu-only's, so the layer lasts as long and leaves the caches as cold). The plans and the layers'
outputs are the normal replay's. For systems whose plans neither prefetch nor swap (their buffers need the
lanes it skips: a refusal names the first such visit); CPU device only; no limit applies to its rows.

``--handoffs`` adds ``handoffs_per_visit`` and ``handoff_cpu_us``: in one more replay of each system, every hand-over
of the replay's thread to a thread that waits for work, per kind (``cpu_lane``: a job to the CPU lane's worker;
``cpu_lane_asleep``: those of them that found it asleep, its spin over, and woke it; ``copy_thread``: background
copies that wake the copy thread), per layer visit, and the median thread CPU of one. Waking a sleeping thread is a
system call and an interrupt its waker pays for: on the 2-core VM about as much as the rest of a layer visit's
bookkeeping of a system without one (benchmarks/README.md, "Hand-overs to sleeping threads"); the simulator
charges it too (``lane_wake.host``, docs/hardware.md). A job that finds the worker spinning (``--spin-us``) needs
no wake.

``--sync-sites`` (CUDA) adds ``sync_sites_per_visit``: in one more replay of each system under torch's sync debug
mode (``torch.cuda.set_sync_debug_mode("warn")``), the calls that made the host wait for the GPU, per Python call
site (file:line), per layer visit; the table is followed by each system's five most frequent. A wait inside a
layer stops the host from issuing the next work while the GPU drains. Every row also has ``close_s``: the wall
seconds a replay's ``close()`` took (its threads' end), the median over the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import torch

from dali_exec.executor import copies, dense, ffn, timing
from dali_exec.executor import Devices, ExecOptions, HostExpertStore, Replay, ReplayOptions, prepare_replay
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import cpu_name, resolve_device
from dali_exec.executor.routing import LayerRouting
from dali_exec.executor.runtime import OffloadRuntime, _AccelLane
from dali_sim.runtime.controller import Controller
from dali_sim.runtime.future import FutureDemand
from dali_sim.sim.counters import PlanCounters
from dali_sim.sim.engine import HANDOFF_KINDS
from dali_sim.trace import read_trace
from dali_sim.trace.synth import SynthConfig, synthesize
from dali_sim.workload.profiling import ProfileSpec

from cold_host import BusyWait, spin

REPO = Path(__file__).resolve().parents[1]
PAPER_OVERHEAD = 0.045  # DALI (arXiv 2602.03495): reported scheduling overhead, for comparison only
#: thread-CPU decision + bookkeeping per layer visit the runtime issue asks for (microseconds)
LIMIT_US = {"cpu-only": 60, "gpu-lru": 60, "llamacpp": 60, "fiddler": 60, "ktransformers": 60, "dali": 100,
            "hybrimoe": 100}
PRINTED = ["experts_per_layer", "gpu_experts_per_layer", "layer_us", "decision_us", "bookkeeping_us", "decision_cpu_us",
           "bookkeeping_cpu_us", "overhead_cpu_us", "overhead_cpu_median_us", "overhead_cpu_pct", "plan_only_us", "plan_after_layer_us", "limit_us", "ok"]
LOOKAHEAD = ("residual=0.9", "next-gate=0.7", "gate2=0.6@2", "gate3=0.5@3")


def plan_only_us(setup, seed: int = 0, spin_s: float = 0.0) -> float:
    """Microseconds per (step, layer) of the controller alone (plan + counting, as the executor's
    ``decision``) on the replay's workload, with nothing else running: in a tight loop (wall clock over the
    loop), or each plan after a spin of ``spin_s`` seconds on the clock (thread CPU per plan; the spin
    touches no memory, yet on a machine whose core is shared time alone leaves the caches cold:
    benchmarks/cold_host.py)."""
    s, w = setup.sysconf, setup.workload
    placement, cache, prefetch = (c.build() for c in (s.placement, s.cache, s.prefetch))
    needs = any(getattr(p, "needs_future", False) for p in (placement, cache, prefetch))
    extra = {"future": FutureDemand.from_workload(w)} if needs else {}
    ctl = Controller(w, setup.costs, placement, cache, prefetch, setup.memory.capacities,
                     cache_init=s.memory.cache_init, prefetch_slots=setup.memory.prefetch_slots,
                     staging_slots=setup.memory.staging_slots, seed=seed, **extra)
    counters = PlanCounters(w.num_layers)
    visits = [(step, layer) for step in range(w.num_steps) for layer in range(w.num_layers)]
    if not spin_s:  # (one reading of the clock for the whole loop)
        t0 = time.perf_counter()
        for step, layer in visits:
            counters.add(ctl.plan(step, layer))
        return 1e6 * (time.perf_counter() - t0) / len(visits)
    total = 0.0
    for step, layer in visits:  # thread CPU of each plan, as the executor's stopwatch reads it
        spin(spin_s)
        t0 = time.thread_time()
        counters.add(ctl.plan(step, layer))
        total += time.thread_time() - t0
    return 1e6 * total / len(visits)


@contextmanager
def no_tensor_work():
    """Expert computes, dense blocks and expert copies as no-ops (``--no-tensor-work``); the host work
    around them is unchanged (the outputs are the inputs, so shapes and dtypes still match)."""
    patches = [
        mock.patch.object(ffn.ExpertLayout, "forward_grouped", lambda self, table, x, *a, **k: x),
        mock.patch.object(ffn.ExpertLayout, "forward", lambda self, flat, x: x),
        mock.patch.object(ffn.ExpertLayout, "forward_prepared", lambda self, views, x: x),
        mock.patch.object(dense.DenseBlock, "__call__", lambda self, x, a, kv: (x, x if self.moe else None)),
        mock.patch.object(copies, "copy_rows", lambda *a, **k: None),
        mock.patch.object(copies.CopyEngine, "copy_one", lambda self, dst, src, after=None: (0.0, 0.0)),
    ]
    with ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextmanager
def idle_after_visits(seconds: float):
    """After each layer visit (``OffloadRuntime.run_experts`` returned: outside every stopwatch), a busy wait of
    ``seconds`` that runs compiled register-only work (``--idle-us``; :class:`cold_host.BusyWait`)."""
    wait, run_experts = BusyWait(), OffloadRuntime.run_experts

    def then_idle(self, *args, **kwargs):
        out = run_experts(self, *args, **kwargs)
        wait(seconds)
        return out

    with mock.patch.object(OffloadRuntime, "run_experts", then_idle):
        yield


FLOORS = ("route", "none")


class FloorRefused(ValueError):
    """A ``--floor`` replay of a system whose plans prefetch or swap."""


@contextmanager
def floor_visits(floor: str):
    """``--floor``: each layer visit's expert work with the least host work this design can have. The stopwatch
    counts ``route`` (the route's compiled call and the lane split: grouping, checking, evictions, admissions)
    or ``none`` (nothing) after the decision and ``start_layer``; then, outside every stopwatch, the routing is
    grouped (``none``) and every routed expert computed from host memory as one grouped call, the CPU lane's
    (the same tensor work as cpu-only's, so a layer lasts about as long and leaves the caches as cold). For
    systems whose plans neither prefetch nor swap (their buffers would need the lanes this skips)."""

    def run_experts(rt, plan, x, routing, *, uncounted_on_cpu=False, handoff=None):
        if plan.prefetches or plan.swaps:
            raise FloorRefused(f"--floor {floor}: step {plan.step} layer {plan.layer} prefetches or swaps; the floor "
                             "replays only systems that do neither")
        sw = handoff.hand_to(timing.Stopwatch()) if handoff is not None else timing.Stopwatch().start()
        if floor == "route":
            grouped, _, split, admitted = rt._route(plan, *routing)
            _AccelLane.of(plan, rt.pool, *split, admitted=admitted)
        sw.stop()
        rt._book(plan.layer, sw)
        if floor == "none":
            grouped = LayerRouting.group(*routing)
        pos, y = rt._cpu_lane(plan.step, plan.layer, np.arange(len(grouped.experts)), x, grouped)
        T, k = grouped.num_tokens, grouped.top_k
        out = torch.zeros((T * k, x.shape[1]), dtype=y.dtype).index_copy_(0, pos, y)
        return out.view(T, k, -1).sum(dim=1)

    with mock.patch.object(OffloadRuntime, "run_experts", run_experts):
        yield


class VisitClock:
    """This thread's CPU time of each whole layer visit (``visit_cpu_median_us``, with ``--no-tensor-work``): from
    the decision's start (``Controller.plan``) to ``OffloadRuntime.run_experts``' return, stopwatches or not (an
    ``--idle-us`` wait follows that return: :func:`measure` enters it after this clock). With
    no tensor work everything in it is host work, the parts the stopwatches leave out as device work too: the
    per-expert loop of one-expert turns (slicing the routing, stamping, issuing), the gathers and scatters of
    tiny tensors, the no-op computes' calls. The CPU worker's own time is not in it (another thread)."""

    def __init__(self) -> None:
        self.visits: list[float] = []
        self._t0 = 0.0

    @contextmanager
    def timing(self):
        plan, run_experts = Controller.plan, OffloadRuntime.run_experts

        def planned(ctrl, *args, **kwargs):
            self._t0 = time.thread_time()
            return plan(ctrl, *args, **kwargs)

        def ran(rt, *args, **kwargs):
            out = run_experts(rt, *args, **kwargs)
            self.visits.append(time.thread_time() - self._t0)
            return out

        with mock.patch.object(Controller, "plan", planned), mock.patch.object(OffloadRuntime, "run_experts", ran):
            yield self


@contextmanager
def stopwatches_reporting(running: set):
    """The executor's stopwatches keep their ids in ``running`` while they run (``Stopwatch.start``, ``stop`` and
    ``hand_to`` wrapped); yields the wrappers' code objects (for a profile hook that leaves them out)."""
    watch = timing.Stopwatch
    start, stop, hand_to = watch.start, watch.stop, watch.hand_to

    def started(w):
        running.add(id(w))
        return start(w)

    def stopped(w):
        stop(w)
        running.discard(id(w))

    def handed(w, other):
        out = hand_to(w, other)
        running.discard(id(w))
        running.add(id(other))
        return out

    with mock.patch.object(watch, "start", started), mock.patch.object(watch, "stop", stopped), \
            mock.patch.object(watch, "hand_to", handed):
        try:
            yield {f.__code__ for f in (started, stopped, handed)}
        finally:
            running.clear()


class CallCounter:
    """Calls made on this thread while any executor stopwatch runs (``--count-calls``), by function."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._running: set[int] = set()
        self._own: set = set()  # the wrappers' code: neither they nor the calls they make are counted

    def _event(self, frame, event: str, arg) -> None:
        if not self._running or event not in ("call", "c_call") or frame.f_code in self._own:
            return
        if event == "call":
            code = frame.f_code
            name = f"{Path(code.co_filename).name}:{code.co_name}"
        else:
            name = f"C:{getattr(arg, '__qualname__', None) or getattr(arg, '__name__', None) or type(arg).__name__}"
        self.counts[name] = self.counts.get(name, 0) + 1

    @contextmanager
    def counting(self):
        """The stopwatches report when they run; the profile hook counts meanwhile (this thread only)."""
        with stopwatches_reporting(self._running) as self._own:
            sys.setprofile(self._event)
            try:
                yield self
            finally:
                sys.setprofile(None)


class SegmentClock:
    """The thread-CPU seconds of every stopwatch segment (``--segments``), exactly as the stopwatches count them,
    by where the segment starts and ends: the function and line that started (or handed over to) the stopwatch and
    the one that stopped it (or handed over from it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._from: dict[int, str] = {}  # a running stopwatch -> where it started

    @staticmethod
    def _site() -> str:
        frame = sys._getframe(2)  # (the caller of the stopwatch's method; 1 is this clock's wrapper)
        return f"{frame.f_code.co_name}:{frame.f_lineno}"

    def _add(self, w, cpu_before: float, here: str) -> None:
        begun = self._from.pop(id(w), None)
        if begun is not None:
            self.seconds.setdefault(f"{begun} -> {here}", []).append(w.cpu - cpu_before)

    @contextmanager
    def timing(self):
        watch = timing.Stopwatch
        start, stop, hand_to = watch.start, watch.stop, watch.hand_to

        def started(w):
            out = start(w)
            self._from[id(w)] = self._site()
            return out

        def stopped(w):
            before = w.cpu
            stop(w)
            self._add(w, before, self._site())

        def handed(w, other):
            before = w.cpu
            out = hand_to(w, other)
            here = self._site()
            self._add(w, before, here)
            self._from[id(other)] = here
            return out

        with mock.patch.object(watch, "start", started), mock.patch.object(watch, "stop", stopped), \
                mock.patch.object(watch, "hand_to", handed):
            try:
                yield self
            finally:
                self._from.clear()


def timed_segments(setup, devices, run: ExecOptions, store) -> dict:
    """One replay with :class:`SegmentClock`: per segment, thread-CPU us per layer visit (its median duration
    times its occurrences per visit: robust to the first visits' one-off costs), largest first."""
    clock = SegmentClock()
    with clock.timing():
        result = run_once(setup, devices, run, store)
    visits = result.summary["overhead"]["layer_visits"]
    per_visit = {name: 1e6 * float(np.median(s)) * len(s) / visits for name, s in clock.seconds.items()}
    return {"segments_us_per_visit": dict(sorted(per_visit.items(), key=lambda kv: (-kv[1], kv[0])))}


@contextmanager
def timed_handoffs(seconds: dict[str, list[float]]):
    """Every hand-over of this thread to a thread that waits for work (``--handoffs``), its thread-CPU seconds
    appended to ``seconds``: ``cpu_lane``, a job given to the CPU lane's worker (``CpuWorker.submit``), and to
    ``cpu_lane_asleep`` too where that woke it (its spin over); ``copy_thread``, background copies that woke the
    copy thread (``CopyEngine._wake_loop`` finding it idle; not its close)."""
    submit, wake, main = CpuWorker.submit, copies.CopyEngine._wake_loop, threading.main_thread()

    def submitted(worker, fn, *args, **kwargs):
        if threading.current_thread() is not main:
            return submit(worker, fn, *args, **kwargs)
        woken_before = worker.wakes
        c0 = time.thread_time()
        job = submit(worker, fn, *args, **kwargs)
        c1 = time.thread_time()
        seconds["cpu_lane"].append(c1 - c0)
        if worker.wakes != woken_before:
            seconds["cpu_lane_asleep"].append(c1 - c0)
        return job

    def woken(engine):
        if not engine._idle or engine._closed or threading.current_thread() is not main:
            return wake(engine)
        c0 = time.thread_time()
        wake(engine)
        seconds["copy_thread"].append(time.thread_time() - c0)

    with mock.patch.object(CpuWorker, "submit", submitted), mock.patch.object(copies.CopyEngine, "_wake_loop", woken):
        yield


def handoffs(setup, devices, run: ExecOptions, store) -> dict:
    """One replay with :func:`timed_handoffs`: per kind, hand-overs per layer visit and their median thread-CPU us
    (nan without any)."""
    seconds: dict[str, list[float]] = {kind: [] for kind in (*HANDOFF_KINDS, "cpu_lane_asleep")}
    with timed_handoffs(seconds):
        result = run_once(setup, devices, run, store)
    visits = result.summary["overhead"]["layer_visits"]
    return {"handoffs_per_visit": {k: len(v) / visits for k, v in seconds.items()},
            "handoff_cpu_us": {k: 1e6 * float(np.median(v)) if v else float("nan") for k, v in seconds.items()}}


def counted_calls(setup, devices, run: ExecOptions, store, top: int) -> dict:
    """One replay with :class:`CallCounter`: calls per layer visit, and the ``top`` most frequent per visit."""
    counter = CallCounter()
    with counter.counting():
        result = run_once(setup, devices, run, store)
    visits = result.summary["overhead"]["layer_visits"]
    ranked = sorted(counter.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return {"calls_per_visit": sum(counter.counts.values()) / visits,
            "top_calls_per_visit": {name: n / visits for name, n in ranked}}


def sync_sites(setup, devices, run: ExecOptions, store) -> dict:
    """One replay under torch's sync debug mode: the synchronizing calls per Python call site, per layer visit,
    most frequent first."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run_once(setup, devices, run, store)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    visits = result.summary["overhead"]["layer_visits"]
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"sync_sites_per_visit": {site: n / visits for site, n in sites.most_common()}}


def run_once(setup, devices, run: ExecOptions, store, closes: list | None = None):
    """One replay; ``closes`` gets the wall seconds its ``close()`` took."""
    replay = Replay(setup, devices, run, store=store)
    try:
        return replay.run()
    finally:
        t0 = time.perf_counter()
        replay.close()
        if closes is not None:
            closes.append(time.perf_counter() - t0)


def measure(trace, system: str, opts: ReplayOptions, run: ExecOptions, batch: int, repeats: int, stores: dict,
            count_calls: int | None = None, whole_visit: bool = False, idle_s: float = 0.0,
            segments: bool = False, syncs: bool = False, handovers: bool = False) -> dict:
    # the runtime's overhead on the whole trace (no profiling split: every sequence is replayed)
    setup = prepare_replay(trace, system, opts, batch_size=batch, profiling=ProfileSpec(share=0.0))
    devices = Devices.create(run.device, opts.dtype)
    key = setup.model.name
    if key not in stores:  # the same random weights for every system of this trace (they are deterministic)
        stores[key] = HostExpertStore.random(setup.model, devices.dtype, 0, pin=devices.is_cuda)
    clock = VisitClock() if whole_visit else None
    runs, visit_medians, closes = [], [], []
    with ExitStack() as stack:
        if clock is not None:
            stack.enter_context(clock.timing())
        if idle_s:  # (entered after the clock, so that its wait follows the visit's end, outside the clock)
            stack.enter_context(idle_after_visits(idle_s))
        run_once(setup, devices, run, stores[key])  # warm-up (allocator, kernels, threads)
        for _ in range(repeats):
            if clock is not None:
                clock.visits.clear()
            runs.append(run_once(setup, devices, run, stores[key], closes))
            if clock is not None:
                visit_medians.append(1e6 * np.median(clock.visits))
    visit = {"visit_cpu_median_us": float(np.median(visit_medians))} if clock is not None else {}
    calls = {} if count_calls is None else counted_calls(setup, devices, run, stores[key], count_calls)
    if segments:
        calls |= timed_segments(setup, devices, run, stores[key])
    if syncs:
        calls |= sync_sites(setup, devices, run, stores[key])
    if handovers:
        calls |= handoffs(setup, devices, run, stores[key])

    def median(key: str) -> float:
        return float(np.median([r.summary["overhead"][key] for r in runs]))

    s = runs[0].summary
    visits = s["overhead"]["layer_visits"]
    overhead_cpu = median("overhead_cpu_us_per_layer")
    overhead_cpu_median = median("overhead_cpu_us_median")  # (the measure: the median visit)
    limit = LIMIT_US.get(system)
    return {
        "system": system, "steps": s["steps"], "layers": setup.model.num_moe_layers,
        "experts_per_layer": s["activated"] / visits,
        "gpu_experts_per_layer": s["gpu_experts"] / visits,
        "layer_us": median("layer_time_us"),
        "decision_us": median("decision_us_per_layer"), "bookkeeping_us": median("bookkeeping_us_per_layer"),
        "overhead_pct": 100 * median("fraction_of_layer_time"),
        "decision_cpu_us": median("decision_cpu_us_per_layer"),
        "bookkeeping_cpu_us": median("bookkeeping_cpu_us_per_layer"),
        "overhead_cpu_us": overhead_cpu,
        "overhead_cpu_median_us": overhead_cpu_median,
        "overhead_cpu_p90_us": median("overhead_cpu_us_p90"),
        **({"prefetching_visits": median("prefetching_visits"),
            "overhead_cpu_median_prefetching_us": median("overhead_cpu_us_median_prefetching"),
            "overhead_cpu_median_other_us": median("overhead_cpu_us_median_other")}
           if "prefetching_visits" in s["overhead"] else {}),
        "overhead_cpu_pct": 100 * median("fraction_cpu_of_layer_time"),
        "plan_only_us": plan_only_us(setup),
        "plan_after_layer_us": plan_only_us(setup, spin_s=1e-6 * median("layer_time_us")),
        "limit_us": limit if limit is not None else float("nan"),
        "ok": "" if limit is None else ("yes" if overhead_cpu_median <= limit else "NO"),
        "decode_tokens_per_s": float(np.median([r.summary["decode_tokens_per_s"] for r in runs])),
        "close_s": float(np.median(closes)),
        **visit,
        **calls,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(REPO / "traces" / "gpt-oss-20b.parquet"))
    ap.add_argument("--systems", default="gpu-lru,fiddler,llamacpp,ktransformers,cpu-only",
                    help="systems on --trace (comma-separated)")
    ap.add_argument("--lookahead-systems", default="dali,dali-plus,mixtral-offloading,hybrimoe",
                    help="systems that need lookahead columns: run on a synthetic trace of the same shape "
                         "(residual 0.9, next-gate 0.7, gate2 0.6, gate3 0.5); '' to skip")
    ap.add_argument("--shape", metavar="PRESET",
                    help="run every system on a synthetic decode trace of this model preset (e.g. qwen3-30b-a3b) "
                         "instead of --trace")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--device", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on the CPU device")
    ap.add_argument("--cpu-threads", type=int)
    ap.add_argument("--spin-us", type=float, default=ExecOptions.spin_us,
                    help="how long the CPU lane's worker spins for its next job before it sleeps "
                         "(`dali exec run --spin-us`)")
    ap.add_argument("--precision", default="bf16",
                    help="the full model's weight format for the memory plan (default bf16, as the tables in "
                         "benchmarks/README.md were measured: at a model's 4-bit default the Qwen3 shape's experts "
                         "all fit the GPU and nothing is staged)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="scale 1/16, 4 layers, 2 sequences x 16 tokens, batch 2 at most, 1 repeat")
    ap.add_argument("--no-tensor-work", action="store_true",
                    help="expert computes, dense blocks and expert copies as no-ops: the host work alone, without "
                         "the caches the tensor work evicts (layer times then mean nothing); CPU device only")
    ap.add_argument("--idle-us", type=float, default=0.0,
                    help="with --no-tensor-work: after each layer visit, a busy wait this long that touches no memory "
                         "(time passing, as while an accelerator computes the layer); default 0")
    ap.add_argument("--count-calls", type=int, nargs="?", const=20, metavar="N",
                    help="also count the calls made while a stopwatch runs, per layer visit, in one more replay of "
                         "each system (calls_per_visit; --json lists the N most frequent, default 20)")
    ap.add_argument("--handoffs", action="store_true",
                    help="also time, in one more replay of each system, every hand-over of the replay's thread to a "
                         "sleeping thread (a job to the CPU lane's worker, background copies that wake the copy thread): "
                         "hand-overs per layer visit and their median thread CPU")
    ap.add_argument("--segments", action="store_true",
                    help="also time each stopwatch segment (named by the function:line where it starts and ends), "
                         "thread CPU per layer visit, in one more replay of each system (printed: the largest five)")
    ap.add_argument("--sync-sites", action="store_true",
                    help="CUDA: also count the calls that made the host wait for the GPU, per call site and layer "
                         "visit, in one more replay of each system under torch's sync debug mode (printed: the "
                         "five most frequent)")
    ap.add_argument("--floor", choices=FLOORS,
                    help="replay with the least host work per visit this design can have: the decision, start_layer "
                         "and the route's compiled call with the lane split (route) or nothing more (none) counted, "
                         "then every routed expert computed from host memory as one grouped call, uncounted; for "
                         "systems that neither prefetch nor swap (CPU device)")
    ap.add_argument("--json", type=Path, help="write every measurement, the machine and the settings here")
    a = ap.parse_args(argv)
    if a.count_calls is not None and a.count_calls < 0:
        ap.error(f"--count-calls {a.count_calls}: must be >= 0")
    if a.idle_us < 0 or (a.idle_us and not a.no_tensor_work):
        ap.error(f"--idle-us {a.idle_us:g}: must be >= 0, and is for --no-tensor-work only (with the tensor work, "
                 "the layer's time passes already)")
    if a.quick:
        a.scale, a.layers, a.sequences, a.max_tokens, a.repeats = 1 / 16, 4, 2, 16, 1
        a.batch_size = min(a.batch_size, a.sequences)  # (the default batch of 4 exceeds the 2 sequences)
    if a.no_tensor_work and (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        # (its no-ops return no CUDA events; there the tensor work runs on the GPU, not on the host's core)
        ap.error("--no-tensor-work is for the CPU device only (give --device cpu)")
    device = resolve_device(a.device)
    if a.floor and device.type != "cpu":
        ap.error("--floor computes every expert from host memory: it is for the CPU device (give --device cpu)")
    if a.sync_sites and device.type != "cuda":
        ap.error("--sync-sites counts CUDA synchronizations: it needs --device cuda")
    dtype = a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    opts = ReplayOptions(layers=a.layers, scale=a.scale, sequences=a.sequences, max_tokens=a.max_tokens, dtype=dtype,
                         precision=a.precision)
    run = ExecOptions(device=str(device), cpu_threads=a.cpu_threads, spin_us=a.spin_us)
    stores: dict = {}
    plain = [n for n in a.systems.split(",") if n]
    look = [n for n in a.lookahead_systems.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp, (no_tensor_work() if a.no_tensor_work else nullcontext()), \
            (floor_visits(a.floor) if a.floor else nullcontext()):
        def synthetic(model: str):
            path = Path(tmp) / f"{model}.parquet"
            synthesize(SynthConfig(model=model, sequences=a.sequences, prompt_len=0, gen_len=a.max_tokens,
                                   seed=1, lookahead=LOOKAHEAD), path)
            return read_trace(path)

        def measured(on, name: str, label: str | None = None) -> dict:
            try:
                row = measure(on, name, opts, run, a.batch_size, a.repeats, stores, a.count_calls,
                              whole_visit=a.no_tensor_work, idle_s=1e-6 * a.idle_us, segments=a.segments,
                              syncs=a.sync_sites, handovers=a.handoffs) | {"system": label or name}
            except FloorRefused as e:
                raise FloorRefused(f"{label or name}: {e}") from None
            if a.floor:  # (not the system's own host work: no limit applies)
                row |= {"limit_us": float("nan"), "ok": ""}
            limit = "no limit" if np.isnan(row["limit_us"]) else f"limit {row['limit_us']:g}"
            # one line as each system ends: a run stopped by a time limit (scripts/gpu_check.sh) keeps those
            split = "" if "prefetching_visits" not in row else (
                f"; the {100 * row['prefetching_visits']:.0f}% of visits that issue prefetches "
                f"{row['overhead_cpu_median_prefetching_us']:.1f}, "
                f"the others {row['overhead_cpu_median_other_us']:.1f}")
            print(f"{row['system']}: {row['overhead_cpu_median_us']:.1f} us decision + bookkeeping (median visit, "
                  f"thread CPU; {limit}{split}), layer {row['layer_us']:.0f} us", flush=True)
            return row

        try:
            if a.shape:
                trace = synthetic(a.shape)
                rows = [measured(trace, name) for name in plain + look]
            else:
                trace = read_trace(a.trace)
                rows = [measured(trace, name) for name in plain]
                if look:
                    synth = synthetic(trace.model.name)
                    rows += [measured(synth, name, f"{name} (synthetic)") for name in look]
        except FloorRefused as e:
            print(f"exec_overhead.py: {e}", file=sys.stderr)
            return 2
    table = pd.DataFrame(rows).set_index("system")
    machine = {"device": str(device), "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"CPU device: {cpu_name()}", "cpu": cpu_name(), "cores": os.cpu_count(),
               "load_average": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version()}
    settings = {k: v for k, v in vars(a).items() if k != "json"} | {"dtype": dtype}
    print(f"machine: {machine}")
    source = f"synthetic {a.shape} trace" if a.shape else Path(a.trace).name
    print(f"replay: {source}, {a.layers} MoE layers at scale {a.scale:g}, {a.sequences} sequences x "
          f"{a.max_tokens} tokens, batch {a.batch_size}, {dtype}; median of {a.repeats} runs per system"
          + ("; NO TENSOR WORK (computes and copies are no-ops: layer times mean nothing)" if a.no_tensor_work else "")
          + (f"; a busy wait of {a.idle_us:g} us after each layer visit" if a.idle_us else "")
          + (f"; FLOOR {a.floor}: the experts' bookkeeping reduced to " + ("the route call" if a.floor == "route" else
                                                                         "nothing") if a.floor else ""))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        shown = PRINTED + [c for c in ("visit_cpu_median_us", "calls_per_visit") if c in table]
        print(table[shown].round(1).to_string())
    for row in rows if a.segments else ():
        top = list(row["segments_us_per_visit"].items())[:5]
        print(f"{row['system']} segments (thread-CPU us per visit): " + "; ".join(f"{n} {us:.1f}" for n, us in top))
    for row in rows if a.handoffs else ():
        print(f"{row['system']} hand-overs to a waiting thread per visit: " + "; ".join(
            f"{kind.replace('_', ' ')} {n:.2f} (median {row['handoff_cpu_us'][kind]:.1f} us thread CPU)"
            for kind, n in row["handoffs_per_visit"].items()))
    for row in rows if a.sync_sites else ():
        top = list(row["sync_sites_per_visit"].items())[:5]
        print(f"{row['system']} synchronizing calls per visit: " + ("; ".join(f"{n} {k:.2f}" for n, k in top) or "none")
              + f"; close {row['close_s']:.2f} s")
    print(f"DALI paper: {100 * PAPER_OVERHEAD:.1f}% scheduling overhead (for comparison)")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "settings": settings, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
