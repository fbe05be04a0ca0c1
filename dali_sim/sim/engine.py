"""The SimPy engine: times each plan on the GPU, the CPU, the PCIe host-to-device link and the host.

Lanes (docs/simulator.md): the accelerator lane (``gpu`` track: dense parts, GPU experts, the LM head;
the ``host`` track, the implementation's own per-layer host work, runs on the same lane, before the
dense part), the CPU lane (``cpu``) and the copy lane (``pcie``, a SimPy priority resource: on-demand
copies before prefetches and cache swaps, non-preemptive), plus ``staging`` (buffers for fetched experts
that are not admitted to the cache). Each lane runs one activity at a time; while several are busy
they may slow each other (:mod:`dali_sim.hardware.contention`, applied by :class:`~.fluid.FluidLanes`).

Per MoE layer: the layer's prefetches start (background copies sharing the link); the host work
runs; the dense part (attention, router, shared experts unless the implementation overlaps them)
runs on the dense device; then the GPU lane and the CPU lane run, in parallel unless the
implementation runs them one after the other. The GPU lane starts with its per-layer overhead (and
the shared experts when they overlap the CPU lane); on-demand copies start in touch order as soon as
routing is known; the GPU computes whichever of its experts has its weights present, first in touch
order, so later copies overlap earlier computes; a prefetched expert still in flight is waited for.
The CPU lane gets its activations, pays its per-layer overhead, runs its experts back to back and
returns its results. The next layer starts when both lanes are done. Cache swaps chosen after a layer
must land before that layer's next visit. A step that the implementation ends with the LM head runs it
on the dense device. Events are coarse: one per activity.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from dali_sim.hardware.cost import CostModel
from dali_sim.runtime.controller import CPU, HIT, PREFETCHED, Controller, LayerPlan
from dali_sim.sim.counters import PlanCounters
from dali_sim.sim import lanes as lane_kernels
from dali_sim.sim.fluid import FluidLanes
from dali_sim.trace.schema import DECODE
from dali_sim.workload.builder import Workload

ON_DEMAND, BACKGROUND = 0, 1  # PCIe priorities (lower first)
TRACKS = ("gpu", "cpu", "pcie", "host")  # the order of SimEngine.busy (and of dali_sim.sim.lanes)
#: the threads a layer visit's host hands work to while they sleep: the CPU lane's worker, the copy thread
HANDOFF_KINDS = ("cpu_lane", "copy_thread")
TRACK_INDEX = {t: i for i, t in enumerate(TRACKS)}
#: the lane of the contention model each track's activities load (the host work runs on the accelerator
#: lane's thread)
LANE_OF_TRACK = {"gpu": "gpu", "cpu": "cpu", "pcie": "h2d", "host": "gpu"}


@dataclass
class Interval:
    track: str
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Activity:
    """What an interval was, formatted into a name only when a timeline is recorded."""

    kind: str  # dense | block | expert | fetch | prefetch | swap | host | lm_head | overhead | shared | handoff
    step: int
    layer: int = -1  # MoE ordinal (block index for kind "block")
    expert: int = -1
    other: int = -1  # the evicted expert of a swap
    tokens: int = 0

    def name(self) -> str:
        if self.kind == "dense":
            return f"dense L{self.layer}"
        if self.kind == "block":
            return f"dense block {self.layer}"
        if self.kind == "expert":
            return f"L{self.layer} E{self.expert}"
        if self.kind == "swap":
            return f"swap L{self.layer} +E{self.expert} -E{self.other}"
        if self.kind == "lm_head":
            return "lm_head"
        if self.kind in ("host", "overhead", "shared", "handoff"):
            return f"{self.kind} L{self.layer}" if self.layer >= 0 else self.kind
        return f"{self.kind} L{self.layer} E{self.expert}"

    def args(self) -> dict:
        a = {"step": self.step}
        if self.kind == "expert":
            a["tokens"] = self.tokens
        elif self.kind in ("fetch", "prefetch", "swap"):
            a["kind"] = "on-demand" if self.kind == "fetch" else self.kind
        return a


@dataclass
class EngineOutput:
    step_start: np.ndarray
    step_end: np.ndarray
    layer_time: np.ndarray  # (L,) seconds spent in each MoE layer (from its start to both lanes done)
    layer_wait: np.ndarray  # (L,) seconds the GPU lane waited for weights
    busy: dict[str, float]  # seconds each track was busy
    events: int  # intervals simulated (dense parts + expert computes + copies + host work)
    intervals: list[Interval]
    slowed: dict[str, float] = field(default_factory=dict)  # seconds each lane lost to contention
    #: hand-overs to a thread asleep on its queue, per HANDOFF_KINDS (empty: not counted)
    handoffs: dict[str, int] = field(default_factory=dict)
    prefetches_waited: int = 0  # prefetches that found no free buffer as their layer visit started


def buffers_at_use(plan: LayerPlan, held: int, slots: int) -> tuple[int, int, int, int]:
    """One layer visit of ``slots`` prefetch buffers that the runtime frees once done with them (dali's executor:
    ``OffloadRuntime.start_layer``, ``run_experts``, ``_accelerator_lane``), ``held`` by earlier prefetches as it
    starts: (how many of its prefetches find a free buffer as it starts, the buffers freed later in it as the cache
    adopts its prefetched experts, those freed once the accelerator lane has computed the ones the cache declined,
    the buffers held at its end). The buffers of its wasted prefetches are free first; its other prefetches wait,
    in order, for the buffers freed later in the visit (the controller counts those free as the plan is made)."""
    prefetched = plan.source == PREFETCHED
    adopted = int(np.count_nonzero(prefetched & plan.admitted))
    declined = int(np.count_nonzero(prefetched)) - adopted
    held -= len(plan.prefetch_wasted)
    if not 0 <= held <= slots or len(plan.prefetches) > slots - held + adopted + declined:
        raise AssertionError(f"step {plan.step} layer {plan.layer}: {len(plan.prefetches)} prefetches, {held} of "
                             f"{slots} buffers held, {adopted + declined} freed in the visit")
    return min(len(plan.prefetches), slots - held), adopted, declined, held + len(plan.prefetches) - adopted - declined


@dataclass
class _CpuLane:
    """The CPU lane of one layer: activations in, per-layer overhead, experts (id, tokens), results out."""

    handoff_in: float
    overhead: float
    experts: list[tuple[int, int]]
    handoff_out: float
    counts: np.ndarray  # the experts' token counts (int64), in lane order


class _GpuSide:
    """The GPU experts of one layer in touch order: their ids and token counts, which take an on-demand copy
    (``fetch``) and whether each would be staged (``staged``, read where ``fetch``), and the prefetched ones'
    arrival events (``arrivals``, touch order: the only events among them until the layer issues its copies).
    The per-expert forms (:meth:`ready`, :meth:`fetches`) are made only where the rules run expert by expert."""

    __slots__ = ("experts", "counts", "fetch", "staged", "arrivals", "n", "n_fetch", "times")

    def __init__(self, experts: np.ndarray, counts: np.ndarray, fetch: np.ndarray, staged: np.ndarray,
                 arrivals: dict):
        self.experts, self.counts, self.fetch, self.staged, self.arrivals = experts, counts, fetch, staged, arrivals
        self.n, self.n_fetch = len(experts), int(np.count_nonzero(fetch))
        self.times: np.ndarray | None = None  # their GPU seconds (SimEngine._gpu_times)

    def ready(self) -> "dict[int, simpy.Event | None]":
        """Expert -> arrival event (None = present: a hit, or a FETCH, whose event the lane adds), touch order."""
        ready = dict.fromkeys(self.experts.tolist())
        ready.update(self.arrivals)  # (existing keys keep their place)
        return ready

    def fetches(self) -> list[tuple[int, bool]]:
        """(expert, staged) of the on-demand copies, touch order."""
        return list(zip(self.experts[self.fetch].tolist(), self.staged[self.fetch].tolist()))


class SimEngine:
    def __init__(self, workload: Workload, controller: Controller, costs: CostModel, counters: PlanCounters,
                 *, dense_device: str = "gpu", staging_slots: int = 1, record: bool = False,
                 shortcut: bool = True, on_step=None):
        self.w, self.ctl, self.costs, self.counters = workload, controller, costs, counters
        self.shortcut = shortcut  # compute layers without interaction directly (same times, fewer SimPy events)
        self.on_step = on_step  # progress callback, called after each step
        self.dense_device = dense_device
        self.record = record
        self.env = simpy.Environment()
        self.pcie = simpy.PriorityResource(self.env, 1)
        self.staging = simpy.Resource(self.env, max(1, staging_slots))
        impl = costs.impl
        decode = workload.step_phase == DECODE
        # per step: the lanes one after the other; shared experts on the GPU lane beside the CPU lane
        self.serial_lanes = np.array([not impl.in_step(impl.lanes_overlap, d) for d in decode])
        shared_lane = np.array([impl.in_step(impl.shared_overlap, d) for d in decode]) & (workload.model.num_shared_experts > 0)
        self.xfer = costs.expert_transfer_time()
        self.copy_demand = costs.copy_demand
        self.gpu_table = costs.expert_time_table("gpu")
        self.cpu_table = costs.expert_time_table("cpu")
        args = (workload.step_tokens, workload.step_context, workload.step_kv)
        self.dense_moe = np.asarray(costs.dense_time(dense_device, *args), dtype=float)
        self.dense_demand = np.asarray(costs.dense_host_demand(dense_device, *args), dtype=float)
        self.shared = None
        if shared_lane.any():
            attn = np.asarray(costs.dense_time(dense_device, *args, shared=False), dtype=float)
            self.dense_moe = np.where(shared_lane, attn, self.dense_moe)
            self.shared = np.where(shared_lane, np.asarray(costs.shared_expert_time("gpu", workload.step_tokens)), 0.0)
        self.dense_block = (np.asarray(costs.dense_block_time(dense_device, *args), dtype=float)
                            if workload.model.num_dense_layers else None)
        self.lanes = FluidLanes(self.env, costs.contention, self._max_demands())
        self.lm_head = None
        if impl.lm_head != "none":
            logits = workload.step_tokens if impl.lm_head == "all" else workload.step_logit_tokens
            self.lm_head = np.asarray(costs.lm_head_time(dense_device, logits), dtype=float)
        self.lane_overhead = {d: costs.lane_overhead(d) for d in ("gpu", "cpu")}
        #: what the CPU lane's call costs more when its worker slept, and whether only beside GPU experts; what
        #: the accelerator lane's call costs more when that worker is woken as it starts (a layer on both lanes)
        #: (indexed by whether the worker sleeps: else it still spins for its next job, ``wait_spin_s``)
        wakes = impl.cpu_lane_wakes != "never"
        self.cpu_wake = tuple(costs.lane_wake("cpu", asleep) if wakes else 0.0 for asleep in (False, True))
        self.gpu_wake = tuple(costs.lane_wake("gpu", asleep) if wakes else 0.0 for asleep in (False, True))
        self.cpu_wake_beside_gpu = impl.cpu_lane_wakes == "beside-gpu"
        #: whether the implementation hands work to threads that sleep between layers (the CPU lane's worker, the
        #: copy thread), what the host pays per hand-over, and how many it made (HANDOFF_KINDS; counted whatever
        #: the profile charges: ``dali exec validate`` compares them with the executor's)
        self.hands_over = impl.cpu_lane_wakes != "never"
        self.handoff = tuple(costs.handoff_time(asleep) if self.hands_over else 0.0 for asleep in (False, True))
        #: how long the CPU lane's worker spins for its next job before it sleeps (``wait_spin_s``): a hand-over
        #: within that time of its last job's end wakes nothing and pays the profile's ``*_spinning`` costs instead
        self.spin = impl.wait_spin_s
        self.worker_free = -math.inf  # when the worker's last job ended
        self.handoffs = dict.fromkeys(HANDOFF_KINDS, 0)
        #: a dense part or block on the CPU is a CPU-lane call with no GPU expert beside it: handed to the worker
        #: (and paying its wake) where such a call is (cpu_lane_wakes "always"), inline with "beside-gpu"
        self.dense_handed = dense_device == "cpu" and self._hands_cpu_lane(beside_gpu=False)
        #: prefetch buffers freed only once the runtime is done with them (``prefetch_buffers`` not ``at-plan``): the
        #: buffers held by prefetches issued and not yet adopted or released, as seen between layer visits
        self.buffers = impl.prefetch_buffers
        self.prefetch_held = 0
        self.prefetches_waited = 0
        self.waits_all = impl.compute_waits_copies
        # calls on what has landed: the GPU lane's fixed part per group of experts present when one starts
        self.per_group = self.lane_overhead["gpu"] if impl.gpu_calls == "landed" else 0.0
        self.writeback = impl.evict_writeback
        self.counts_launches = impl.host == "launches"
        # steps replayed from a CUDA graph (no per-kernel launch cost on the host)
        fully_resident = bool((controller.capacities == workload.num_experts).all())
        if impl.cuda_graphs == "decode":
            self.graph_steps = workload.step_phase == DECODE
        elif impl.cuda_graphs == "full-gpu" and fully_resident:
            self.graph_steps = workload.step_tokens == 1
        else:
            self.graph_steps = np.zeros(workload.num_steps, bool)
        L = workload.num_layers
        self.layer_time = np.zeros(L)
        self.layer_wait = np.zeros(L)
        self.busy = np.zeros(len(TRACKS))  # seconds each track was busy, TRACKS order
        # the direct lane rules compiled (same results, no timeline): dali_sim.sim.lanes
        self.kernels = None if record else lane_kernels.compiled()
        self.events = 0
        self.intervals: list[Interval] = []
        self.arrivals: dict[tuple[int, int], simpy.Event] = {}
        self.swaps_landing: dict[int, list[simpy.Event]] = {}
        self.background_open = 0  # background copies issued and not yet landed (started or not)

    def _max_demands(self) -> dict[str, float] | None:
        """The largest host-memory demand any activity of this run draws on each lane: the dense parts on the
        dense device's lane, CPU experts (at most a step's tokens each) on the CPU lane, copies on the link;
        everything else draws none. None (not worked out) for steps beyond the cost model's lookup table."""
        w = self.w
        tokens = int(w.step_tokens.max()) if w.num_steps else 0
        if tokens > self.costs.lookup_tokens:
            return None
        cpu = max(self.costs.host_demand("cpu", n) for n in range(tokens + 1))
        dense = float(self.dense_demand.max()) if self.dense_demand.size else 0.0
        out = {"gpu": 0.0, "cpu": float(cpu), "h2d": float(self.copy_demand)}
        out[self.dense_device] = max(out[self.dense_device], dense)
        return out

    # ---- primitives ---------------------------------------------------------------------------
    def _log(self, track: str, start: float, end: float, what: Activity) -> None:
        self.busy[TRACK_INDEX[track]] += end - start
        self.events += 1
        if self.record:
            self.intervals.append(Interval(track, what.name(), start, end, what.args()))

    def _log_layer(self, track: str, start: float, end: float, kind: str, plan: LayerPlan) -> None:
        """``_log`` of a layer's activity (``Activity(kind, step, layer)``), built only when a timeline is recorded."""
        self.busy[TRACK_INDEX[track]] += end - start
        self.events += 1
        if self.record:
            what = Activity(kind, plan.step, plan.layer)
            self.intervals.append(Interval(track, what.name(), start, end, what.args()))

    def _log_expert(self, track: str, start: float, end: float, kind: str, plan: LayerPlan, e: int,
                    tokens: int = 0) -> None:
        """``_log`` for the hot path: the Activity is built only when a timeline is recorded."""
        self.busy[TRACK_INDEX[track]] += end - start
        self.events += 1
        if self.record:
            what = Activity(kind, plan.step, plan.layer, e, tokens=tokens)
            self.intervals.append(Interval(track, what.name(), start, end, what.args()))

    def _expert_time(self, device: str, n: int) -> float:
        table = self.gpu_table if device == "gpu" else self.cpu_table
        return float(table[n]) if n < len(table) else float(self.costs.expert_time(device, n))

    def _gpu_times(self, gpu: _GpuSide) -> np.ndarray:
        """:meth:`_expert_times` of a layer's GPU experts, made once per layer."""
        if gpu.times is None:
            gpu.times = self._expert_times("gpu", gpu.counts.astype(np.int64))
        return gpu.times

    def _expert_times(self, device: str, counts: np.ndarray) -> np.ndarray:
        """:meth:`_expert_time` of each of ``counts`` (the same values)."""
        table = self.gpu_table if device == "gpu" else self.cpu_table
        if counts.size and int(counts.max()) >= len(table):
            return np.array([self._expert_time(device, n) for n in counts.tolist()])
        return table[counts]

    def _compute(self, track: str, duration: float, what: Activity, demand: float = 0.0):
        """One activity of ``duration`` seconds (alone) on ``track``, slowed while other lanes contend."""
        if duration <= 0:
            return
        start = self.env.now
        yield self.lanes.run(LANE_OF_TRACK[track], duration, demand)
        self._log(track, start, self.env.now, what)

    def _copy(self):
        return self.lanes.run("h2d", self.xfer, self.copy_demand)

    def _background(self, what: Activity) -> simpy.Event:
        """A prefetch or swap copy at background priority; the event fires when it has landed."""
        done = self.env.event()
        self.background_open += 1

        def copy():
            with self.pcie.request(priority=BACKGROUND) as req:
                yield req
                start = self.env.now
                yield self._copy()
                self._log("pcie", start, self.env.now, what)
            self.background_open -= 1
            done.succeed()

        self.env.process(copy())
        return done

    # ---- lanes --------------------------------------------------------------------------------
    def _on_demand(self, plan: LayerPlan, fetches: list, staging: dict[int, object], signal: list,
                   unstaged: list[int]):
        """Copies of FETCH experts in touch order, holding the link between consecutive copies (on-demand
        first: a queued prefetch never slips in between); a staged one first takes a staging buffer,
        and while it waits for one the link is released for background copies. ``unstaged[0]``: staged
        copies that have no buffer yet."""
        link = None
        if self.writeback and plan.evicted:  # evicted experts go back to the host first, on the same link
            link = self.pcie.request(priority=ON_DEMAND)
            yield link
            for e in plan.evicted:
                start = self.env.now
                yield self._copy()
                self._log_expert("pcie", start, self.env.now, "writeback", plan, e)
        for e, staged, done in fetches:
            if staged:
                if self.staging.count >= self.staging.capacity and link is not None:
                    self.pcie.release(link)
                    link = None
                req = self.staging.request()
                yield req
                staging[e] = req
                unstaged[0] -= 1
            if link is None:
                link = self.pcie.request(priority=ON_DEMAND)
                yield link
            start = self.env.now
            yield self._copy()
            self._log_expert("pcie", start, self.env.now, "fetch", plan, e)
            done.succeed()
            if not signal[0].triggered:
                signal[0].succeed()
        if link is not None:
            self.pcie.release(link)

    def _cpu_work(self, plan: LayerPlan, handed: bool, asleep: bool) -> _CpuLane | None:
        """The layer's CPU lane (None: no CPU expert); ``handed`` to the worker, which sleeps (``asleep``: its call
        pays ``lane_wake.cpu``) or still spins (``lane_wake.cpu_spinning``)."""
        on_cpu = plan.source == CPU
        if not on_cpu.any():
            return None
        counts = plan.counts[on_cpu].astype(np.int64)
        experts = list(zip(plan.experts[on_cpu].tolist(), counts.tolist()))
        off_dense = self.dense_device != "cpu"  # the lane's activations live on the dense device
        pairs = int(counts.sum())
        overhead = self.lane_overhead["cpu"] + (self.cpu_wake[asleep] if handed else 0.0)
        return _CpuLane(self.costs.activation_copy_time(plan.tokens) if off_dense else 0.0, overhead,
                        experts, self.costs.activation_copy_time(pairs) if off_dense else 0.0, counts)

    def _hands_cpu_lane(self, beside_gpu: bool) -> bool:
        """Is a CPU-lane call (``beside_gpu``: with GPU experts in the same layer) handed to the lane's worker
        (``cpu_lane_wakes``; waking it where it sleeps: :meth:`_worker_asleep`)? Else it runs inline or nothing
        sleeps."""
        return self.hands_over and (beside_gpu or not self.cpu_wake_beside_gpu)

    def _worker_asleep(self) -> bool:
        """Does the CPU lane's worker sleep now: it spins for no time, or it has waited longer than its spin since
        its last job ended? (A Python bool: it indexes the costs by state, and the clock can be a NumPy float.)"""
        return bool(self.spin <= 0 or self.env.now - self.worker_free > self.spin)

    def _cpu_handoff(self, handed: bool, asleep: bool) -> float:
        """Host seconds of handing a CPU-lane call to the lane's worker (``handed``: :meth:`_hands_cpu_lane`; counted
        in ``handoffs``): ``lane_wake.host`` where that wakes it (``asleep``), else ``lane_wake.host_spinning``."""
        if not handed:
            return 0.0
        self.handoffs["cpu_lane"] += 1
        return self.handoff[asleep]

    def _copy_request(self, asleep: bool) -> float:
        """Host seconds of handing one request of background copies (a visit's prefetches, those that waited for
        a buffer, its swaps) to the copy thread: ``handoff`` where the thread sleeps (``asleep``: no background copy
        in flight as the request is made; counted in ``handoffs``), else 0."""
        if not (self.hands_over and asleep):
            return 0.0
        self.handoffs["copy_thread"] += 1
        return self.handoff[True]

    def _prefetch_buffers(self, plan: LayerPlan) -> tuple[list, list, int]:
        """The visit's prefetches split into (those that start with it, those that wait for a buffer), and the
        buffers that free up for the waiting ones after its dense part (the others wait for its accelerator
        lane). All start with it where the plan frees the buffers (``prefetch_buffers = "at-plan"``); else
        (:func:`buffers_at_use`) those that find a free one, and with ``at-use`` also those the buffers of the
        prefetched experts the cache adopts take (the runtime adopts them as it groups the routing, while the
        dense part is queued). ``prefetches_waited`` counts those that find none free as the visit starts."""
        prefetches = plan.prefetches
        if self.buffers == "at-plan" or (not prefetches and not plan.prefetch_used and not plan.prefetch_wasted):
            return prefetches, [], 0
        start, adopted, _, self.prefetch_held = buffers_at_use(plan, self.prefetch_held, self.ctl.prefetch_slots)
        self.prefetches_waited += len(prefetches) - start
        if self.buffers == "at-use":
            start, adopted = min(len(prefetches), start + adopted), 0
        return prefetches[:start], prefetches[start:], adopted

    def _release_request(self, gpu: _GpuSide):
        """``prefetch_buffers = "at-use"``: the request of the prefetches still waiting once the cache's adoptions
        freed their buffers, made as the runtime's host has issued the accelerator lane, after its waits for the
        layer's prefetched experts to land: a hand-over where the copy thread then sleeps (counted; its host time
        is hidden behind the lane's device work). Their copies follow the computes of the experts whose buffers they
        take (:meth:`_gpu_lane`'s ``release``)."""
        landing = [ev for ev in gpu.arrivals.values() if not ev.triggered]
        if landing:
            yield self.env.all_of(landing)
        self._copy_request(not self.background_open)

    def _issue(self, plan: LayerPlan, prefetches: list) -> None:
        """Background copies of ``prefetches`` ((target layer, expert)), their arrivals kept for the target layer."""
        for target, e in prefetches:
            self.arrivals[(target, e)] = self._background(Activity("prefetch", plan.step, target, e))

    def _start_waiting(self, plan: LayerPlan, waiting: list, free: int):
        """SimPy: the first ``free`` of the prefetches that wait for a buffer start now, as one request (its
        hand-over to the copy thread, where no background copy is in flight, paid by the host first); returns
        the others."""
        now, rest = waiting[:free], waiting[free:]
        if now:
            yield from self._compute("host", self._copy_request(not self.background_open),
                                     Activity("host", plan.step, plan.layer))
            self._issue(plan, now)
        return rest

    def _gpu_prologue(self, plan: LayerPlan, n_gpu: int, handed: bool, asleep: bool) -> list[tuple[float, str]]:
        """What the GPU lane runs before its experts, as (seconds, activity kind): activations in (dense part on
        the CPU), the per-layer overhead, the CPU lane handed to its worker beside it (``handed``; the worker
        ``asleep`` or still spinning: ``lane_wake.gpu`` or ``lane_wake.gpu_spinning``), the shared experts (when
        they overlap the CPU lane)."""
        out = []
        if n_gpu and self.dense_device == "cpu":
            out.append((self.costs.activation_copy_time(plan.tokens), "handoff"))
        if n_gpu and not self.per_group:  # else paid per call on what has landed (_gpu_lane, _gpu_lane_end)
            out.append((self.lane_overhead["gpu"], "overhead"))
        if n_gpu and handed:
            out.append((self.gpu_wake[asleep], "overhead"))
        if self.shared is not None:
            out.append((float(self.shared[plan.step]), "shared"))
        return [(d, kind) for d, kind in out if d > 0]

    def _gpu_epilogue(self, plan: LayerPlan, gpu: _GpuSide) -> float:
        """Results back to the dense device when it is the CPU (MoE-Lightning)."""
        if self.dense_device != "cpu" or not gpu.n:
            return 0.0
        return self.costs.activation_copy_time(int(gpu.counts.sum()))

    def _cpu_lane_end(self, plan: LayerPlan, lane: _CpuLane | None, t: float) -> float:
        """The CPU lane computed directly (no contention can change it): everything back to back from ``t``."""
        if lane is None:
            return t
        for d, kind in ((lane.handoff_in, "handoff"), (lane.overhead, "overhead")):
            if d > 0:
                self._log_layer("cpu", t, t + d, kind, plan)
                t += d
        if self.kernels is not None:  # the experts' loop compiled (no timeline)
            t = float(self.kernels[0](t, self._expert_times("cpu", lane.counts), self.busy))
            self.events += len(lane.counts)
        else:
            for e, n in lane.experts:
                d = self._expert_time("cpu", n)
                self._log_expert("cpu", t, t + d, "expert", plan, e, n)
                t += d
        if lane.handoff_out > 0:
            self._log_layer("cpu", t, t + lane.handoff_out, "handoff", plan)
            t += lane.handoff_out
        return t

    def _cpu_lane(self, plan: LayerPlan, lane: _CpuLane, handed: bool):
        """The CPU lane as SimPy activities (rates may change while it runs); ``handed``: on the worker."""
        yield from self._compute("cpu", lane.handoff_in, Activity("handoff", plan.step, plan.layer))
        yield from self._compute("cpu", lane.overhead, Activity("overhead", plan.step, plan.layer))
        for e, n in lane.experts:
            start = self.env.now
            yield self.lanes.run("cpu", self._expert_time("cpu", n), self.costs.host_demand("cpu", n))
            self._log_expert("cpu", start, self.env.now, "expert", plan, e, n)
        yield from self._compute("cpu", lane.handoff_out, Activity("handoff", plan.step, plan.layer))
        if handed:
            self.worker_free = self.env.now

    def _gpu_sources(self, plan: LayerPlan) -> _GpuSide:
        """The layer's GPU experts, the prefetched ones' arrivals taken (:class:`_GpuSide`)."""
        on_gpu = plan.on_gpu
        experts = plan.experts[on_gpu]
        source = plan.source[on_gpu]
        layer, arrivals = plan.layer, self.arrivals
        landing = {e: arrivals.pop((layer, e)) for e in experts[source == PREFETCHED].tolist()}
        return _GpuSide(experts, plan.counts[on_gpu], (source != HIT) & (source != PREFETCHED), plan.staged[on_gpu],
                        landing)

    @staticmethod
    def _workloads(plan: LayerPlan) -> dict[int, int]:
        """Each activated expert's workload (for the per-expert rules; the compiled lanes read the plan's arrays)."""
        return dict(zip(plan.experts.tolist(), plan.counts.tolist()))

    def _gpu_compute(self, plan: LayerPlan, e: int, n: int):
        start = self.env.now
        yield self.lanes.run("gpu", self._expert_time("gpu", n), 0.0)
        self._log_expert("gpu", start, self.env.now, "expert", plan, e, n)

    def _gpu_lane(self, plan: LayerPlan, gpu: _GpuSide, counts, prologue, release=None):
        """Event-by-event GPU lane (the link may be contended, rates may change); ``release()`` is called once it
        has computed every prefetched expert (their buffers free: ``prefetch_buffers = "at-use"``)."""
        env = self.env
        holding = set(gpu.arrivals) if release is not None else None  # prefetched experts not yet computed
        ready, fetches = gpu.ready(), gpu.fetches()
        events = [(e, staged, env.event()) for e, staged in fetches]
        for e, _, ev in events:
            ready[e] = ev
        staging: dict[int, object] = {}
        signal = [env.event()]  # fires when any of this layer's copies lands; re-armed after each wait
        unstaged = [sum(1 for _, staged in fetches if staged)]  # staged copies without a buffer yet

        def all_can_start() -> bool:  # no copy left waits for a staging buffer (only a release changes it)
            return unstaged[0] <= self.staging.capacity - self.staging.count

        copying = None
        if events or (self.writeback and plan.evicted):
            copying = env.process(self._on_demand(plan, events, staging, signal, unstaged))
        for d, kind in prologue:
            yield from self._compute("gpu", d, Activity(kind, plan.step, plan.layer))
        own = {id(ev) for _, _, ev in events}
        remaining = list(ready)  # touch order
        waited_all = not self.waits_all
        group_left = 0  # experts left in the current call on what has landed (gpu_calls = landed)
        while remaining:
            if not waited_all and all_can_start():
                # a grouped launch needs every expert's weights: once no copy waits for a staging buffer,
                # wait for all of them; until then what is present runs, freeing its staging buffer (as
                # the direct path: _gpu_lane_end)
                waited_all = True
                pending = [ev for ev in ready.values() if ev is not None and not ev.triggered]
                if copying is not None:
                    pending.append(copying)  # the write-backs too
                if pending:
                    start = env.now
                    yield env.all_of(pending)
                    self.layer_wait[plan.layer] += env.now - start
                continue
            e = next((x for x in remaining if ready[x] is None or ready[x].triggered), None)
            if e is None:
                start = env.now
                prefetched = [ready[x] for x in remaining if id(ready[x]) not in own and not ready[x].triggered]
                yield env.any_of(prefetched + [signal[0]]) if prefetched else signal[0]
                if signal[0].triggered:
                    signal[0] = env.event()
                self.layer_wait[plan.layer] += env.now - start
                continue
            if self.per_group and not group_left:
                group_left = sum(1 for x in remaining if ready[x] is None or ready[x].triggered)
                yield from self._compute("gpu", self.per_group, Activity("overhead", plan.step, plan.layer))
            group_left -= 1
            remaining.remove(e)
            yield from self._gpu_compute(plan, e, counts[e])
            if e in staging:
                self.staging.release(staging.pop(e))
            if holding:
                holding.discard(e)
                if not holding:
                    release()
        yield from self._compute("gpu", self._gpu_epilogue(plan, gpu), Activity("handoff", plan.step, plan.layer))

    def _uncontended(self, arrivals) -> bool:
        """True when this layer's copies cannot meet any other copy: no background copy is open (issued
        and not landed, including ones whose process has not started yet), the link is idle (no other
        copy can be issued before the layer ends) and every prefetched expert has arrived (``arrivals``:
        their events, :meth:`_gpu_sources`)."""
        if not self.shortcut or self.background_open or self.pcie.count or self.pcie.queue:
            return False
        return all(ev.triggered for ev in arrivals)

    def _interferes(self, plan: LayerPlan, cpu: _CpuLane | None, fetches: bool, step: int) -> bool:
        """Could this layer's own activities slow each other (the lanes' largest demands together)? ``fetches``:
        whether the layer makes on-demand copies."""
        if self.lanes.contention is None:
            return False
        busy = {"gpu": 0.0}
        if self.dense_device == "cpu":
            busy["cpu"] = float(self.dense_demand[step])
        if cpu is not None:
            demand = max(self.costs.host_demand("cpu", n) for n in set(cpu.counts.tolist()))
            busy["cpu"] = max(busy.get("cpu", 0.0), demand)
        if fetches:
            busy["h2d"] = self.copy_demand
        return self.lanes.would_interfere(busy)

    def _gpu_lane_end(self, plan: LayerPlan, link_t: float, t: float, order: list[int], counts: dict[int, int],
                      fetches: list[tuple[int, bool]]) -> float:
        """The event-by-event rules computed directly: copies back to back in touch order from ``link_t``,
        a staged one starting only when a staging buffer is free (buffers free up when their expert's
        GPU compute ends); from ``t`` the GPU runs, in touch order, the first expert whose weights are
        present, else waits for the next arrival. Returns the lane's end."""
        if self.writeback:
            for e in plan.evicted:
                self._log_expert("pcie", link_t, link_t + self.xfer, "writeback", plan, e)
                link_t += self.xfer
            if self.waits_all:
                t = max(t, link_t)
        rank = {e: i for i, e in enumerate(order)}
        fetched = {e for e, _ in fetches}
        present = [rank[e] for e in order if e not in fetched]  # heap of touch positions
        heapq.heapify(present)
        landed: list[tuple[float, int]] = []  # (arrival, touch position) of started copies, in time order
        staged_of = dict(fetches)
        free = self.staging.capacity - self.staging.count
        releases: list[float] = []  # buffer release times known so far (all <= the GPU's time)
        ci, li = 0, 0
        left = len(order)
        group_left = 0
        while left:
            while ci < len(fetches):  # start every copy whose start time is known
                e, staged = fetches[ci]
                start = link_t
                if staged:
                    if free == 0:
                        if not releases:
                            break
                        start = max(start, releases.pop(0))
                        free += 1
                    free -= 1
                self._log_expert("pcie", start, start + self.xfer, "fetch", plan, e)
                link_t = start + self.xfer
                landed.append((link_t, rank[e]))
                ci += 1
            if self.waits_all and ci == len(fetches) and landed:
                t = max(t, landed[-1][0])  # a grouped launch needs every expert's weights
            while li < len(landed) and landed[li][0] <= t:
                heapq.heappush(present, landed[li][1])
                li += 1
            if not present:
                if li == len(landed):
                    raise AssertionError("direct GPU lane: no expert can ever arrive")
                self.layer_wait[plan.layer] += landed[li][0] - t
                t = landed[li][0]
                continue
            if self.per_group and not group_left:  # a call on every expert present now
                group_left = len(present)
                self._log("gpu", t, t + self.per_group, Activity("overhead", plan.step, plan.layer))
                t += self.per_group
                while li < len(landed) and landed[li][0] <= t:  # what lands during the call's fixed part waits
                    heapq.heappush(present, landed[li][1])
                    li += 1
            group_left -= 1
            e = order[heapq.heappop(present)]
            left -= 1
            d = self._expert_time("gpu", counts[e])
            self._log_expert("gpu", t, t + d, "expert", plan, e, counts[e])
            t += d
            if staged_of.get(e):
                releases.append(t)
        return t

    def _gpu_lane_end_compiled(self, plan: LayerPlan, gpu: _GpuSide, link_t: float, t: float) -> float:
        """:meth:`_gpu_lane_end` compiled (no timeline), from the GPU side's arrays."""
        t, events, ok = self.kernels[1](
            link_t, t, self._gpu_times(gpu), gpu.fetch, gpu.staged & gpu.fetch,
            self.staging.capacity - self.staging.count, self.xfer, self.per_group, self.writeback,
            len(plan.evicted) if self.writeback else 0, self.waits_all, self.busy, self.layer_wait, plan.layer)
        if not ok:
            raise AssertionError("direct GPU lane: no expert can ever arrive")
        self.events += events
        return float(t)

    def _direct_gpu_lane(self, plan: LayerPlan, start: float, gpu: _GpuSide, prologue) -> float:
        t = start
        for d, kind in prologue:
            self._log_layer("gpu", t, t + d, kind, plan)
            t += d
        if gpu.n and self.kernels is not None:
            t = self._gpu_lane_end_compiled(plan, gpu, start, t)
        elif gpu.n:
            t = self._gpu_lane_end(plan, start, t, gpu.experts.tolist(), self._workloads(plan), gpu.fetches())
        tail = self._gpu_epilogue(plan, gpu)
        if tail > 0:
            self._log_layer("gpu", t, t + tail, "handoff", plan)
            t += tail
        return t

    # ---- steps --------------------------------------------------------------------------------
    def _layer(self, step: int, layer: int):
        env = self.env
        start = env.now
        for ev in self.swaps_landing.pop(layer, []):
            if not ev.triggered:
                yield ev
        plan = self.ctl.plan(step, layer)
        self.counters.add(plan)
        copies_asleep = not self.background_open  # (the copy thread sleeps: no background copy in flight)
        starting, waiting, adopted = self._prefetch_buffers(plan)
        self._issue(plan, starting)
        for e in plan.prefetch_wasted:
            self.arrivals.pop((layer, e), None)
        gpu = self._gpu_sources(plan)
        # the hand-overs before the lanes (the dense part on the CPU, the CPU lane to the worker): each wakes the
        # worker where it sleeps; the CPU lane's follows the dense part's, which the worker then runs (awake)
        dense_asleep = self._worker_asleep()
        hands = self._hands_cpu_lane(gpu.n > 0)
        lane_asleep = self.spin <= 0 or (not self.dense_handed and dense_asleep)
        cpu = self._cpu_work(plan, hands, lane_asleep)
        lane_handed = cpu is not None and hands
        dense = float(self.dense_moe[step]) + (self.cpu_wake[dense_asleep] if self.dense_handed else 0.0)
        prologue = self._gpu_prologue(plan, gpu.n, lane_handed, lane_asleep)
        device_s = 0.0
        if self.counts_launches:  # the GPU work the layer's launches start (a launch-bound layer takes longer)
            times = self._gpu_times(gpu)
            # np.add.accumulate adds left to right, as sum() over the experts in touch order did
            experts_s = float(np.add.accumulate(times)[-1]) if times.size else 0
            device_s = (dense if self.dense_device == "gpu" else 0.0) + sum(d for d, _ in prologue) + experts_s
        copies = gpu.n_fetch + len(plan.prefetches) + len(plan.swaps)  # every copy is issued by the host
        host = self.costs.host_layer_time(gpu.n, len(cpu.experts) if cpu else 0, copies, device_s=device_s,
                                          graph=bool(self.graph_steps[step]), dense_on_gpu=self.dense_device == "gpu")
        # the hand-overs before the lanes and the prefetches starting now
        host += (self._cpu_handoff(self.dense_handed, dense_asleep) + self._cpu_handoff(lane_handed, lane_asleep)
                 + self._copy_request(bool(starting) and copies_asleep))
        if not waiting and self._uncontended(gpu.arrivals.values()) and \
                not self._interferes(plan, cpu, gpu.n_fetch > 0, step):
            # nothing can change while the layer runs: the whole layer is computed directly
            now = env.now
            if host > 0:
                self._log_layer("host", now, now + host, "host", plan)
            t = now + host
            self._log_layer(self.dense_device, t, t + dense, "dense", plan)
            lanes = t + dense
            cpu_end = self._cpu_lane_end(plan, cpu, lanes)
            if self.dense_handed or lane_handed:
                self.worker_free = cpu_end if lane_handed else lanes
            gpu_end = self._direct_gpu_lane(plan, cpu_end if self.serial_lanes[step] else lanes, gpu, prologue)
            end = max(cpu_end, gpu_end)
            swap = self._copy_request(bool(plan.swaps) and not self.background_open)  # (the swaps' request)
            if swap:
                self._log_layer("host", end, end + swap, "host", plan)
            yield env.timeout(end + swap - now)
        else:
            yield from self._compute("host", host, Activity("host", step, layer))
            yield from self._compute(self.dense_device, dense, Activity("dense", step, layer),
                                     float(self.dense_demand[step]))
            if self.dense_handed:
                self.worker_free = env.now
            if waiting and adopted:  # in-order: the adopted experts' buffers are free once the routing is grouped
                waiting = yield from self._start_waiting(plan, waiting, adopted)
            cpu_proc = env.process(self._cpu_lane(plan, cpu, lane_handed)) if cpu is not None else None
            if self.serial_lanes[step] and cpu_proc is not None:
                yield cpu_proc
                cpu_proc = None
            release = None
            if waiting and self.buffers == "at-use":  # the rest as the lane has computed the declined ones
                env.process(self._release_request(gpu))
                release = functools.partial(self._issue, plan, waiting)
            yield from self._gpu_lane(plan, gpu, self._workloads(plan), prologue, release)
            if waiting and release is None:  # in-order: the rest after the lane (buffers_at_use: they fit)
                yield from self._start_waiting(plan, waiting, len(waiting))
            if cpu_proc is not None:
                yield cpu_proc
            swap = self._copy_request(bool(plan.swaps) and not self.background_open)  # (the swaps' request)
            yield from self._compute("host", swap, Activity("host", step, layer))
        if plan.swaps:
            self.swaps_landing[layer] = [self._background(Activity("swap", step, layer, a, other=b))
                                         for a, b in plan.swaps]
        self.layer_time[layer] += env.now - start

    def _run(self, out: dict):
        w = self.w
        moe_blocks = set(w.model.moe_layers)
        starts, ends = np.zeros(w.num_steps), np.zeros(w.num_steps)
        demand = self.dense_demand
        for step in range(w.num_steps):
            starts[step] = self.env.now
            layer = 0
            for block in range(w.model.num_layers):
                if block in moe_blocks:
                    yield from self._layer(step, layer)
                    layer += 1
                else:
                    asleep = self._worker_asleep()
                    if self.dense_handed:  # (handed to the lane's worker as a layer's dense part is: host work)
                        yield from self._compute("host", self._cpu_handoff(True, asleep), Activity("host", step))
                    wake = self.cpu_wake[asleep] if self.dense_handed else 0.0
                    yield from self._compute(self.dense_device, self.dense_block[step] + wake,
                                             Activity("block", step, block), float(demand[step]))
                    if self.dense_handed:
                        self.worker_free = self.env.now
            if self.lm_head is not None:
                yield from self._compute(self.dense_device, float(self.lm_head[step]), Activity("lm_head", step))
            ends[step] = self.env.now
            if self.on_step:
                self.on_step()
        out["starts"], out["ends"] = starts, ends

    def run(self) -> EngineOutput:
        out: dict = {}
        self.env.process(self._run(out))
        self.env.run()
        # background copies may still run after the last layer: the makespan is the last step's end
        busy = dict(zip(TRACKS, self.busy.tolist()))
        return EngineOutput(out["starts"], out["ends"], self.layer_time, self.layer_wait, busy, self.events,
                            self.intervals, dict(self.lanes.slowed_s), dict(self.handoffs), self.prefetches_waited)
