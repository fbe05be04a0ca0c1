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

import numpy as np
import torch

from dali_exec.executor.copies import BACKGROUND, ON_DEMAND, CopyEngine, CopyTicket
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_exec.executor.grouped import GroupIndex
from dali_exec.executor.routing import LayerRouting
from dali_exec.executor.slots import Slot, SlotPool
from dali_exec.executor.store import HostExpertStore
from dali_exec.executor.timing import Stopwatch, Timer
from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED, LayerPlan

NO_RELEASE, STAGING, PREFETCH = 0, 1, 2  # what happens to an accelerator expert's buffer after its compute
_EMPTY = np.zeros(0, np.int64)


class OffloadRuntime:
    """Cache slots, prefetch and staging buffers, a copy lane and a CPU lane for one model's experts.

    ``capacities`` (slots per layer), ``prefetch_slots`` and ``staging_slots`` come from the memory
    plan; ``initial`` is the controller's initial cache contents. ``copy_delay_s`` (tests) holds every
    copy back. Per-layer accumulators: ``layer_wait`` (seconds the accelerator lane waited for
    weights, host-measured) and ``layer_bookkeeping`` / ``layer_bookkeeping_cpu`` (the runtime's own host
    work, wall-clock / thread-CPU seconds: slot table, routing indices, issuing copies, choosing the next
    expert; not computes, transfers of activations or waits)."""

    def __init__(self, store: HostExpertStore, devices: Devices, capacities: np.ndarray, prefetch_slots: int,
                 staging_slots: int, *, cpu_threads: int, timer: Timer | None = None, copy_delay_s: float = 0.0,
                 cpu_inline: bool = False):
        self.store, self.dev = store, devices
        #: run the CPU lane in the calling thread (when it has the lane's thread count) instead of the worker:
        #: for an accelerator that is the CPU device and shares its threads, where the lanes cannot overlap
        self.cpu_inline = cpu_inline
        self.layout = store.layout
        self.timer = timer or Timer(devices.accel if devices.is_cuda else None)
        self.pool = SlotPool(capacities, prefetch_slots, staging_slots, self.layout.numel, devices.dtype, devices.accel,
                             num_experts=store.num_experts)
        self.copies = CopyEngine(devices.copy_stream, self.timer, delay_s=copy_delay_s, device=devices.accel)
        self.cpu = CpuWorker(cpu_threads)
        self.compute_stream = torch.cuda.current_stream(devices.accel) if devices.is_cuda else None
        L = len(capacities)
        self.swaps_landing: dict[int, list[CopyTicket]] = {}
        self.deferred: deque[tuple[int, int, int]] = deque()  # prefetches waiting for a free buffer: (layer, expert, step)
        self.layer_wait = np.zeros(L)
        self.layer_bookkeeping = np.zeros(L)
        self.layer_bookkeeping_cpu = np.zeros(L)
        #: grouped calls per lane (``gpu``, ``cpu``) and the experts they computed
        self.groups = {"gpu": 0, "cpu": 0}
        self.grouped_experts = {"gpu": 0, "cpu": 0}

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

    @property
    def slot_bytes(self) -> int:
        """Accelerator bytes of all weight slots (cache + prefetch + staging): all that is allocated for experts."""
        return self.pool.nbytes

    # ---- per layer ----------------------------------------------------------------------------
    def start_layer(self, plan: LayerPlan) -> None:
        """Steps before the dense part: swaps of the last visit land, prefetch buffers freed and issued."""
        layer = plan.layer
        sw = Stopwatch().start()
        for ticket in self.swaps_landing.pop(layer, []):
            if not ticket.is_done():
                sw.stop()
                w0 = time.perf_counter()
                ticket.wait()
                self.layer_wait[layer] += time.perf_counter() - w0
                sw.start()
            ticket.wait()  # re-raises a failed copy
        for e in plan.prefetch_wasted:
            self._free_prefetch(self.pool.pop_prefetched(layer, e))
        for target, e in plan.prefetches:
            self.deferred.append((target, e, plan.step))
        self._issue_deferred()
        sw.stop()
        self._book(layer, sw)

    def _book(self, layer: int, sw: Stopwatch) -> None:
        self.layer_bookkeeping[layer] += sw.wall
        self.layer_bookkeeping_cpu[layer] += sw.cpu

    def run_experts(self, plan: LayerPlan, x: torch.Tensor, routing: LayerRouting, *,
                    uncounted_on_cpu: bool = False) -> torch.Tensor:
        """The layer's routed experts on ``x`` (T x H, the gate input, on the dense device): the
        combined output sum_r w[t, r] * expert(x[t]) (T x H, on ``x``'s device).

        Tokens the routing does not count (``LayerRouting.group(counted=...)``: e.g. padding a real model
        computes anyway) ride along with the plan's experts; experts that only such tokens use are not part
        of the plan: their pairs stay 0, or, with ``uncounted_on_cpu``, the CPU lane computes them too."""
        sw = Stopwatch().start()  # stopped around computes, activation transfers and waits
        layer, step = plan.layer, plan.step
        if not routing.matches(plan.experts, plan.counts):
            raise ValueError(f"step {step} layer {layer}: the routing's experts {routing.experts.tolist()} with "
                             f"{routing.counts().tolist()} tokens differ from the plan's {plan.experts.tolist()}")
        dev, pool = self.dev, self.pool
        T, k, H = routing.num_tokens, routing.top_k, self.layout.hidden
        if len(plan.evicted):
            pool.evict_many(layer, np.asarray(plan.evicted))
        lanes = _AccelLane.of(plan, pool)
        if not lanes.n and (uncounted_on_cpu or routing.counted is None or len(plan.experts) == len(routing.experts)):
            cpu_seg = np.arange(len(routing.experts))  # every expert of the routing: the whole layer on the CPU
        else:
            cpu_seg = np.searchsorted(routing.experts, plan.experts[plan.source == CPU])
            if uncounted_on_cpu and routing.counted is not None:
                cpu_seg = np.concatenate([cpu_seg, np.flatnonzero(routing.counts() == 0)])
            cpu_seg.sort()
        self._issue_deferred()  # adoptions may have freed prefetch buffers

        # the CPU lane starts first and runs while the accelerator lane works; inline (same thread and
        # threads) it runs when the accelerator lane would first wait for a copy, or after it
        sw.stop()
        cpu_job = None
        inline: list = []
        if cpu_seg.size:
            x_host = x if x.device.type == "cpu" else x.to(dev.host)
            if (self.cpu_inline or not lanes.n) and torch.get_num_threads() == self.cpu.threads:
                inline.append(lambda: self._cpu_lane(step, layer, cpu_seg, x_host, routing))
            else:
                cpu_job = self.cpu.submit(self._cpu_lane, step, layer, cpu_seg, x_host, routing)
        x_acc = x if (x.device == dev.accel or not lanes.n) else x.to(dev.accel, non_blocking=True)
        out_buf = torch.zeros((T * k, H), dtype=dev.dtype, device=dev.accel)
        sw.start()

        cpu_out: list = []
        if lanes.n:
            self._accelerator_lane(plan, lanes, routing, x_acc, out_buf, sw, inline, cpu_out)
        sw.stop()
        if inline:
            cpu_out.append(inline.pop()())
        if cpu_job is not None:
            cpu_out.append(cpu_job.result())
        for pos, vals in cpu_out:
            out_buf.index_copy_(0, pos.to(dev.accel, non_blocking=True), vals.to(dev.accel, non_blocking=True))
        out = out_buf.view(T, k, H).sum(dim=1)
        out = out if out.device == x.device else out.to(x.device)
        sw.start()

        if plan.swaps:
            ins, outs = [a for a, _ in plan.swaps], [b for _, b in plan.swaps]
            rows = np.array([pool.swap(layer, a, b).index for a, b in plan.swaps], np.int64)
            self.swaps_landing[layer] = [self._copy_many(rows, [layer] * len(ins), ins, BACKGROUND, ("swap", step),
                                                         outs)]
        pool.check_layer(layer, lanes.staging_used)
        if self.deferred:
            raise AssertionError(f"step {step} layer {layer}: prefetches still wait for a buffer at the layer's end")
        sw.stop()
        self._book(layer, sw)
        return out

    def _accelerator_lane(self, plan: LayerPlan, lanes: "_AccelLane", routing: LayerRouting, x: torch.Tensor,
                          out_buf: torch.Tensor, sw: Stopwatch, inline: list, cpu_out: list) -> None:
        """Issue the on-demand copies, then compute whatever has landed as one group, until all is done.
        ``inline``: the CPU lane's work when it runs in this thread, done instead of the first wait.

        After the first group (typically every resident expert at once) the turns are few experts each
        (copies landing, staging buffers cycling): the loop keeps plain lists, not arrays."""
        pool, layer = self.pool, plan.layer
        rows, release = lanes.rows.tolist(), lanes.release.tolist()
        experts, seg = lanes.experts.tolist(), np.searchsorted(routing.experts, lanes.experts).tolist()
        todo = lanes.fetch_todo.tolist()
        remaining = list(range(lanes.n))
        droute: list = []  # the layer's routing on the accelerator, made by the first single-expert turn
        inflight = pool.inflight
        hooked = type(self)._is_present is not _OWN_IS_PRESENT  # a replacement (tests) is asked, rows at once
        while remaining:
            if todo:
                self._fetch(plan, lanes, todo, rows, experts)
            have = [i for i in remaining if rows[i] >= 0]
            if hooked:
                landed = self._is_present(np.array([rows[i] for i in have], np.int64))
                ready = have if landed is True else [i for i, ok in zip(have, np.asarray(landed).tolist()) if ok]
            else:
                ready = [i for i in have if inflight[rows[i]] == 0]
            if inline and len(ready) < len(remaining):  # copies in flight: the CPU lane's work first, then one group
                sw.stop()
                cpu_out.append(inline.pop()())
                sw.start()
                continue
            if not ready:
                if not have:
                    raise AssertionError(f"step {plan.step} layer {layer}: no GPU expert can become ready")
                sw.stop()
                w0 = time.perf_counter()
                self.copies.wait_rows(inflight, [rows[i] for i in have])
                self.layer_wait[layer] += time.perf_counter() - w0
                sw.start()
                continue
            if len(ready) < len(remaining):
                done = set(ready)
                remaining = [i for i in remaining if i not in done]
            else:
                remaining = []
            if len(ready) == 1:  # one expert (a staging turn, a copy landing alone)
                self._accelerator_one(plan, routing, seg[ready[0]], rows[ready[0]], x, out_buf, sw, droute)
            else:
                self._accelerator_group(plan, routing, np.array([seg[i] for i in ready], np.int64),
                                        np.array([rows[i] for i in ready], np.int64), x, out_buf, sw)
            for i in ready:
                if release[i] == STAGING:
                    pool.release_staging(pool.slots[rows[i]])
                    lanes.staging_used -= 1
                elif release[i] == PREFETCH:
                    self._free_prefetch(pool.slots[rows[i]])

    def _fetch(self, plan: LayerPlan, lanes: "_AccelLane", todo: list[int], rows: list[int], experts: list[int]) -> None:
        """Issue the on-demand copies not issued yet (``todo``, touch order), up to the first staged one that
        finds no free staging buffer, as one request (``rows`` gets the staging buffers taken)."""
        pool, layer = self.pool, plan.layer
        take: list[int] = []
        while todo:
            i = todo[0]
            if rows[i] < 0:
                if not pool.staging_free:
                    break
                rows[i] = pool.take_staging(layer, experts[i]).index
                lanes.staging_used += 1
            take.append(todo.pop(0))
        if take:
            self._copy_many(np.array([rows[i] for i in take], np.int64), [layer] * len(take),
                            [experts[i] for i in take], ON_DEMAND, ("fetch", plan.step))

    def _accelerator_group(self, plan: LayerPlan, routing: LayerRouting, seg: np.ndarray, rows: np.ndarray,
                           x: torch.Tensor, out_buf: torch.Tensor, sw: Stopwatch) -> None:
        pool, dev = self.pool, self.dev
        gi = GroupIndex.build(routing, seg, rows)
        pool.check_rows(gi.rows, plan.layer, gi.experts)
        pos, tok, offs, pair_rows, w = _device_indices(gi, routing, dev.accel, dev.dtype, self.layout.bias)
        stream = self.compute_stream
        sw.stop()
        start = self.timer.mark(stream)
        y = self.layout.forward_grouped(gi.span(pool.table), x.index_select(0, tok), offs, gi.table_counts, pair_rows)
        out_buf.index_copy_(0, pos, y * w)
        end = self.timer.mark(stream)
        sw.start()
        if stream is not None:
            for r in gi.rows.tolist():
                pool.last_use[r] = end  # a later copy into this slot waits for this compute
        self.timer.add_group("gpu", plan.step, plan.layer, gi.experts, gi.counts, start, end)
        self.groups["gpu"] += 1
        self.grouped_experts["gpu"] += len(gi)

    def _accelerator_one(self, plan: LayerPlan, routing: LayerRouting, i: int, row: int, x: torch.Tensor,
                         out_buf: torch.Tensor, sw: Stopwatch, droute: list) -> None:
        """One expert from its slot: its rows, positions and weights as slices of the layer's routing on the
        accelerator (sent there once per layer, on CUDA from pinned memory without a wait)."""
        pool, dev = self.pool, self.dev
        if not droute:
            pos = routing.positions
            ints = torch.from_numpy(np.concatenate([pos, pos // routing.top_k]))
            w = torch.from_numpy(routing.weights)
            if dev.is_cuda:
                ints, w = (t.pin_memory().to(dev.accel, non_blocking=True) for t in (ints, w))
            droute += [ints[:len(pos)], ints[len(pos):], w.to(dev.dtype).unsqueeze(1)]
        e = int(routing.experts[i])
        a, b = int(routing.ptr[i]), int(routing.ptr[i + 1])
        if not (pool.hold_layer[row] == plan.layer and pool.hold_expert[row] == e and pool.inflight[row] == 0):
            pool.check_rows(np.array([row]), plan.layer, np.array([e]))  # raises, naming what is wrong
        stream = self.compute_stream
        sw.stop()
        start = self.timer.mark(stream)
        y = self.layout.forward(pool.slots[row].data, x.index_select(0, droute[1][a:b]))
        out_buf.index_copy_(0, droute[0][a:b], y * droute[2][a:b])
        end = self.timer.mark(stream)
        sw.start()
        if stream is not None:
            pool.last_use[row] = end
        self.timer.add_group("gpu", plan.step, plan.layer, (e,), (b - a,), start, end)
        self.groups["gpu"] += 1
        self.grouped_experts["gpu"] += 1

    # ---- pieces -------------------------------------------------------------------------------
    def _is_present(self, rows: np.ndarray) -> np.ndarray:
        """Have the rows' weights landed? (The GPU lane's only question; tests replace it to show that
        :meth:`SlotPool.check_rows` catches a compute from a slot whose copy is still in flight.)"""
        return self.pool.landed(rows)

    def _copy_many(self, rows: np.ndarray, layers: list[int], experts: list[int], priority: int, what: tuple,
                   others: list[int] | None = None) -> CopyTicket:
        """One request: ``experts`` (of ``layers``) from the host store into slot ``rows``, in this order."""
        pool = self.pool
        r = rows.tolist()
        tickets = pool.tickets
        after = [pool.last_use[i] for i in r] if self.dev.is_cuda else None
        previous = [t for i in r if (t := tickets[i]) is not None and not t.taken]
        ticket = self.copies.submit_many(pool.rows_view, self.store.weights, r, (layers, experts), priority,
                                         (*what, layers, experts, others), after=after, previous=previous,
                                         rows=rows, inflight=pool.inflight)
        for i in r:
            tickets[i] = ticket
        return ticket

    def _free_prefetch(self, slot: Slot) -> None:
        self.pool.release_prefetch(slot)
        self._issue_deferred()

    def _issue_deferred(self) -> None:
        """Start waiting prefetches, in issue order, while prefetch buffers are free (one request)."""
        pool, todo = self.pool, self.deferred
        if not (todo and pool.prefetch_free):
            return
        take = [todo.popleft() for _ in range(min(len(todo), len(pool.prefetch_free)))]
        rows = np.array([pool.take_prefetch(t, e).index for t, e, _ in take], np.int64)
        self._copy_many(rows, [t for t, _, _ in take], [e for _, e, _ in take], BACKGROUND, ("prefetch", take[0][2]))

    def _cpu_lane(self, step: int, layer: int, seg: np.ndarray, x: torch.Tensor, r: LayerRouting):
        """The CPU experts (``seg``: their indices in ``r.experts``, ascending, unique) as one grouped call from
        host memory: (flat positions, weighted outputs)."""
        gi = GroupIndex.whole(r) if len(seg) == len(r.experts) else GroupIndex.build(r, seg, r.experts[seg])
        pos, tok, offs, pair_rows, w = _device_indices(gi, r, self.dev.host, self.dev.dtype, self.layout.bias)
        start = self.timer.mark()
        y = self.layout.forward_grouped(gi.span(self.store.weights[layer]), x.index_select(0, tok), offs,
                                        gi.table_counts, pair_rows) * w
        end = self.timer.mark()
        self.timer.add_group("cpu", step, layer, gi.experts, gi.counts, start, end)
        self.groups["cpu"] += 1
        self.grouped_experts["cpu"] += len(gi)
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


_OWN_IS_PRESENT = OffloadRuntime._is_present


class _AccelLane:
    """The accelerator experts of one layer visit (touch order) and their buffers: ``rows`` (slot row,
    -1 = a staged expert still without a staging buffer), ``release`` (what to free after the compute),
    ``fetch_todo`` (positions whose on-demand copy is not issued yet)."""

    __slots__ = ("n", "experts", "rows", "release", "fetch_todo", "staging_used")

    @classmethod
    def of(cls, plan: LayerPlan, pool: SlotPool) -> "_AccelLane":
        lane = cls()
        lane.staging_used = 0
        if not plan.on_gpu.any():
            lane.n = 0
            lane.experts = lane.rows = lane.release = lane.fetch_todo = _EMPTY
            return lane
        layer = plan.layer
        idx = np.flatnonzero(plan.on_gpu)
        lane.n = len(idx)
        lane.experts = plan.experts[idx].astype(np.int64)
        lane.rows = np.full(lane.n, -1, np.int64)
        lane.release = np.zeros(lane.n, np.int8)
        src = plan.source[idx]
        hit = src == HIT
        lane.rows[hit] = pool.cached_rows(layer, lane.experts[hit])
        for i in np.flatnonzero(src == PREFETCHED).tolist():  # at most the prefetch buffers
            e = int(lane.experts[i])
            slot = pool.pop_prefetched(layer, e)
            if plan.admitted[idx[i]]:
                pool.adopt(layer, e, slot)
            else:
                lane.release[i] = PREFETCH
            lane.rows[i] = slot.index
        fetch = np.flatnonzero(src == FETCH)
        admitted = plan.admitted[idx[fetch]]
        lane.rows[fetch[admitted]] = pool.admit_many(layer, lane.experts[fetch[admitted]])
        lane.release[fetch[~admitted]] = STAGING
        lane.fetch_todo = fetch
        return lane


def _device_indices(gi: GroupIndex, r: LayerRouting, device: torch.device, dtype: torch.dtype, bias: bool):
    """A group's index tensors on ``device``: flat positions, token rows, offsets (int32), row of each
    pair within the group's span (biases only) and gate weights (n x 1, ``dtype``). On CUDA one packed
    copy from pinned memory (and one for the weights), without a wait."""
    pos = gi.pairs
    w = torch.from_numpy(gi.weights)
    if device.type != "cuda":
        rows = torch.from_numpy(gi.row_of_pairs()) if bias else None
        return (torch.from_numpy(pos), torch.from_numpy(gi.token_rows(r.top_k)), torch.from_numpy(gi.offs), rows,
                w.to(dtype).unsqueeze(1))
    ints = [pos, gi.token_rows(r.top_k), gi.offs.astype(np.int64)] + ([gi.row_of_pairs()] if bias else [])
    packed = torch.from_numpy(np.concatenate(ints)).pin_memory().to(device, non_blocking=True)
    w = w.pin_memory().to(device, non_blocking=True)
    n, m = len(pos), len(gi.offs)
    pair_rows = packed[2 * n + m:] if bias else None
    return packed[:n], packed[n:2 * n], packed[2 * n:2 * n + m].to(torch.int32), pair_rows, w.to(dtype).unsqueeze(1)
