"""The SimPy engine: times each plan on GPU, CPU and the PCIe host-to-device link.

Resources: ``gpu`` and ``cpu`` (one expert or dense part at a time each; the CPU runs one expert with
all its cores; each has one user at a time by construction, so they are timed directly), ``pcie`` (a
SimPy priority resource: on-demand copies before prefetches and cache swaps, non-preemptive),
``staging`` (a SimPy resource: buffers for fetched experts that are not admitted to the cache).

Per MoE layer: the layer's prefetches start (they share the link and run in the background); the
dense part (attention, router, shared experts) runs on the dense device; then the GPU lane and the
CPU lane run in parallel. On-demand copies start in touch order as soon as routing is known; the GPU
lane computes whichever of its experts has its weights present, first in touch order, so later
copies overlap earlier computes; a prefetched expert still in flight is waited for. The next layer
starts when both lanes are done. Cache swaps chosen after a layer must land before that layer's next
visit. Events are coarse: one per dense part, expert compute and copy.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import simpy

from dali_sim.hardware.cost import CostModel
from dali_sim.runtime.controller import CPU, HIT, PREFETCHED, Controller, LayerPlan
from dali_sim.sim.counters import PlanCounters
from dali_sim.workload.builder import Workload

ON_DEMAND, BACKGROUND = 0, 1  # PCIe priorities (lower first)
TRACKS = ("gpu", "cpu", "pcie")


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

    kind: str  # dense | block | expert | fetch | prefetch | swap
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
    events: int  # intervals simulated (dense parts + expert computes + copies)
    intervals: list[Interval]


class SimEngine:
    def __init__(self, workload: Workload, controller: Controller, costs: CostModel, counters: PlanCounters,
                 *, dense_device: str = "gpu", staging_slots: int = 1, record: bool = False,
                 shortcut: bool = True, on_step=None):
        self.w, self.ctl, self.costs, self.counters = workload, controller, costs, counters
        self.shortcut = shortcut  # compute uncontended layers directly (same times, fewer SimPy events)
        self.on_step = on_step  # progress callback, called after each step
        self.dense_device = dense_device
        self.record = record
        self.env = simpy.Environment()
        # GPU and CPU have one user at a time by construction (the layer's dense part, then one lane
        # each), so they are timed directly; only the link is contended (on-demand vs background).
        self.pcie = simpy.PriorityResource(self.env, 1)
        self.staging = simpy.Resource(self.env, max(1, staging_slots))
        self.xfer = costs.expert_transfer_time()
        self.gpu_table = costs.expert_time_table("gpu")
        self.cpu_table = costs.expert_time_table("cpu")
        args = (workload.step_tokens, workload.step_context, workload.step_kv)
        self.dense_moe = np.asarray(costs.dense_time(dense_device, *args), dtype=float)
        self.dense_block = (np.asarray(costs.dense_block_time(dense_device, *args), dtype=float)
                            if workload.model.num_dense_layers else None)
        L = workload.num_layers
        self.layer_time = np.zeros(L)
        self.layer_wait = np.zeros(L)
        self.busy = dict.fromkeys(TRACKS, 0.0)
        self.events = 0
        self.intervals: list[Interval] = []
        self.arrivals: dict[tuple[int, int], simpy.Event] = {}
        self.swaps_landing: dict[int, list[simpy.Event]] = {}
        self.background_open = 0  # background copies issued and not yet landed (started or not)

    # ---- primitives ---------------------------------------------------------------------------
    def _log(self, track: str, start: float, end: float, what: Activity) -> None:
        self.busy[track] += end - start
        self.events += 1
        if self.record:
            self.intervals.append(Interval(track, what.name(), start, end, what.args()))

    def _log_expert(self, track: str, start: float, end: float, kind: str, plan: LayerPlan, e: int,
                    tokens: int = 0) -> None:
        """``_log`` for the hot path: the Activity is built only when a timeline is recorded."""
        self.busy[track] += end - start
        self.events += 1
        if self.record:
            what = Activity(kind, plan.step, plan.layer, e, tokens=tokens)
            self.intervals.append(Interval(track, what.name(), start, end, what.args()))

    def _expert_time(self, device: str, n: int) -> float:
        table = self.gpu_table if device == "gpu" else self.cpu_table
        return float(table[n]) if n < len(table) else float(self.costs.expert_time(device, n))

    def _compute(self, track: str, duration: float, what: Activity):
        start = self.env.now
        yield self.env.timeout(duration)
        self._log(track, start, self.env.now, what)

    def _background(self, what: Activity) -> simpy.Event:
        """A prefetch or swap copy at background priority; the event fires when it has landed."""
        done = self.env.event()
        self.background_open += 1

        def copy():
            with self.pcie.request(priority=BACKGROUND) as req:
                yield req
                start = self.env.now
                yield self.env.timeout(self.xfer)
                self._log("pcie", start, self.env.now, what)
            self.background_open -= 1
            done.succeed()

        self.env.process(copy())
        return done

    # ---- lanes --------------------------------------------------------------------------------
    def _on_demand(self, plan: LayerPlan, fetches: list, staging: dict[int, object], signal: list):
        """Copies of FETCH experts in touch order, holding the link between consecutive copies (on-demand
        first: a queued prefetch never slips in between); a staged one first takes a staging buffer,
        and while it waits for one the link is released for background copies."""
        link = None
        for e, staged, done in fetches:
            if staged:
                if self.staging.count >= self.staging.capacity and link is not None:
                    self.pcie.release(link)
                    link = None
                req = self.staging.request()
                yield req
                staging[e] = req
            if link is None:
                link = self.pcie.request(priority=ON_DEMAND)
                yield link
            start = self.env.now
            yield self.env.timeout(self.xfer)
            self._log_expert("pcie", start, self.env.now, "fetch", plan, e)
            done.succeed()
            if not signal[0].triggered:
                signal[0].succeed()
        if link is not None:
            self.pcie.release(link)

    def _cpu_lane_end(self, plan: LayerPlan, t: float) -> float:
        """The CPU lane has no dependencies: its experts run back to back from ``t``."""
        for i in np.flatnonzero(plan.source == CPU):
            e, n = int(plan.experts[i]), int(plan.counts[i])
            d = self._expert_time("cpu", n)
            self._log_expert("cpu", t, t + d, "expert", plan, e, n)
            t += d
        return t

    def _gpu_sources(self, plan: LayerPlan):
        """GPU experts in touch order -> arrival event (None = present), on-demand copies, workloads."""
        ready: dict[int, simpy.Event | None] = {}
        fetches: list[tuple[int, bool]] = []
        for i in np.flatnonzero(plan.on_gpu):
            e, src = int(plan.experts[i]), plan.source[i]
            if src == PREFETCHED:
                ready[e] = self.arrivals.pop((plan.layer, e))
            else:
                ready[e] = None  # HIT; a FETCH gets its event on the event-by-event path
                if src != HIT:
                    fetches.append((e, bool(plan.staged[i])))
        return ready, fetches, dict(zip(plan.experts.tolist(), plan.counts.tolist()))

    def _gpu_compute(self, plan: LayerPlan, e: int, n: int):
        return self._compute("gpu", self._expert_time("gpu", n), Activity("expert", plan.step, plan.layer, e, tokens=n))

    def _gpu_lane(self, plan: LayerPlan, ready, fetches, counts):
        """Event-by-event GPU lane (the link may be contended)."""
        env = self.env
        events = [(e, staged, env.event()) for e, staged in fetches]
        for e, _, ev in events:
            ready[e] = ev
        staging: dict[int, object] = {}
        signal = [env.event()]  # fires when any of this layer's copies lands; re-armed after each wait
        if events:
            env.process(self._on_demand(plan, events, staging, signal))
        own = {id(ev) for _, _, ev in events}
        remaining = list(ready)  # touch order
        while remaining:
            e = next((x for x in remaining if ready[x] is None or ready[x].triggered), None)
            if e is None:
                start = env.now
                prefetched = [ready[x] for x in remaining if id(ready[x]) not in own and not ready[x].triggered]
                yield env.any_of(prefetched + [signal[0]]) if prefetched else signal[0]
                if signal[0].triggered:
                    signal[0] = env.event()
                self.layer_wait[plan.layer] += env.now - start
                continue
            remaining.remove(e)
            yield from self._gpu_compute(plan, e, counts[e])
            if e in staging:
                self.staging.release(staging.pop(e))

    def _uncontended(self, ready) -> bool:
        """True when this layer's copies cannot meet any other copy: no background copy is open (issued
        and not landed, including ones whose process has not started yet), the link is idle (no other
        copy can be issued before the layer ends) and every prefetched expert has arrived. The layer's
        times then follow from the rules alone, without SimPy events."""
        if not self.shortcut or self.background_open or self.pcie.count or self.pcie.queue:
            return False
        return all(ev is None or ev.triggered for ev in ready.values())

    def _gpu_lane_end(self, plan: LayerPlan, now: float, order: list[int], counts: dict[int, int],
                      fetches: list[tuple[int, bool]]) -> float:
        """The event-by-event rules computed directly: copies back to back in touch order from ``now``,
        a staged one starting only when a staging buffer is free (buffers free up when their expert's
        GPU compute ends); the GPU runs, in touch order, the first expert whose weights are present,
        else waits for the next arrival. Returns the lane's end."""
        rank = {e: i for i, e in enumerate(order)}
        fetched = {e for e, _ in fetches}
        present = [rank[e] for e in order if e not in fetched]  # heap of touch positions
        heapq.heapify(present)
        landed: list[tuple[float, int]] = []  # (arrival, touch position) of started copies, in time order
        staged_of = dict(fetches)
        free = self.staging.capacity - self.staging.count
        releases: list[float] = []  # buffer release times known so far (all <= the GPU's time)
        link_t, ci, li = now, 0, 0
        t = now
        left = len(order)
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
            while li < len(landed) and landed[li][0] <= t:
                heapq.heappush(present, landed[li][1])
                li += 1
            if not present:
                if li == len(landed):
                    raise AssertionError("direct GPU lane: no expert can ever arrive")
                self.layer_wait[plan.layer] += landed[li][0] - t
                t = landed[li][0]
                continue
            e = order[heapq.heappop(present)]
            left -= 1
            d = self._expert_time("gpu", counts[e])
            self._log_expert("gpu", t, t + d, "expert", plan, e, counts[e])
            t += d
            if staged_of.get(e):
                releases.append(t)
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
        for target, e in plan.prefetches:
            self.arrivals[(target, e)] = self._background(Activity("prefetch", step, target, e))
        for e in plan.prefetch_wasted:
            self.arrivals.pop((layer, e), None)
        ready, fetches, counts = self._gpu_sources(plan)
        dense = float(self.dense_moe[step])
        what = Activity("dense", step, layer)
        if self._uncontended(ready):
            # nothing can change while the dense part runs: the whole layer is computed directly
            now = env.now
            self._log(self.dense_device, now, now + dense, what)
            lanes = now + dense
            end = max(self._cpu_lane_end(plan, lanes), self._gpu_lane_end(plan, lanes, list(ready), counts, fetches))
            yield env.timeout(end - now)
        else:
            yield from self._compute(self.dense_device, dense, what)
            cpu_end = self._cpu_lane_end(plan, env.now)
            if self._uncontended(ready):
                yield env.timeout(self._gpu_lane_end(plan, env.now, list(ready), counts, fetches) - env.now)
            else:
                yield from self._gpu_lane(plan, ready, fetches, counts)
            if cpu_end > env.now:
                yield env.timeout(cpu_end - env.now)
        if plan.swaps:
            self.swaps_landing[layer] = [self._background(Activity("swap", step, layer, a, other=b))
                                         for a, b in plan.swaps]
        self.layer_time[layer] += env.now - start

    def _run(self, out: dict):
        w = self.w
        moe_blocks = set(w.model.moe_layers)
        starts, ends = np.zeros(w.num_steps), np.zeros(w.num_steps)
        for step in range(w.num_steps):
            starts[step] = self.env.now
            layer = 0
            for block in range(w.model.num_layers):
                if block in moe_blocks:
                    yield from self._layer(step, layer)
                    layer += 1
                else:
                    yield from self._compute(self.dense_device, self.dense_block[step], Activity("block", step, block))
            ends[step] = self.env.now
            if self.on_step:
                self.on_step()
        out["starts"], out["ends"] = starts, ends

    def run(self) -> EngineOutput:
        out: dict = {}
        self.env.process(self._run(out))
        self.env.run()
        # background copies may still run after the last layer: the makespan is the last step's end
        return EngineOutput(out["starts"], out["ends"], self.layer_time, self.layer_wait, self.busy, self.events,
                            self.intervals)
