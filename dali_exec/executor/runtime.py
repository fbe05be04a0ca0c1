"""The offloading runtime: performs the controller's :class:`LayerPlan` for one MoE layer on real devices.

Per layer, in the simulator's order (docs/simulator.md):

1. :meth:`OffloadRuntime.start_layer`: wait for the cache swaps of the layer's previous visit; free
   the prefetch buffers of experts prefetched for this layer but not used; start the prefetches the
   plan issues (background copies; a prefetch whose buffer is still being read waits for it);
2. the caller runs the dense part (attention, router, shared experts);
3. :meth:`OffloadRuntime.run_experts`: evictions and admissions update the slot table; the CPU lane
   computes the CPU experts from host memory (on its worker thread while the accelerator lane works, or
   in the calling thread when the layer has no accelerator experts) while the accelerator lane issues
   the on-demand copies in touch order (all at once; a staged one when a staging buffer is free) and,
   repeatedly, computes every expert whose weights have landed as one grouped call
   (:mod:`.grouped`), else waits for the next copy; the outputs are combined exactly (:mod:`.routing`);
   the swaps the cache asked for start in the background.

Everything the runtime does is dictated by the plan; it makes no decision of its own. Its host work
per layer is a fixed number of array operations and tensor calls per group, not per expert.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from typing import Callable

import numpy as np
import torch

from dali_exec.executor import kernels as _kernels
from dali_exec.executor.copies import BACKGROUND, CopyEngine, CopyTicket
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_exec.executor.grouped import GroupIndex
from dali_exec.executor.packed import PinnedRing
from dali_exec.executor.routing import FLOAT32, LayerRouting
from dali_exec.executor.slots import Slot, SlotPool
from dali_exec.executor.store import HostExpertStore
from dali_exec.executor.timing import LayerSeconds, Stopwatch, Timer, TurnLoop
from dali_exec.executor.workspace import GroupWorkspace, RouteWorkspace
from dali_sim.runtime.controller import CPU, HIT, PREFETCHED, LayerPlan
from dali_sim.runtime.plan_kernel import TALLY_LEN
from dali_sim.sim.engine import HANDOFF_KINDS

_EMPTY = np.zeros(0, np.int64)
_VICTIMS = TALLY_LEN + 1  # where a compiled plan's answer lists its victims (LayerPlan.answer)
_NO_SLOTS = np.zeros((3, 0), np.int64)  # a slot table's state (SlotPool.state) for the host store's rows: none
_NO_GROUP = (np.zeros((7, 0), np.int64), np.zeros(0, np.float32), np.zeros(0, np.int32))  # (the route call's)
#: the route call's arguments whose types the runtime does not fix: the trace's ids and the plan's four arrays
_ROUTE_LOOSE = (0, 3, 4, 5, 6)


class OffloadRuntime:
    """Cache slots, prefetch and staging buffers, a copy lane and a CPU lane for one model's experts.

    ``capacities`` (slots per layer), ``prefetch_slots`` and ``staging_slots`` come from the memory
    plan; ``initial`` is the controller's initial cache contents. ``copy_delay_s`` (tests) holds every
    copy back. ``pairs``: the (token, rank) pairs of a typical layer visit (batch x top-k), for which the
    workspaces are made ready at set-up (:class:`GroupWorkspace`). Per-layer accumulators: ``layer_wait``
    (seconds the accelerator lane waited for weights, host-measured) and ``layer_bookkeeping`` /
    ``layer_bookkeeping_cpu`` (the runtime's own host work, wall-clock / thread-CPU seconds: slot table,
    routing indices, issuing copies, choosing the next expert; not computes, transfers of activations or
    waits)."""

    def __init__(self, store: HostExpertStore, devices: Devices, capacities: np.ndarray, prefetch_slots: int,
                 staging_slots: int, *, cpu_threads: int, timer: Timer | None = None, copy_delay_s: float = 0.0,
                 cpu_inline: bool = False, pairs: int = 0, spin_s: float = 0.0):
        """``spin_s``: how long the CPU lane's worker spins for its next job before it sleeps (``CpuWorker``)."""
        self.store, self.dev = store, devices
        self._host_layers = list(store.weights.unbind(0))  # each layer's host weights (E x numel), made once
        self._host_experts = [list(w.unbind(0)) for w in self._host_layers]  # and each expert's (staging turns)
        self._prepared_rows: dict[int, tuple] = {}  # _row_prepared
        self._turn_bufs: dict[tuple, tuple] = {}  # _turn_buffers
        #: run the CPU lane in the calling thread (when it has the lane's thread count) instead of the worker:
        #: for an accelerator that is the CPU device and shares its threads, where the lanes cannot overlap
        self.cpu_inline = cpu_inline
        #: the lanes one after the other, each on its own thread: a layer's CPU-lane job is waited for before the
        #: accelerator lane starts (the calibration's reference for how much the lanes slow each other side by
        #: side: ``dali_exec.calibrate.lanes``)
        self.lanes_apart = False
        self.layout = store.layout
        self.timer = timer or Timer(devices.accel if devices.is_cuda else None)
        self.pool = SlotPool(capacities, prefetch_slots, staging_slots, self.layout.numel, devices.dtype, devices.accel,
                             num_experts=store.num_experts)
        self.compute_stream = torch.cuda.current_stream(devices.accel) if devices.is_cuda else None
        self.copies = CopyEngine(devices.copy_stream, self.timer, delay_s=copy_delay_s, device=devices.accel,
                                 home=self.compute_stream)
        self.cpu = CpuWorker(cpu_threads, spin_s)
        #: CUDA: recorded after a layer's activations are queued to the host for the CPU lane (one per visit: the
        #: lane is done before the next visit)
        self._x_on_host = torch.cuda.Event() if devices.is_cuda else None
        #: CUDA: the index arrays' transfers, from pinned buffers made here (words: a group of ``pairs`` pairs'
        #: three int64 arrays and two 4-byte ones)
        self._send = PinnedRing(devices.accel, self.compute_stream, max(256, 4 * pairs + 64)).send \
            if devices.is_cuda else None
        L = len(capacities)
        self.swaps_landing: dict[int, list[CopyTicket]] = {}
        self.deferred: deque[tuple[int, int, int]] = deque()  # prefetches waiting for a free buffer: (layer, expert, step)
        self._wait = [0.0] * L  # seconds the accelerator lane waited for weights, per layer
        self._bookkeeping = LayerSeconds(L)
        self._route_ws = RouteWorkspace(devices.accel, pairs, store.num_experts)
        self._route_entries = _kernels.Entries("route_partition", _ROUTE_LOOSE)
        self._ws_routing: LayerRouting | None = None  # the routing made of the route workspace's views
        self._out_buf: torch.Tensor | None = None  # the last layer's combine buffer (_combine_buffer)
        self._out_shape: tuple[int, int] = (-1, -1)  # its shape
        self._accel_is_host = devices.accel.type == "cpu"
        self._group_ws = GroupWorkspace(len(self.pool.slots), devices.accel, pairs)
        self._cpu_ws = GroupWorkspace(store.num_experts, devices.host, pairs)  # the CPU lane's (rows: the experts)
        #: the CPU device: the staged experts' group, built while the written first group's views are still to be
        #: read (both are built before either is computed: _accelerator_lane)
        self._staged_ws = GroupWorkspace(len(self.pool.slots), devices.accel, pairs) if not devices.is_cuda else None
        #: whether the route call writes a layer's first group (the CPU device: computed before any wait) and the
        #: (pairs, lo, span, experts, whether of staged experts) of the one it wrote for this layer visit, until
        #: _group or _accelerator_lane takes it
        self._first_in_route = not devices.is_cuda
        self._first: tuple | None = None
        #: the accelerator lane's first copies listed by the route call for this layer visit (their number, in the route
        #: workspace's rows ``kernels.W_COPIES``..), -1: none listed, until _accelerator_lane takes them
        self._copies = -1
        #: whether the route call settled this layer visit's lane ahead of its device work
        #: (``kernels._route_partition``: its staging buffers neither taken nor held), until _accelerator_lane takes it
        self._settled = False
        self._droute_of: LayerRouting | None = None  # the routing whose accelerator copy _droute_list is
        self._droute_list: list = []
        #: grouped calls per lane (``gpu``, ``cpu``) and the experts they computed
        self.groups = {"gpu": 0, "cpu": 0}
        self.grouped_experts = {"gpu": 0, "cpu": 0}
        #: CPU-lane jobs handed to the worker so far (each wakes it when it sleeps, ``cpu.wakes``: a cost of the
        #: calling thread that the simulator charges apart, ``lane_wake.host``, so the calibration's host fit takes it
        #: out; one that finds it spinning costs a counter's increment)
        self.cpu_handoffs = 0
        #: prefetches that found no free buffer as their layer visit started (the simulator's "at-use" prefetch
        #: buffers: dali_sim.sim.engine.buffers_at_use)
        self.prefetches_waited = 0

    # ---- setup --------------------------------------------------------------------------------
    def load(self, resident: np.ndarray) -> None:
        """Copy the initial cache contents ((L, E) bool) into cache slots, synchronously."""
        for layer, row in enumerate(np.asarray(resident)):
            experts = np.flatnonzero(row)
            for r, e in zip(self.pool.admit_many(layer, experts).tolist(), experts.tolist()):
                self.pool.slots[r].data.copy_(self.store.host(layer, e))
        self.dev.synchronize()

    def grouped_calls(self) -> dict[str, dict[str, int]]:
        """Per lane: grouped calls made so far and the experts they computed."""
        return {lane: {"calls": self.groups[lane], "experts": self.grouped_experts[lane]} for lane in self.groups}

    def on_cpu_lane(self, fn: Callable):
        """``fn()`` run on the CPU lane with nothing beside it (a dense part on the CPU), its value returned: in the
        calling thread where it has the lane's thread count (torch's is per thread), as a layer's CPU lane without
        accelerator experts runs; else handed to the lane's worker (counted in ``cpu_handoffs``) and waited for."""
        if self._has_cpu_lane_threads():
            return fn()
        self.cpu_handoffs += 1
        return self.cpu.run(fn)

    def _has_cpu_lane_threads(self) -> bool:
        """Does the calling thread have the CPU lane's thread count (torch's is per thread), so that CPU-lane work
        with nothing beside it runs here instead of waking the worker? (The simulator's ``executor_on`` mirrors this
        rule: the profile's ``threads.main_thread`` against ``threads.cpu_lane``.)"""
        return torch.get_num_threads() == self.cpu.threads

    def handoffs(self) -> dict[str, int]:
        """Hand-overs to a thread that waits for work so far, per ``HANDOFF_KINDS`` (the simulator's
        ``summary["handoffs"]``): every CPU-lane job handed to the worker (asleep, or spinning for it: ``cpu.wakes``
        counts those that woke it), every request of background copies that woke the sleeping copy thread."""
        return dict(zip(HANDOFF_KINDS, (self.cpu_handoffs, self.copies.wakes)))

    @property
    def slot_bytes(self) -> int:
        """Accelerator bytes of all weight slots (cache + prefetch + staging): all that is allocated for experts."""
        return self.pool.nbytes

    # ---- per layer ----------------------------------------------------------------------------
    def start_layer(self, plan: LayerPlan, handoff: tuple[Stopwatch, Stopwatch] | None = None, *,
                    running: Stopwatch | None = None) -> None:
        """Steps before the dense part: swaps of the last visit land, prefetch buffers freed and issued.
        ``handoff``: (the caller's running stopwatch, the one to start when this returns), handed over at
        this call's start and end (:meth:`Stopwatch.hand_to`: the boundaries share their clock readings).
        ``running``: a started stopwatch (the caller handed over to it), this call's own, stopped at its end."""
        layer = plan.layer
        if running is not None:
            sw = running
        else:
            sw = handoff[0].hand_to(Stopwatch()) if handoff is not None else Stopwatch().start()
        for ticket in self.swaps_landing.pop(layer, ()):
            if not ticket.is_done():
                sw.stop()
                w0 = time.perf_counter()
                ticket.wait()
                self._wait[layer] += time.perf_counter() - w0
                sw.start()
            ticket.wait()  # re-raises a failed copy
        for e in plan.prefetch_wasted:
            self._free_prefetch(self.pool.pop_prefetched(layer, e))
        for target, e in plan.prefetches:
            self.deferred.append((target, e, plan.step))
        if self.deferred:  # (the check of _issue_deferred, without its call where nothing waits)
            self._issue_deferred()
        self.prefetches_waited += len(self.deferred)
        if handoff is not None:
            sw.hand_to(handoff[1])
        else:
            sw.stop()
        self._book(layer, sw)

    def _book(self, layer: int, sw: Stopwatch) -> None:
        self._bookkeeping.add(layer, sw)

    @property
    def layer_wait(self) -> np.ndarray:
        """(L,) seconds the accelerator lane waited for weights (host-measured)."""
        return np.array(self._wait)

    @property
    def bookkeeping_seconds(self) -> LayerSeconds:
        """The per-layer sums behind :attr:`layer_bookkeeping` and :attr:`layer_bookkeeping_cpu` (added to as
        the work is done)."""
        return self._bookkeeping

    @property
    def layer_bookkeeping(self) -> np.ndarray:
        """(L,) wall-clock seconds of the runtime's own host work."""
        return np.array(self._bookkeeping.wall)

    @property
    def layer_bookkeeping_cpu(self) -> np.ndarray:
        """(L,) thread-CPU seconds of the runtime's own host work."""
        return np.array(self._bookkeeping.cpu)

    def run_experts(self, plan: LayerPlan, x: torch.Tensor, routing: LayerRouting | tuple, *,
                    uncounted_on_cpu: bool = False, handoff: Stopwatch | None = None) -> torch.Tensor:
        """The layer's routed experts on ``x`` (T x H, the gate input, on the dense device): the
        combined output sum_r w[t, r] * expert(x[t]) (T x H, on ``x``'s device). ``routing``: grouped
        (:meth:`LayerRouting.group`), or the router's (T, k) ids and weights (or None), which are grouped and
        checked against the plan in one compiled call (every token counted).

        Tokens the routing does not count (``LayerRouting.group(counted=...)``: e.g. padding a real model
        computes anyway) ride along with the plan's experts; experts that only such tokens use are not part
        of the plan: their pairs stay 0, or, with ``uncounted_on_cpu``, the CPU lane computes them too.
        ``handoff``: the caller's running stopwatch, stopped as this call starts (one clock reading)."""
        # stopped around computes, activation transfers and waits
        sw = handoff.hand_to(Stopwatch()) if handoff is not None else Stopwatch().start()
        layer, step = plan.layer, plan.step
        dev, pool = self.dev, self.pool
        if isinstance(routing, LayerRouting):
            self._first, self._copies, self._settled = None, -1, False
            if len(plan.evicted):
                pool.evict_many(layer, np.asarray(plan.evicted))
            cpu_seg, split = self._partition(plan, routing, uncounted_on_cpu)
            admitted = None
        else:  # (with the evictions and, where it can, the adoptions and admissions)
            routing, cpu_seg, split, admitted = self._route(plan, *routing)
        T, k, H = routing.num_tokens, routing.top_k, self.layout.hidden
        lanes = _AccelLane.of(plan, pool, *split, admitted=admitted)
        if self.deferred:  # adoptions may have freed prefetch buffers
            self._issue_deferred()

        # the CPU lane starts first and runs while the accelerator lane works; inline (same thread and
        # threads) it runs when the accelerator lane would first wait for a copy, or after it
        # activation transfers are not bookkeeping: with one to make the stopwatch stops here; without (the CPU
        # device) it runs on through the lanes' set-up (the output buffer, the CPU lane's job): two readings less
        on_host = x.is_cpu  # (x.device is a new object per read)
        on_accel = on_host if self._accel_is_host else x.device == dev.accel
        moves = bool(cpu_seg.size and not on_host) or bool(lanes.n and not on_accel)
        if moves:
            sw.stop()
        cpu_job = None
        inline: list = []
        if cpu_seg.size:
            x_host, ready = x, None
            if not on_host:  # (queued: the CPU lane waits for it, not this thread, which goes on issuing its work)
                x_host, ready = x.to(dev.host, non_blocking=True), self._x_on_host
                ready.record(self.compute_stream)
            if (self.cpu_inline or not lanes.n) and self._has_cpu_lane_threads():  # (a partial: a lambda would
                inline.append(partial(self._cpu_lane, step, layer, cpu_seg, x_host, routing, ready))  # make cells)
            else:
                cpu_job = self.cpu.submit(self._cpu_lane, step, layer, cpu_seg, x_host, routing, ready)
                self.cpu_handoffs += 1
                if self.lanes_apart:  # (a wait, not bookkeeping: the stopwatch stopped, if it runs)
                    if not moves:
                        sw.stop()
                    cpu_job.result()
                    if not moves:
                        sw.start()
        x_acc = x if (on_accel or not lanes.n) else x.to(dev.accel, non_blocking=True)
        # every pair is computed by one lane unless uncounted tokens' own experts are left out: then those stay 0
        every_pair = uncounted_on_cpu or routing.counted is None
        out_buf = self._combine_buffer(T * k, H, zeroed=not every_pair)

        cpu_out: list = []
        if lanes.n:
            if moves:
                sw.start()
            self._accelerator_lane(plan, lanes, routing, x_acc, out_buf, sw, inline, cpu_out)
        if (lanes.n or not moves) and not lanes.settled:
            # the slot table is settled (the combine below does not touch it; swaps keep every role's count)
            self._layer_checked(step, layer, lanes.staging_used)
            sw.stop()
        if inline:
            cpu_out.append(inline.pop()())
        if cpu_job is not None:
            cpu_out.append(cpu_job.result())
        for pos, vals in cpu_out:
            if dev.is_cuda:  # (the CPU lane's outputs are on the host)
                pos, vals = pos.to(dev.accel, non_blocking=True), vals.to(dev.accel, non_blocking=True)
            out_buf.index_copy_(0, pos, vals)
        out = out_buf.view(T, k, H).sum(dim=1)
        out = out if on_accel else out.to(x.device)

        if plan.swaps or (moves and not lanes.n):  # (a segment of its own only where there is work left)
            sw.start()
            if plan.swaps:
                ins, outs = [a for a, _ in plan.swaps], [b for _, b in plan.swaps]
                rows = pool.swap_many(layer, ins, outs)
                self.swaps_landing[layer] = [self._copy_many(rows, [layer] * len(ins), ins, BACKGROUND,
                                                             ("swap", step), outs)]
            if moves and not lanes.n:
                self._layer_checked(step, layer, lanes.staging_used)
            sw.stop()
        self._book(layer, sw)
        return out

    def _layer_checked(self, step: int, layer: int, staging_used: int) -> None:
        """A layer visit's end: the slot table keeps its counts, and no prefetch waits for a buffer."""
        self.pool.check_layer(layer, staging_used)
        if self.deferred:
            raise AssertionError(f"step {step} layer {layer}: prefetches still wait for a buffer at the layer's end")

    def _settle_ahead(self, plan: LayerPlan, lanes: "_AccelLane", stage_rows: np.ndarray, late: bool = False) -> None:
        """The CPU device, a lane whose device work (its copies, then its computes, all in this thread) runs in one
        pause of the stopwatch, to the layer's end (``lanes.settled``): the staging buffers released and the
        layer's end checked (:meth:`_layer_checked`) ahead of that work, its records made (their stamps written as
        it runs). Bookkeeping after it would start on the caches its computes emptied. The rows were checked
        when the groups and turns were built, and nothing writes them before the computes read them (no
        background copy writes a staging buffer or a cache row, and the lane's prefetched experts have landed).
        The prefetch buffers of experts the cache declined are freed here too (nothing can take them before the
        next visit's plan, and only this thread computes from them), unless a prefetch waits for a buffer
        (``late``): it would take one at once, so they are freed after the device work, and the layer checked then
        (:meth:`_accelerator_lane`)."""
        if lanes.staging_used:  # (taken: not by a lane the route call settled)
            self.pool.release_staging_rows(stage_rows)
            lanes.staging_used = 0
        if not late:
            self._free_declined(lanes)
            self._layer_checked(plan.step, plan.layer, 0)
        lanes.settled = True

    def _free_declined(self, lanes: "_AccelLane") -> None:
        """The prefetch buffers of the lane's experts the cache declined (computed from them), free again."""
        if lanes.freed:
            pool, rows = self.pool, lanes.rows
            for i in lanes.freed:
                pool.release_prefetch(pool.slots[int(rows[i])])

    def _combine_buffer(self, pairs: int, hidden: int, zeroed: bool) -> torch.Tensor:
        """The (pairs x hidden) buffer a layer's outputs are combined in, on the accelerator: the last layer's
        when it has that shape (its sum has been taken: on CUDA the later writes are queued behind it on the
        compute stream), else a new one; ``zeroed`` when not every pair is written."""
        buf = self._out_buf
        if self._out_shape != (pairs, hidden):
            buf = self._out_buf = torch.empty((pairs, hidden), dtype=self.dev.dtype, device=self.dev.accel)
            self._out_shape = (pairs, hidden)
        return buf.zero_() if zeroed else buf

    def _route(self, plan: LayerPlan, ids: np.ndarray, weights: np.ndarray | None):
        """The plan's evictions, then (the routing grouped, :meth:`_partition` of it, what the compiled call adopted
        and admitted: (prefetched experts adopted, lane positions of those declined, whether a prefetched one's copy is
        in flight) when it took the prefetched experts from their buffers and admitted the fetched ones, else None),
        from the router's ids and weights in one compiled call (``kernels._route_partition``; without numba
        :meth:`SlotPool.evict_many`, :meth:`LayerRouting.group` and :meth:`_partition`)."""
        pool, layer = self.pool, plan.layer
        if _kernels.compiled("route_partition") is None:
            self._first, self._copies, self._settled = None, -1, False
            if len(plan.evicted):
                pool.evict_many(layer, np.asarray(plan.evicted))
            routing = LayerRouting.group(ids, weights)
            return (routing, *self._partition(plan, routing, False), None)
        if type(ids) is not np.ndarray or type(weights) is not np.ndarray or weights.dtype is not FLOAT32 or \
                weights.shape != ids.shape:  # (a trace's ids and weights pass as they are: checked's own tests)
            ids, weights = LayerRouting.checked(ids, weights)
        T, k = ids.shape
        n = T * k
        victims = len(plan.evicted)  # (the compiled plan's answer holds them as an array: LayerPlan.answer)
        evicted = (_EMPTY if not victims else
                   plan.answer[_VICTIMS:_VICTIMS + victims] if plan.answer is not None else
                   np.array(plan.evicted, np.int64))
        free = pool.cache_free[layer]
        ws = self._route_ws.fit(n, len(evicted))
        wi = ws.wi
        if self._first_in_route:  # (the CPU device: the route call writes the layer's first group)
            gws = self._group_ws
            if n > gws.ints.shape[1]:
                gws.fit(n)
            gi, gw, go = gws.gi, gws.w, gws.offs
        else:
            gi, gw, go = _NO_GROUP
        flat, pe, pc, ps, pa = ids.reshape(-1), plan.experts, plan.counts, plan.source, plan.admitted
        taken = pool.staging_taken  # (the free staging buffers: rows from staging_first + taken on)
        args = (flat, weights.reshape(-1), k, pe, pc, ps, pa, pool.row_of, pool.prefetch_row, evicted,
                np.fromiter(free, np.int64, len(free)) if free else _EMPTY, layer, pool.state, wi, ws.wf, gi, gw, go,
                pool.staging_first + taken, pool.num_staging - taken)
        key = (flat.dtype, pe.dtype, pc.dtype, ps.dtype, pa.dtype)  # (_ROUTE_LOOSE's; the weights are float32)
        (bad, n_ev, status, m, pstatus, c, g, hits, ready, fetched, adm, n_adopt, n_declined, in_flight, fg_n, fg_lo,
         fg_span, fg_ready, fg_staged, self._copies, self._settled) = self._route_entries.get(key, args)(*args)
        # the first group (the ready and fetched experts, or the staged ones in the first free staging buffers),
        # when written and its rows ready: (pairs, lo, span, experts, whether staged), used by _group / _written
        self._first = (fg_n, fg_lo, fg_span, g if fg_staged else ready + fetched, fg_staged) \
            if fg_ready and fg_n >= 0 else None
        if bad >= 0:
            raise AssertionError(f"layer {layer} expert {int(evicted[bad])} is not in the slot table's cache")
        if n_ev:
            free.extend(wi[_kernels.W_EVICTED, :n_ev].tolist())
            pool.n_cached[layer] -= n_ev
        if status == _kernels.NEGATIVE:
            raise ValueError("expert ids must be >= 0")
        # views of the workspace, used within this layer visit (see .workspace)
        cols = 1 if pstatus == 2 else g  # (status 2: column 0 names the expert that is not cached)
        experts, ptr, per, order, w, cpu, lane, lane_order = ws.layer_views(m, n, c, g, cols)
        routing = LayerRouting(T, k, experts, ptr, order, w, None, per)
        self._ws_routing = routing
        split = _checked_split(plan, routing, pstatus, cpu, lane, lane_order, hits, ready, fetched)
        if adm != _kernels.OK:
            return (routing, *split, None)
        declined = wi[_kernels.W_DECLINED, :n_declined].tolist() if n_declined else []
        return (routing, *split, (n_adopt, declined, in_flight))

    def _partition(self, plan: LayerPlan, routing: LayerRouting, uncounted_on_cpu: bool):
        """The routing checked against the plan and split between the lanes: (the CPU lane's experts as ascending
        indices into ``routing.experts``, the accelerator lane's split: see ``kernels._partition``)."""
        layer = plan.layer
        kernel = _kernels.compiled("partition")
        flag = uncounted_on_cpu and routing.counted is not None
        if kernel is not None:
            return _checked_split(plan, routing, *kernel(
                routing.experts, routing.counts(), plan.experts, plan.counts, plan.source, plan.admitted,
                self.pool.row_of[layer], _kernels.PLAN_CODES, flag))
        if not routing.matches(plan.experts, plan.counts):
            _routing_differs(plan, routing)
        # the same in array operations
        gpu = np.flatnonzero(plan.source != CPU)
        src, experts = plan.source[gpu], plan.experts[gpu].astype(np.int64)
        hit = src == HIT
        kind = np.select([hit, src == PREFETCHED, plan.admitted[gpu]],
                         [_kernels.READY, _kernels.PREFETCHED_KIND, _kernels.FETCHED], _kernels.STAGED)
        rows = np.full(len(gpu), -1, np.int64)
        rows[hit] = self.pool.cached_rows(layer, experts[hit])
        lane = np.stack([gpu, np.searchsorted(routing.experts, experts), rows, experts, kind]).astype(np.int64)
        groups = [np.flatnonzero(kind <= _kernels.PREFETCHED_KIND), np.flatnonzero(kind == _kernels.FETCHED),
                  np.flatnonzero(kind == _kernels.STAGED)]
        order = np.concatenate(groups).astype(np.int64)
        hits, ready, fetched = int(np.count_nonzero(hit)), len(groups[0]), len(groups[1])
        cpu_seg = np.searchsorted(routing.experts, plan.experts[plan.source == CPU])
        if flag:
            cpu_seg = np.concatenate([cpu_seg, np.flatnonzero(routing.counts() == 0)])
        cpu_seg.sort()
        return cpu_seg, (lane, order, hits, ready, fetched)

    def _accelerator_lane(self, plan: LayerPlan, lanes: "_AccelLane", routing: LayerRouting, x: torch.Tensor,
                          out_buf: torch.Tensor, sw: Stopwatch, inline: list, cpu_out: list) -> None:
        """The accelerator experts of a layer, in a schedule fixed up front (no hand-over per expert):

        1. the on-demand copies of the admitted experts and of the first staging turns are issued at once
           (touch order), from this thread (:meth:`CopyEngine.issue_now`);
        2. the experts whose weights are there (hits, landed prefetches; on the CPU device also the copies
           just made) are computed as one group, then, on CUDA, the admitted ones after their copies;
        3. staged experts cycle through the staging buffers: turn t holds ``per_turn`` of them (all of them
           if they fit; else half the buffers each, so the copy of turn t + 1 overlaps the compute of turn t),
           and turn t + 2 is copied into turn t's buffers after turn t's compute (on CUDA the copy stream
           waits for that compute's event; the host never waits);
        4. prefetched experts whose background copy is still in flight are computed once it lands (the
           host waits: the copy thread may not have issued it yet); ``inline`` (the CPU lane's work when it
           runs in this thread) is done before that first wait.

        On the CPU device, where this thread does the copies and the computes, a lane with no prefetch in flight
        and its staged experts in one turn or one at a time is settled ahead of that work (:meth:`_settle_ahead`),
        which then runs to the layer's end with the stopwatch stopped; where a prefetch waits for the buffer of an
        expert the cache declined, that buffer is freed (and the prefetch started) in one more segment after it."""
        pool, layer, step = self.pool, plan.layer, plan.step
        experts, rows, seg = lanes.experts, lanes.rows, lanes.seg
        if lanes.all_cached and not self._first_in_route:  # (CUDA, every one a hit: one group, nothing to copy or free)
            self._compute(plan, routing, seg, rows, x, out_buf, sw)
            return
        staged = lanes.staged
        n_staged = len(staged)
        S = pool.num_staging
        if n_staged and S < 1:
            raise AssertionError(f"step {step} layer {layer}: experts must be staged but there are no staging buffers")
        per_turn, halves = _kernels.staging_schedule(n_staged, S)  # (halves: buffer sets that alternate between turns)
        settled, self._settled = self._settled, False
        if not n_staged:
            stage_rows = _EMPTY
        elif settled:  # (by the route call: the buffers are used, not taken, as the lane is settled before they are)
            stage_rows = pool.free_staging_rows(min(S, per_turn * halves))
        else:
            stage_rows = pool.take_staging_rows(min(S, per_turn * halves))
            lanes.staging_used = len(stage_rows)
        # 1. the first copies: the admitted experts and the first turns (turn t < halves: the rows
        # t * per_turn ..), in touch order
        nf = len(lanes.fetched)  # (fetched and staged are consecutive in the lane order)
        listed, self._copies = self._copies, -1
        if listed > 0:  # by the route call, which gave the first turns' experts these buffers (the first free ones)
            first = self._route_ws.wi[_kernels.W_COPIES, :listed]
        elif n_staged and listed < 0:  # the fetched and the first staged ones (each ascending) merged
            head = staged[:per_turn * halves]
            rows[head] = stage_rows[:len(head)]
            first = lanes.order[len(lanes.ready):len(lanes.ready) + nf + len(head)]
            if nf:
                first = first.copy()
                first.sort()
        else:
            first = lanes.fetched
        # 2. what is there: hits and landed prefetches (and, without CUDA, the copies just made)
        ready = lanes.ready
        fg = self._first
        one_staged_turn = n_staged and per_turn == n_staged  # (every staged expert has its buffer: one group)
        # (the route call wrote the ready and fetched experts' group, or, with only staged experts in one turn, theirs
        # in the staging buffers it gave them, which are these stage_rows: the first free ones)
        written = fg is not None and fg[3] == (n_staged if fg[4] else len(ready) + nf)
        if settled or (self._first_in_route and not lanes.prefetched_in_flight and
                       (not n_staged or one_staged_turn or per_turn == 1)):
            # the CPU device, every prefetched expert landed, the staged ones in one turn or one at a time: the
            # stopwatch stopped once for the copies and the computes after them, to the layer's end. The group of the
            # ready and fetched experts (hits, landed prefetches, admissions) is the route call's when it wrote it
            # (taken before the copies: its indices do not depend on the copies' data), else built with the staged
            # experts' group or turns once the copies are issued (the rows then hold them); then the lane's records
            # are made and the lane settled (:meth:`_settle_ahead`, which also frees the declined ones' buffers,
            # unless a prefetch waits for one: ``late``, freed after the computes have read them)
            late = bool(lanes.freed) and bool(self.deferred)
            n_first = len(ready) + nf
            written_staged = written and fg[4]
            groups = [self._written(fg[3])] if written else []  # (checked above: it is this group)
            singles = []  # the one-expert turns (:class:`_Turns`)
            records = []  # the groups' records

            copying = len(first) > 0
            if copying:  # (their rows hold their experts before the groups are built)
                r, e, previous = self._copies_held(plan, first, experts, rows, not nf, listed >= 0)
            # (inline, not in functions: a function defined here would make every local it reads a cell, in each call)
            if n_first and not (written and not written_staged):  # (else the written group is theirs)
                both = lanes.order[:n_first]
                groups.append(self._group(plan, routing, seg[both], rows[both]))
            if one_staged_turn:
                if not written_staged:
                    groups.append(self._group(plan, routing, seg[staged], rows[staged], self._staged_ws, settled))
            elif n_staged:
                singles.append(self._single_prepare(plan, routing, lanes, stage_rows, halves, None, first,
                                                    held=listed >= 0))
            for g in groups:  # (a loop: a comprehension is a function call in Python 3.11)
                records.append(self._group_booked(plan, g))
            self._settle_ahead(plan, lanes, stage_rows, late)
            w0 = time.perf_counter()
            if copying:  # (the stopwatch stopped as they are issued, not started again)
                self.copies.issue_now(pool.rows_view, self.store.weights, r, layer, e, step, previous=previous,
                                      pause=sw, resume=False)
            else:  # (nothing to copy: landed prefetches and hits)
                sw.stop()
            for g, rec in zip(groups, records):
                rec[2], rec[3] = self._forward_group(g, x, out_buf)
            if singles:
                self._single_loop(singles[0], x, out_buf)
                self._single_after(plan, singles[0])
            if copying:  # the lane waited for its copies until its first stamp
                self._wait[layer] += (records[0][2] if records else singles[0].starts[0]) - w0
            if late:  # the declined ones' buffers, now read: the waiting prefetches take them
                sw.start()
                self._free_declined(lanes)
                self._issue_deferred()
                self._layer_checked(step, layer, 0)
                sw.stop()
            return
        fetched_events = self._copy_now(plan, first, experts, rows, sw, listed=listed >= 0)
        ready, after, waiting = self._ready(lanes, rows, fetched_events)
        if len(ready):
            self._compute(plan, routing, seg[ready], rows[ready], x, out_buf, sw)
        if len(after):
            self._wait_events(fetched_events, first, after)
            self._compute(plan, routing, seg[after], rows[after], x, out_buf, sw)
        # 3. staging turns
        if n_staged:
            if per_turn == 1:
                self._single_turns(plan, routing, lanes, stage_rows, halves, fetched_events, first, x, out_buf, sw,
                                   held=listed >= 0)
            else:
                self._staging_turns(plan, routing, lanes, stage_rows, per_turn, halves, fetched_events, first, x,
                                    out_buf, sw)
            pool.release_staging_rows(stage_rows)
            lanes.staging_used = 0
        # 4. prefetches still in flight
        while len(waiting):
            if inline:
                sw.stop()
                cpu_out.append(inline.pop()())
                sw.start()
            landed = self._is_present(rows[waiting])
            landed = np.ones(len(waiting), bool) if landed is True else np.asarray(landed, bool)
            if not landed.any():
                sw.stop()
                w0 = time.perf_counter()
                self.copies.wait_rows(pool.inflight, rows[waiting].tolist())
                self._wait[layer] += time.perf_counter() - w0
                sw.start()
                continue
            now = waiting[landed]
            waiting = waiting[~landed]
            self._compute(plan, routing, seg[now], rows[now], x, out_buf, sw)
        if lanes.freed:  # prefetch buffers of experts the cache declined: free, and waiting prefetches start
            self._free_declined(lanes)
            self._issue_deferred()

    def _ready(self, lanes: "_AccelLane", rows: np.ndarray, fetched_events) -> tuple:
        """Lane positions: (what is there: hits and landed prefetches, and, without CUDA, the fetched experts just
        copied; on CUDA the fetched ones, computed after their copies; prefetches still in flight)."""
        ready = lanes.ready
        waiting = ready[:0]
        if lanes.prefetched_in_flight:
            landed = self._is_present(rows[ready])
            if landed is not True:
                landed = np.asarray(landed, bool)
                ready, waiting = ready[landed], ready[~landed]
        after = lanes.fetched
        if fetched_events is None and len(after):
            ready = np.concatenate([ready, after]) if len(waiting) else lanes.order[:len(ready) + len(after)]
            after = after[:0]
        return ready, after, waiting

    def _copy_now(self, plan: LayerPlan, idx: np.ndarray, experts: np.ndarray, rows: np.ndarray, sw: Stopwatch,
                  after: list | None = None, staging: bool = False, listed: bool = False):
        """On-demand copies of lane positions ``idx`` into their rows, from this thread; on CUDA their end
        events (aligned with ``idx``), else None (done). ``staging``, ``listed``: as :meth:`_copies_held`."""
        if not len(idx):
            return None if not self.dev.is_cuda else []
        pool, layer = self.pool, plan.layer
        r, e, previous = self._copies_held(plan, idx, experts, rows, staging, listed)
        if self.dev.is_cuda and after is None:
            after = [pool.last_use[i] for i in r]
        w0 = time.perf_counter()
        ends = self.copies.issue_now(pool.rows_view, self.store.weights, r, layer, e, plan.step, after=after,
                                     previous=previous, pause=sw)
        if ends is None:  # the CPU device: the lane waited for its copies while they were made
            self._wait[layer] += time.perf_counter() - w0
        return ends

    def _copies_held(self, plan: LayerPlan, idx: np.ndarray, experts: np.ndarray, rows: np.ndarray, staging: bool,
                     listed: bool) -> tuple:
        """The on-demand copies of lane positions ``idx`` made ready to issue: their rows hold their experts, and the
        background copies into them not done yet are to go first: (rows, experts, those copies' tickets).
        ``staging``: the rows are staging buffers, which no background copy writes. ``listed``: ``idx`` are the
        copies the route call listed (``kernels.W_COPIES``), whose rows it made hold their experts."""
        pool = self.pool
        if listed:
            r, e = self._route_ws.wi[_kernels.W_COPIES + 1:_kernels.W_COPIES + 3, :len(idx)].tolist()
        else:
            ri, ei = rows[idx], experts[idx]
            pool.hold_rows(ri, plan.layer, ei)
            r, e = ri.tolist(), ei.tolist()
        tickets = pool.tickets
        held = () if staging else pool.ticketed.intersection(r)  # rows a background copy wrote
        previous = []  # (their copies not done yet: these follow them)
        if held:
            for i in held:
                if not (t := tickets[i]).done:
                    previous.append(t)
                tickets[i] = None
            pool.ticketed.difference_update(held)
        return r, e, previous

    def _wait_events(self, events, issued: np.ndarray, idx: np.ndarray) -> None:
        """CUDA: the compute stream waits for the copies of lane positions ``idx`` (issued as ``issued`` in
        one call; copies on one stream land in order, so the last one's event is enough)."""
        if events:
            last = int(np.searchsorted(issued, idx).max())
            self.compute_stream.wait_event(events[last])

    def _staging_turns(self, plan: LayerPlan, routing: LayerRouting, lanes: "_AccelLane", stage_rows: np.ndarray,
                       per_turn: int, halves: int, first_events, first: np.ndarray, x: torch.Tensor,
                       out_buf: torch.Tensor, sw: Stopwatch) -> None:
        """Turn t (``per_turn`` staged experts, in the rows of half ``t % halves``; the first ``halves`` turns
        copied already, as ``first``): its copies have landed (CUDA: the compute stream waits for them), its
        experts are computed, then turn t + halves is copied into the same buffers (CUDA: after this
        compute's event)."""
        seg, experts, rows, staged = lanes.seg, lanes.experts, lanes.rows, lanes.staged
        turns = [staged[i:i + per_turn] for i in range(0, len(staged), per_turn)]
        events = {}  # turn -> end events of its copies (CUDA)
        if first_events is not None:
            for t in range(min(halves, len(turns))):
                events[t] = [first_events[int(i)] for i in np.searchsorted(first, turns[t])]
        for t, idx in enumerate(turns):
            if events.get(t):
                self.compute_stream.wait_event(events[t][-1])
            end = self._compute(plan, routing, seg[idx], rows[idx], x, out_buf, sw)
            nxt = t + halves
            if nxt < len(turns):
                half = (t % halves) * per_turn
                rows[turns[nxt]] = stage_rows[half:half + len(turns[nxt])]
                ends = self._copy_now(plan, turns[nxt], experts, rows, sw,
                                      after=[end] * len(turns[nxt]) if end is not None else None, staging=True)
                if ends:
                    events[nxt] = ends

    def _single_turns(self, plan: LayerPlan, routing: LayerRouting, lanes: "_AccelLane", stage_rows: np.ndarray,
                      halves: int, first_events, first: np.ndarray, x: torch.Tensor, out_buf: torch.Tensor,
                      sw: Stopwatch, *, held: bool = False) -> None:
        """:meth:`_staging_turns` of one expert each (few staging buffers, many staged experts). The slot table
        is checked and settled and the turns' records made (:meth:`_single_prepare`) before one loop that issues
        nothing but the device work (:meth:`_single_loop`) and keeps its stamps; the stopwatch is stopped across
        that loop and the intervals are recorded as one series per track (:meth:`Timer.add_turns`)."""
        turns = self._single_prepare(plan, routing, lanes, stage_rows, halves, first_events, first, held=held)
        sw.stop()  # the device work of every turn
        self._single_loop(turns, x, out_buf)
        sw.start()
        self._single_after(plan, turns)

    def _single_prepare(self, plan: LayerPlan, routing: LayerRouting, lanes: "_AccelLane", stage_rows: np.ndarray,
                        halves: int, first_events, first: np.ndarray, *, held: bool = False) -> "_Turns":
        """What the loop of one-expert turns needs, the first turns' buffers checked (after their copies are issued:
        they hold their experts, with no copy in flight; the later turns' copies are the loop's own, as no
        background copy writes a staging buffer); then each buffer holds the expert of its last turn, and the turns'
        intervals are recorded as one series per track, of the stamp lists the loop fills. ``held``: the route call
        started the staging schedule (``kernels._route_partition``), which gave the buffers those holds already."""
        pool, layer, dev = self.pool, plan.layer, self.dev
        idx = lanes.staged
        n = len(idx)
        ws = self._route_ws
        if routing is self._ws_routing:  # the turns' experts and pairs, written by the route's compiled call
            W = _kernels.W_TURNS
            E, tokens = ws.wi[W:W + 2, :n].tolist()
            q = sum(tokens)
            if ws.tensors is not None:  # (the CPU device: views)
                pos, tok, w = ws.turn_views(q)
                pairs = (pos, tok, _as_dtype(w, dev.dtype))
            else:
                pairs = self._pairs_on_accel(*ws.turn_arrays(q))
        else:
            sg = lanes.seg[idx]
            E = lanes.experts[idx].tolist()
            lo, per = routing.ptr[sg], routing.ptr[sg + 1] - routing.ptr[sg]
            tokens = per.tolist()
            sel = np.repeat(lo - np.cumsum(per) + per, per) + np.arange(per.sum())  # the pairs in staging order
            pos = routing.positions[sel]
            pairs = self._pairs_on_accel(pos, pos // routing.top_k, routing.weights[sel])
        R = stage_rows[:halves].tolist()  # turn t's buffer: R[t % halves]
        last = [n - 1] if halves == 1 else [(n - 1) & ~1, (n - 2) | 1]  # each buffer's last turn: the last even, odd one
        if not held:
            hold_l, hold_e, inflight = pool.hold_layer, pool.hold_expert, pool.inflight
            for j, lt in enumerate(last):
                r = R[j]
                if hold_l[r] != layer or hold_e[r] != E[j] or inflight[r]:
                    pool.check_rows(np.array([r]), layer, np.array([E[j]]))  # raises, naming what is wrong
                hold_e[r] = E[lt]
        views, bufs = self._turn_buffers(R)
        events = [first_events[int(i)] for i in np.searchsorted(first, idx[:halves])] if dev.is_cuda else None
        turns = _Turns(plan.step, layer, E, tokens, R, halves, last, views, bufs, self._host_experts[layer], pairs,
                       events)
        self.timer.add_turns(turns)
        self.groups["gpu"] += n
        self.grouped_experts["gpu"] += n
        return turns

    def _turn_buffers(self, rows: list[int]) -> tuple:
        """Staging rows ``rows``' (weights as ``forward_prepared`` takes them, buffers), made at their first use
        (the staging buffers a layer takes are the same rows from visit to visit)."""
        key = tuple(rows)
        v = self._turn_bufs.get(key)
        if v is None:
            v = self._turn_bufs[key] = ([self._row_prepared(r) for r in rows], [self.pool.slots[r].data for r in rows])
        return v

    def _pairs_on_accel(self, positions: np.ndarray, tokens: np.ndarray, weights: np.ndarray) -> tuple:
        """Pairs' (flat positions, tokens, weights as a column) as tensors on the accelerator: on CUDA views of one
        transfer from a pinned buffer (:class:`.packed.PinnedRing`: the arrays may be reused at once), without a
        wait."""
        dev = self.dev
        if not dev.is_cuda:
            return torch.from_numpy(positions), torch.from_numpy(tokens), _as_dtype(torch.from_numpy(weights[:, None]),
                                                                                    dev.dtype)
        (pos, tok), (w,) = self._send([positions, tokens], [np.asarray(weights, np.float32)])
        return pos, tok, _as_dtype(w.view(-1, 1), dev.dtype)

    def _row_prepared(self, row: int) -> tuple:
        """Slot ``row``'s weights as the layout's ``forward_prepared`` takes them (``prepare``: views), made at
        its first use (a slot is a fixed row of the pool's table)."""
        v = self._prepared_rows.get(row)
        if v is None:
            v = self._prepared_rows[row] = self.layout.prepare(self.pool.slots[row].data)
        return v

    def _single_loop(self, turns: "_Turns", x: torch.Tensor, out_buf: torch.Tensor) -> None:
        """The device work of the one-expert turns (per turn: the compute from buffer ``t % halves``, then the copy
        of turn t + ``halves`` into it); their stamps appended to the turns' lists (compute starts and ends, copy
        starts and ends). The turns' tokens are gathered in one call (within the first turn's interval) and their
        weighted outputs scattered in one (within the last's): per turn no more than the expert's own calls and the
        copy."""
        E, tokens, halves, views, bufs, src, events = turns.experts, turns.tokens, turns.halves, turns.views, \
            turns.bufs, turns.src, turns.events
        pos_t, tok_t, w_t = turns.pairs
        cuda, n = events is not None, len(E)
        stream, mark, forward, copy_one = self.compute_stream, self.timer.mark, self.layout.forward_prepared, \
            self.copies.copy_one
        starts, ends, c0s, c1s = turns.starts, turns.ends, turns.copy_starts, turns.copy_ends
        ys, xs = [], ()
        for t in range(n):
            if cuda:
                stream.wait_event(events[t])
            starts.append(mark(stream))
            if not t:
                xs = x.index_select(0, tok_t).split(tokens)
            ys.append(forward(views[t % halves], xs[t]))
            if t == n - 1:
                out_buf.index_copy_(0, pos_t, torch.cat(ys) * w_t)
            end = mark(stream)
            ends.append(end)
            if t + halves < n:
                c0, c1 = copy_one(bufs[t % halves], src[E[t + halves]], end)
                c0s.append(c0)
                c1s.append(c1)
                if cuda:
                    events.append(c1)

    def _single_after(self, plan: LayerPlan, turns: "_Turns") -> None:
        """After the loop of one-expert turns: on CUDA each buffer's last compute (a later copy into it waits for it);
        on the CPU device the lane waited while the host copied."""
        if turns.events is not None:
            ends, last_use = turns.ends, self.pool.last_use
            for r, last in zip(turns.rows, turns.last):
                last_use[r] = ends[last]
        elif turns.copy_starts:
            self._wait[plan.layer] += sum(turns.copy_ends) - sum(turns.copy_starts)
        turns.release()

    def _compute(self, plan: LayerPlan, routing: LayerRouting, seg: np.ndarray, rows: np.ndarray, x: torch.Tensor,
                 out_buf: torch.Tensor, sw: Stopwatch):
        """The experts ``seg`` (indices into the routing's experts) from slot ``rows`` as one group; returns the
        compute's end event on CUDA (a later copy into these rows waits for it), else None."""
        pool = self.pool
        stream = self.compute_stream
        if len(seg) == 1:  # one expert (a staging turn): slices of the layer's routing, sent once per layer
            i, row = int(seg[0]), int(rows[0])
            e = int(routing.experts[i])
            if not (pool.hold_layer[row] == plan.layer and pool.hold_expert[row] == e and pool.inflight[row] == 0):
                pool.check_rows(rows, plan.layer, routing.experts[seg])  # raises, naming what is wrong
            droute = self._droute(routing)
            a, b = int(routing.ptr[i]), int(routing.ptr[i + 1])
            sw.stop()
            start = self.timer.mark(stream)
            y = self.layout.forward_prepared(self._row_prepared(row), x.index_select(0, droute[1][a:b]))
            out_buf.index_copy_(0, droute[0][a:b], y * droute[2][a:b])
            end = self.timer.mark(stream)
            sw.start()
            self.timer.add_group("gpu", plan.step, plan.layer, (e,), (b - a,), start, end)
            if stream is not None:
                pool.last_use[row] = end
        else:
            group = self._group(plan, routing, seg, rows)
            sw.stop()
            start, end = self._forward_group(group, x, out_buf)
            sw.start()
            return self._group_done(plan, group, start, end)
        self.groups["gpu"] += 1
        self.grouped_experts["gpu"] += 1
        return end if stream is not None else None

    def _forward_group(self, group: tuple, x: torch.Tensor, out_buf: torch.Tensor) -> tuple:
        """The device work of a group (:meth:`_group`): its outputs into ``out_buf``; its (start, end) stamps."""
        _, lo, table_counts, (pos, tok, offs, pair_rows, w), _, _ = group
        stream = self.compute_stream
        start = self.timer.mark(stream)
        y = self.layout.forward_grouped(self.pool.table[lo:lo + len(table_counts)], x.index_select(0, tok), offs,
                                        table_counts, pair_rows)
        out_buf.index_copy_(0, pos, y * w)
        return start, self.timer.mark(stream)

    def _group_done(self, plan: LayerPlan, group: tuple, start, end):
        """A group's records once computed; on CUDA its end event (:meth:`_compute`'s return value), else None."""
        rec = self._group_booked(plan, group)
        rec[2], rec[3] = start, end
        if self.compute_stream is None:
            return None
        for r in group[0].tolist():
            self.pool.last_use[r] = end  # a later copy into this slot waits for this compute
        return end

    def _group_booked(self, plan: LayerPlan, group: tuple) -> list:
        """A group's record, made before its compute: its (start, end) stamps are to be written into the record's
        items 2 and 3 (:meth:`Timer.add_group_open`)."""
        self.groups["gpu"] += 1
        self.grouped_experts["gpu"] += len(group[0])
        return self.timer.add_group_open("gpu", plan.step, plan.layer, group[4], group[5])

    def _group(self, plan: LayerPlan, routing: LayerRouting, seg: np.ndarray, rows: np.ndarray,
               ws: GroupWorkspace | None = None, unheld: bool = False) -> tuple:
        """A group of the accelerator lane (the experts ``seg`` in slot ``rows``), its rows checked: (its rows
        sorted, the first row lo of its span, the tokens per row of the span, its index tensors on the
        accelerator (:func:`_device_indices`), its experts and their tokens (lists, for the timeline)). With
        numba written into the group workspace (on the CPU device its tensors are views of it), else a
        :class:`GroupIndex`. The layer's first group may have been written by the route call (``_first``). ``ws``:
        another workspace than the lane's (a group built while the last one's views are still to be read).
        ``unheld``: staging buffers the route call gave a lane it settled (none is held), not checked."""
        pool, dev, layer = self.pool, self.dev, plan.layer
        g = len(seg)
        first = self._first
        if first is not None and first[3] == g and not first[4]:  # the layer's first group, written (and checked) by
            return self._written(g)  # the route call
        ws = self._group_ws if ws is None else ws
        if (kernel := _kernels.compiled("group_index_into")) is not None:
            n, lo, span, ready = ws.build(kernel, routing, seg, rows, layer, _NO_SLOTS if unheld else pool.state)
        else:
            gi = GroupIndex.build(routing, seg, rows, (layer, pool.hold_layer, pool.hold_expert, pool.inflight))
            if not (gi.rows_ready or unheld):
                pool.check_rows(gi.rows, layer, gi.experts)  # raises, naming what is wrong (or checks)
            tensors = _device_indices(gi.pairs, gi.token_rows(routing.top_k), gi.offs, gi.row_of_pairs, gi.weights,
                                      self._send, dev.dtype, self.layout.bias)
            return gi.rows, gi.lo, gi.table_counts, tensors, gi.experts, gi.counts
        g_rows = ws.small[0, :g]
        if not ready:
            pool.check_rows(g_rows, layer, ws.small[1, :g])  # raises, naming what is wrong
        if ws.tensors is not None:  # the CPU device: views of the workspace's tensors (made once per length)
            t_pos, t_tok, t_rows, t_w, t_offs = ws.views(n, span)
            tensors = (t_pos, t_tok, t_offs, t_rows if self.layout.bias else None,
                       t_w if t_w.dtype == dev.dtype else t_w.to(dev.dtype))
        else:
            tensors = self._sent_indices(ws, n, span)
        experts, counts = ws.small[1:, :g].tolist()
        return g_rows, lo, ws.table_counts[:span], tensors, experts, counts

    def _sent_indices(self, ws: GroupWorkspace, n: int, span: int) -> tuple:
        """:func:`_device_indices` of a group of ``n`` pairs over ``span`` rows built in ``ws``, sent to the accelerator
        (a method of its own: the function it passes would make ``_group``'s locals cells at every call)."""
        ints = ws.ints
        return _device_indices(ints[0, :n], ints[1, :n], ws.offs[:span], lambda: ints[2, :n], ws.w[:n], self._send,
                               self.dev.dtype, self.layout.bias)

    def _written(self, g: int) -> tuple:
        """:meth:`_group` of the layer's first group (``g`` experts), as the route call wrote and checked it (the CPU
        device: its tensors are views of the workspace's), taken."""
        (n, lo, span, _, _), ws = self._first, self._group_ws
        self._first = None
        t_pos, t_tok, t_rows, t_w, t_offs = ws.views(n, span)
        dtype = self.dev.dtype
        tensors = (t_pos, t_tok, t_offs, t_rows if self.layout.bias else None,
                   t_w if t_w.dtype == dtype else t_w.to(dtype))
        experts, counts = ws.small[1:, :g].tolist()  # (as _group's: the timeline keeps them)
        return ws.small[0, :g], lo, ws.table_counts[:span], tensors, experts, counts

    def _droute(self, routing: LayerRouting) -> list:
        """The layer's routing on the accelerator (flat positions, token rows, weights), made once per layer
        (on CUDA from pinned memory, without a wait)."""
        if self._droute_of is not routing:
            dev = self.dev
            if routing is self._ws_routing and self._route_ws.tensors is not None:  # the CPU device: views
                pos, tok, w = self._route_ws.views(len(routing.positions))
                self._droute_list, self._droute_of = [pos, tok, _as_dtype(w, dev.dtype)], routing
                return self._droute_list
            pos = routing.positions
            self._droute_list = list(self._pairs_on_accel(pos, pos // routing.top_k, routing.weights))
            self._droute_of = routing
        return self._droute_list

    # ---- pieces -------------------------------------------------------------------------------
    def _is_present(self, rows: np.ndarray) -> np.ndarray:
        """Have the rows' weights landed? (The GPU lane's only question; tests replace it to show that
        :meth:`SlotPool.check_rows` catches a compute from a slot whose copy is still in flight.)"""
        return self.pool.landed(rows)

    def _copy_many(self, rows: "np.ndarray | list[int]", layers: list[int], experts: list[int], priority: int,
                   what: tuple, others: list[int] | None = None) -> CopyTicket:
        """One request: ``experts`` (of ``layers``) from the host store into slot ``rows``, in this order."""
        pool = self.pool
        r = rows if type(rows) is list else rows.tolist()
        tickets = pool.tickets
        after = [pool.last_use[i] for i in r] if self.dev.is_cuda else None
        previous = [t for i in r if (t := tickets[i]) is not None and not t.taken]
        ticket = self.copies.submit_many(pool.rows_view, self.store.weights, r, (layers, experts), priority,
                                         (*what, layers, experts, others), after=after, previous=previous,
                                         rows=r, inflight=pool.inflight)
        for i in r:
            tickets[i] = ticket
        pool.ticketed.update(r)
        return ticket

    def _free_prefetch(self, slot: Slot) -> None:
        self.pool.release_prefetch(slot)
        self._issue_deferred()

    def _issue_deferred(self) -> None:
        """Start waiting prefetches, in issue order, while prefetch buffers are free (one request)."""
        pool, todo = self.pool, self.deferred
        if not (todo and pool.prefetch_free):
            return
        rows, layers, experts = [], [], []  # (one loop: each comprehension is a function call in Python 3.11)
        step = todo[0][2]
        for _ in range(min(len(todo), len(pool.prefetch_free))):
            t, e, _ = todo.popleft()
            rows.append(pool.take_prefetch(t, e).index)
            layers.append(t)
            experts.append(e)
        self._copy_many(rows, layers, experts, BACKGROUND, ("prefetch", step))

    def _cpu_lane(self, step: int, layer: int, seg: np.ndarray, x: torch.Tensor, r: LayerRouting, ready=None):
        """The CPU experts (``seg``: their indices in ``r.experts``, ascending, unique) as one grouped call from
        host memory: (flat positions, weighted outputs). With numba its indices are written into the lane's
        workspace by one compiled loop (``kernels._group_index_into``) and taken as views of its tensors.
        ``ready`` (CUDA): the event after which ``x`` (copied from the accelerator without a wait) is there, waited
        for once the indices are built (they do not read ``x``), so the build overlaps the copy."""
        kernel = _kernels.compiled("group_index_into")
        if kernel is not None:
            ws = self._cpu_ws
            n, lo, span, _ = ws.build(kernel, r, seg, r.experts[seg], -1, _NO_SLOTS)
            pos, tok, pair_rows, w, offs = ws.views(n, span)
            pair_rows = pair_rows if self.layout.bias else None
            w, table_counts = _as_dtype(w, self.dev.dtype), ws.table_counts[:span]
            experts, counts = ws.small[1:, :len(seg)].tolist()
        else:
            gi = GroupIndex.whole(r) if len(seg) == len(r.experts) else GroupIndex.build(r, seg, r.experts[seg])
            pos, tok, offs, pair_rows, w = _device_indices(gi.pairs, gi.token_rows(r.top_k), gi.offs,
                                                           gi.row_of_pairs, gi.weights, None, self.dev.dtype,
                                                           self.layout.bias)
            lo, table_counts, experts, counts = gi.lo, gi.table_counts, gi.experts, gi.counts
        if ready is not None:
            ready.synchronize()
        start = self.timer.mark()
        y = self.layout.forward_grouped(self._host_layers[layer][lo:lo + len(table_counts)], x.index_select(0, tok),
                                        offs, table_counts, pair_rows) * w
        end = self.timer.mark()
        self.timer.add_group("cpu", step, layer, experts, counts, start, end)
        self.groups["cpu"] += 1
        self.grouped_experts["cpu"] += len(seg)
        return pos, y

    def finish(self) -> None:
        """Let every background copy land and the device finish (end of a run)."""
        self.copies.drain()
        self.dev.synchronize()
        self.pool.check()
        for tickets in self.swaps_landing.values():
            for t in tickets:
                t.wait()

    def close(self) -> None:
        self.copies.close()
        self.cpu.close()




class _Turns(TurnLoop):
    """A layer's one-expert staging turns (:meth:`OffloadRuntime._single_prepare`), the timeline's record of their
    loop (:class:`~.timing.TurnLoop`: experts and tokens in turn order, the stamp lists the loop fills) with what the
    loop needs: the ``halves`` buffers they cycle through (turn t in ``rows[t % halves]``) and each used buffer's last
    turn, the buffers' prepared weights (``views``) and tensors (``bufs``), the layer's host weights (``src``), the
    turns' pairs on the accelerator (flat positions, tokens, weights) and, on CUDA, the end events of the first turns'
    copies (the loop appends its own). The timeline keeps the record to the run's end: :meth:`release` lets go of
    the buffers once the loop is done."""

    __slots__ = ("rows", "last", "views", "bufs", "src", "pairs", "events")

    def __init__(self, step, layer, experts, tokens, rows, halves, last, views, bufs, src, pairs, events):
        TurnLoop.__init__(self, step, layer, experts, tokens, halves)
        self.rows, self.last, self.views, self.bufs, self.src, self.pairs, self.events = \
            rows, last, views, bufs, src, pairs, events

    def release(self) -> None:
        self.views = self.bufs = self.src = self.pairs = self.events = None


class _AccelLane:
    """The accelerator experts of one layer visit (touch order): their ids (``experts``), indices into the
    routing's experts (``seg``) and slot rows (``rows``; -1 = a staged expert, given a staging buffer by its
    turn); positions (into ``experts``) of the experts whose weights are there or coming by a prefetch
    (``ready``), of the admitted on-demand ones (``fetched``) and of the staged ones (``staged``, touch
    order), which follow each other in ``order``; ``freed``: positions whose prefetch buffer is freed after their
    compute (the cache declined them); ``settled``: the slot table settled and the layer checked ahead of the lane's
    device work, which ran to the layer's end with the stopwatch stopped (:meth:`OffloadRuntime._settle_ahead`)."""

    __slots__ = ("n", "experts", "seg", "rows", "order", "ready", "fetched", "staged", "freed",
                 "prefetched_in_flight", "staging_used", "all_cached", "settled")

    @classmethod
    def of(cls, plan: LayerPlan, pool: SlotPool, split: np.ndarray, order: np.ndarray, hits: int, ready: int,
           fetched: int, *, admitted: tuple | None = None) -> "_AccelLane":
        """``split``, ``order`` and the counts: the lane split of ``kernels._partition``. ``admitted``: the
        prefetched experts were taken from their buffers and adopted or declined, and the fetched ones hold their
        cache rows (``split[2]``, the table set; ``kernels._route_partition``): (adopted, declined lane positions,
        whether a prefetched one's copy is in flight); only the free lists and the counts are left. Without
        accelerator experts the one empty lane (nothing reads or writes its arrays)."""
        if not split.shape[1]:
            return _NO_LANE
        lane = cls()
        lane.staging_used = 0
        lane.settled = False
        lane.prefetched_in_flight = False
        lane.freed = []
        lane.n = n = split.shape[1]
        lane.seg, lane.rows, lane.experts, lane.order = split[1], split[2], split[3], order
        lane.all_cached = n > 0 and hits == n
        if lane.all_cached or not n:  # (every one cached: one group, nothing to copy or free)
            lane.ready, lane.fetched, lane.staged = order, _EMPTY, _EMPTY
            return lane
        layer, rows = plan.layer, lane.rows
        lane.ready, lane.fetched, lane.staged = order[:ready], order[ready:ready + fetched], order[ready + fetched:]
        if admitted is not None:
            if ready > hits:
                pool.took_prefetched(layer, ready - hits, admitted[0])
                lane.freed, lane.prefetched_in_flight = admitted[1], admitted[2]
            if fetched:
                pool.took_free(layer, fetched)
            return lane
        if ready > hits:  # prefetched ones (at most the prefetch buffers), in touch order
            r = lane.ready
            for i in r[split[4][r] == _kernels.PREFETCHED_KIND].tolist():
                e = int(lane.experts[i])
                slot = pool.pop_prefetched(layer, e)
                if plan.admitted[split[0, i]]:
                    pool.adopt(layer, e, slot)
                else:
                    lane.freed.append(i)
                rows[i] = slot.index
                lane.prefetched_in_flight |= bool(pool.inflight[slot.index])
        if fetched:
            rows[lane.fetched] = pool.admit_many(layer, lane.experts[lane.fetched])
        return lane


def _empty_lane() -> _AccelLane:
    lane = _AccelLane()
    lane.n, lane.staging_used, lane.prefetched_in_flight, lane.all_cached, lane.settled = 0, 0, False, False, False
    lane.freed = ()  # (shared: nothing may be added)
    lane.experts = lane.seg = lane.rows = lane.order = lane.ready = lane.fetched = lane.staged = _EMPTY
    return lane


_NO_LANE = _empty_lane()  # a layer visit without accelerator experts


def _checked_split(plan: LayerPlan, routing: LayerRouting, status: int, cpu_seg, lane, order, hits, ready, fetched):
    """What the compiled ``kernels._partition`` returned (as ``OffloadRuntime._partition``), its refusals raised."""
    if status == 2:
        raise AssertionError(f"layer {plan.layer} expert {int(lane[3, 0])} is not in the slot table's cache")
    if status == 1:
        _routing_differs(plan, routing)
    return cpu_seg, (lane, order, hits, ready, fetched)


def _routing_differs(plan: LayerPlan, routing: LayerRouting) -> None:
    raise ValueError(f"step {plan.step} layer {plan.layer}: the routing's experts {routing.experts.tolist()} with "
                     f"{routing.counts().tolist()} tokens differ from the plan's {plan.experts.tolist()}")


def _device_indices(pairs: np.ndarray, tokens: np.ndarray, offs: np.ndarray, pair_rows, weights: np.ndarray,
                    send, dtype: torch.dtype, bias: bool):
    """A group's index tensors: flat positions, token rows, offsets (int32), row of each pair within the group's
    span (biases only; ``pair_rows`` makes them) and gate weights (n x 1, ``dtype``). On the host (``send``
    None) views of the arrays; else on the accelerator, views of one transfer (``send``: :meth:`.packed.PinnedRing.send`;
    the offsets and weights ride in its tail, no cast on the device), without a wait; the caller may reuse the
    arrays at once."""
    if send is None:
        rows = torch.from_numpy(pair_rows()) if bias else None
        return torch.from_numpy(pairs), torch.from_numpy(tokens), torch.from_numpy(offs), rows, \
            _as_dtype(torch.from_numpy(weights[:, None]), dtype)
    ints, (offs_t, w) = send([pairs, tokens] + ([pair_rows()] if bias else []),
                             [np.asarray(offs, np.int32), np.asarray(weights, np.float32)])
    return ints[0], ints[1], offs_t, ints[2] if bias else None, _as_dtype(w.view(-1, 1), dtype)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when it is that already (fp32 gate weights on the CPU device)."""
    return t if t.dtype == dtype else t.to(dtype)
