"""The offloading runtime: performs the controller's :class:`LayerPlan` for one MoE layer on real devices.

Per layer, in the simulator's order (docs/simulator.md):

1. :meth:`OffloadRuntime.start_layer`: wait for the cache swaps of the layer's previous visit; free
   the prefetch buffers of experts prefetched for this layer but not used; start the prefetches the
   plan issues (background copies; a prefetch whose buffer is still being read waits for it);
2. the caller runs the dense part (attention, router, shared experts);
3. :meth:`OffloadRuntime.run_experts`: evictions and admissions update the slot table; the CPU lane
   (a worker thread) computes the CPU experts from host memory while the accelerator lane issues the
   on-demand copies in touch order (a staged one when a staging buffer is free) and computes, in touch
   order, the first expert whose weights have landed, else waits for the next copy; the outputs are
   combined exactly (:mod:`.routing`); the swaps the cache asked for start in the background.

Everything the runtime does is dictated by the plan; it makes no decision of its own.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from dali_exec.executor.copies import BACKGROUND, ON_DEMAND, CopyEngine, CopyTicket
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.devices import Devices
from dali_exec.executor.routing import DeviceRouting, LayerRouting
from dali_exec.executor.slots import Slot, SlotPool
from dali_exec.executor.store import HostExpertStore
from dali_exec.executor.timing import Stopwatch, Timer
from dali_sim.runtime.controller import CPU, FETCH, HIT, PREFETCHED, LayerPlan
from dali_sim.sim.engine import Activity


@dataclass
class _GpuExpert:
    expert: int
    source: int
    staged: bool
    slot: Slot | None  # None: a staged expert still waiting for a staging buffer
    release: str = ""  # "staging" | "prefetch": give the slot back after the compute


class OffloadRuntime:
    """Cache slots, prefetch and staging buffers, a copy lane and a CPU lane for one model's experts.

    ``capacities`` (slots per layer), ``prefetch_slots`` and ``staging_slots`` come from the memory
    plan; ``initial`` is the controller's initial cache contents. ``copy_delay_s`` (tests) holds every
    copy back. Per-layer accumulators: ``layer_wait`` (seconds the accelerator lane waited for
    weights, host-measured) and ``layer_bookkeeping`` / ``layer_bookkeeping_cpu`` (the runtime's own host
    work, wall-clock / thread-CPU seconds: slot table, routing indices, issuing copies, choosing the next
    expert; not computes, transfers of activations or waits)."""

    def __init__(self, store: HostExpertStore, devices: Devices, capacities: np.ndarray, prefetch_slots: int,
                 staging_slots: int, *, cpu_threads: int, timer: Timer | None = None, copy_delay_s: float = 0.0):
        self.store, self.dev = store, devices
        self.layout = store.layout
        self.timer = timer or Timer(devices.accel if devices.is_cuda else None)
        self.pool = SlotPool(capacities, prefetch_slots, staging_slots, self.layout.numel, devices.dtype, devices.accel)
        self.copies = CopyEngine(devices.copy_stream, self.timer, delay_s=copy_delay_s, device=devices.accel)
        self.cpu = CpuWorker(cpu_threads)
        self.compute_stream = torch.cuda.current_stream(devices.accel) if devices.is_cuda else None
        L = len(capacities)
        self.swaps_landing: dict[int, list[CopyTicket]] = {}
        self.deferred: deque[tuple[int, int, Activity]] = deque()  # prefetches waiting for a free buffer
        self.layer_wait = np.zeros(L)
        self.layer_bookkeeping = np.zeros(L)
        self.layer_bookkeeping_cpu = np.zeros(L)

    # ---- setup --------------------------------------------------------------------------------
    def load(self, resident: np.ndarray) -> None:
        """Copy the initial cache contents ((L, E) bool) into cache slots, synchronously."""
        for layer, e in np.argwhere(np.asarray(resident)).tolist():
            self.pool.admit(layer, e).data.copy_(self.store.host(layer, e))
        self.dev.synchronize()

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
            self.deferred.append((target, e, Activity("prefetch", plan.step, target, e)))
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

        for e in plan.evicted:
            pool.evict(layer, e)
        gpu: list[_GpuExpert] = []
        fetches: deque[_GpuExpert] = deque()
        cpu_experts: list[int] = []
        for i, (e, src) in enumerate(zip(plan.experts.tolist(), plan.source.tolist())):
            if src == CPU:
                cpu_experts.append(e)
                continue
            if src == HIT:
                g = _GpuExpert(e, src, False, pool.cached(layer, e))
            elif src == PREFETCHED:
                slot = pool.pop_prefetched(layer, e)
                if plan.admitted[i]:
                    pool.adopt(layer, e, slot)
                    g = _GpuExpert(e, src, False, slot)
                else:
                    g = _GpuExpert(e, src, False, slot, release="prefetch")
            elif src == FETCH:
                if plan.admitted[i]:
                    g = _GpuExpert(e, src, False, pool.admit(layer, e))
                else:
                    g = _GpuExpert(e, src, True, None, release="staging")
                fetches.append(g)
            else:
                raise AssertionError(f"unknown source {src}")
            gpu.append(g)
        if uncounted_on_cpu and routing.counted is not None:
            cpu_experts += routing.experts[routing.counts() == 0].tolist()
        self._issue_deferred()  # adoptions may have freed prefetch buffers

        # the CPU lane starts first and runs while the accelerator lane works
        sw.stop()
        cpu_job = None
        if cpu_experts:
            x_host = x if x.device.type == "cpu" else x.to(dev.host)
            cpu_job = self.cpu.submit(self._cpu_lane, step, layer, cpu_experts, x_host, routing)
        x_acc = x if (x.device == dev.accel or not gpu) else x.to(dev.accel, non_blocking=True)
        out_buf = torch.zeros((T * k, H), dtype=dev.dtype, device=dev.accel)
        sw.start()
        droute = DeviceRouting(routing, dev.accel, dev.dtype) if gpu else None

        staging_used = 0
        remaining = list(gpu)
        while remaining:
            while fetches:  # on-demand copies in touch order; a staged one needs a free staging buffer
                g = fetches[0]
                if g.slot is None:
                    g.slot = pool.take_staging(layer, g.expert)
                    if g.slot is None:
                        break
                    staging_used += 1
                self._copy(g.slot, layer, g.expert, ON_DEMAND, Activity("fetch", step, layer, g.expert))
                fetches.popleft()
            g = next((r for r in remaining if r.slot is not None and self._is_present(r.slot)), None)
            if g is None:
                waiting = [r.slot.ticket for r in remaining if r.slot is not None and r.slot.ticket is not None]
                if not waiting:
                    raise AssertionError(f"step {step} layer {layer}: no GPU expert can become ready")
                sw.stop()
                w0 = time.perf_counter()
                self.copies.wait_any(waiting)
                self.layer_wait[layer] += time.perf_counter() - w0
                sw.start()
                continue
            remaining.remove(g)
            sw.stop()
            self._gpu_expert(step, layer, g, x_acc, droute, out_buf)
            sw.start()
            if g.release == "staging":
                pool.release_staging(g.slot)
                staging_used -= 1
            elif g.release == "prefetch":
                self._free_prefetch(g.slot)

        sw.stop()
        if cpu_job is not None:
            pos, vals = cpu_job.result()
            out_buf.index_copy_(0, pos.to(dev.accel, non_blocking=True), vals.to(dev.accel, non_blocking=True))
        out = out_buf.view(T, k, H).sum(dim=1)
        out = out if out.device == x.device else out.to(x.device)
        sw.start()

        for e_in, e_out in plan.swaps:
            slot = pool.swap(layer, e_in, e_out)
            ticket = self._copy(slot, layer, e_in, BACKGROUND, Activity("swap", step, layer, e_in, other=e_out))
            self.swaps_landing.setdefault(layer, []).append(ticket)
        pool.check_layer(layer, staging_used)
        if self.deferred:
            raise AssertionError(f"step {step} layer {layer}: prefetches still wait for a buffer at the layer's end")
        sw.stop()
        self._book(layer, sw)
        return out

    # ---- pieces -------------------------------------------------------------------------------
    def _is_present(self, slot: Slot) -> bool:
        """Have the slot's weights landed? (The GPU lane's only question; tests replace it to show that
        :meth:`Slot.check_ready` catches a compute from a slot whose copy is still in flight.)"""
        return slot.ready()

    def _copy(self, slot: Slot, layer: int, expert: int, priority: int, what: Activity) -> CopyTicket:
        ticket = self.copies.submit(slot.data, self.store.host(layer, expert), priority, what,
                                    after=slot.last_use, previous=slot.ticket)
        slot.ticket = ticket
        return ticket

    def _free_prefetch(self, slot: Slot) -> None:
        self.pool.release_prefetch(slot)
        self._issue_deferred()

    def _issue_deferred(self) -> None:
        """Start waiting prefetches, in issue order, while prefetch buffers are free."""
        while self.deferred and self.pool.prefetch_free:
            target, e, what = self.deferred.popleft()
            self._copy(self.pool.take_prefetch(target, e), target, e, BACKGROUND, what)

    def _gpu_expert(self, step: int, layer: int, g: _GpuExpert, x: torch.Tensor, r: DeviceRouting,
                    out_buf: torch.Tensor) -> None:
        slot = g.slot
        slot.check_ready(layer, g.expert)
        pos, tok, w = r.of(g.expert)
        stream = self.compute_stream
        start = self.timer.mark(stream)
        y = self.layout.forward(slot.data, x.index_select(0, tok))
        out_buf.index_copy_(0, pos, y * w)
        end = self.timer.mark(stream)
        if stream is not None:
            slot.last_use = end  # a later copy into this slot waits for this compute
        self.timer.add("gpu", Activity("expert", step, layer, g.expert, tokens=int(tok.shape[0])), start, end)

    def _cpu_lane(self, step: int, layer: int, experts: list[int], x: torch.Tensor, r: LayerRouting):
        """Runs on the CPU worker: the CPU experts in touch order, from host memory."""
        positions, values = [], []
        for e in experts:
            s = r.segment(e)
            pos = torch.from_numpy(r.positions[s])
            w = torch.from_numpy(r.weights[s]).to(self.dev.dtype).unsqueeze(1)
            start = self.timer.mark()
            y = self.layout.forward(self.store.host(layer, e), x.index_select(0, pos // r.top_k)) * w
            end = self.timer.mark()
            self.timer.add("cpu", Activity("expert", step, layer, e, tokens=int(pos.shape[0])), start, end)
            positions.append(pos)
            values.append(y)
        return torch.cat(positions), torch.cat(values)

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
