"""Trace replay: execute a trace's routing step by step on real devices with random weights.

``execute(trace, system, ...)`` builds experts of the model's shape (or scaled down) in host memory,
the dense part of every block on the system's dense device, the runtime with its slots, and drives
the simulator's :class:`Controller` over the same workload: the plans (hence every hit, copy and
admission) are those ``simulate()`` makes, the times are measured. Each step's input hidden states
are random (seeded by the step); each MoE layer's output is ``residual + routed experts(gate input)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from tqdm import tqdm

from dali_exec.executor.dense import DenseBlock, DenseWeights, KVCache, StepAttention
from dali_exec.executor.devices import Devices, lane_threads, to_device_async
from dali_exec.executor.doorbell import DEFAULT_SPIN_US, check_spin_us
from dali_exec.executor.problem import ReplayOptions, ReplaySetup, prepare_replay
from dali_exec.executor.result import assemble_result
from dali_exec.executor.runtime import OffloadRuntime
from dali_exec.executor.store import STEP_INPUT, HostExpertStore, derive_seed
from dali_exec.executor.timing import LayerSeconds, Stopwatch, Timer, paused_gc, stamps_ahead
from dali_sim.runtime.controller import Controller, LayerPlan
from dali_sim.runtime.future import FutureDemand
from dali_sim.sim.counters import PlanCounters
from dali_sim.sim.engine import Activity, EngineOutput
from dali_sim.sim.simulate import DEFAULT_HARDWARE, SimResult
from dali_sim.trace.reader import Trace, read_trace
from dali_sim.workload.profiling import ProfileSpec


@dataclass(frozen=True)
class ExecOptions:
    """How to run (CLI: ``dali exec run``)."""

    device: str | None = None  # cuda | cpu | cuda:N; None = CUDA if present
    cpu_threads: int | None = None  # CPU lane threads; default: all cores but two (CUDA), half of them (CPU device)
    accel_threads: int | None = None  # accelerator lane threads when it is the CPU device; default: the rest
    copy_delay_s: float = 0.0  # tests: hold every copy back this long
    progress: bool = False
    spin_us: float = DEFAULT_SPIN_US  # the CPU lane's worker spins this long for its next job before it sleeps

    def __post_init__(self) -> None:
        check_spin_us(self.spin_us)

    def threads(self, devices: Devices) -> tuple[int, int | None]:
        return lane_threads(devices.is_cuda, self.cpu_threads, self.accel_threads)


@dataclass
class LayerRecord:
    """What ``on_layer`` receives after each executed MoE layer (tensors on their devices)."""

    step: int
    layer: int
    plan: LayerPlan
    gate_input: torch.Tensor  # the routed experts' input (T x H)
    residual: torch.Tensor  # the block's output without the routed experts
    output: torch.Tensor  # residual + routed experts
    ids: np.ndarray  # (T, k) the trace's experts
    weights: np.ndarray | None  # (T, k) the trace's gate weights


class Replay:
    """The objects of one replay; :meth:`run` executes the whole workload once."""

    def __init__(self, setup: ReplaySetup, devices: Devices, opts: ExecOptions, *, seed: int = 0,
                 store: HostExpertStore | None = None, dense: DenseWeights | None = None):
        """``store`` and ``dense``: reuse the host expert weights and the dense blocks of an earlier replay of the
        same model, dtype and seed (they are deterministic; drawing them is the slowest part of the setup)."""
        self.setup, self.dev, self.opts, self.seed = setup, devices, opts, seed
        self.cpu_threads, self.accel_threads = opts.threads(devices)
        s = setup.sysconf
        self.placement, self.cache, self.prefetch = (c.build() for c in (s.placement, s.cache, s.prefetch))
        w = setup.workload
        # the replay's (reduced) workload is in memory: bounds get its exact next-use times directly
        future = FutureDemand.from_workload(w) if s.needs_future else None
        self.controller = Controller(w, setup.costs, self.placement, self.cache, self.prefetch, setup.memory.capacities,
                                     cache_init=s.memory.cache_init, prefetch_slots=setup.memory.prefetch_slots,
                                     staging_slots=setup.memory.staging_slots, seed=seed, future=future,
                                     frequencies=setup.profiled.frequencies)
        model = setup.model
        if store is None:
            store = HostExpertStore.random(model, devices.dtype, seed, pin=devices.is_cuda, progress=opts.progress)
        elif not store.fits(model, devices.dtype, pinned=devices.is_cuda, seed=seed):
            raise ValueError(f"the given expert store {tuple(store.weights.shape)} {store.weights.dtype} (seed "
                             f"{store.seed}) does not fit {model.name} in {devices.dtype_name}"
                             f"{' (pinned)' if devices.is_cuda else ''} with seed {seed}")
        self.store = store
        self.dense_device = devices.of(s.dense_device)
        if dense is None:
            dense = DenseWeights(model, devices.dtype, seed)
        elif not dense.fits(model, devices.dtype, seed):
            raise ValueError(f"the given dense blocks ({dense.model.name}, {dense.dtype}, seed {dense.seed}) do not "
                             f"fit {model.name} in {devices.dtype_name} with seed {seed}")
        self.blocks = dense.on(self.dense_device)
        seqs = w.sequences
        self.slot_of_seq = dict(zip(seqs["seq_id"].tolist(), (np.arange(len(seqs)) % w.config.batch_size).tolist()))
        context = int(setup.trace.pos.max()) + 1
        self.kv = KVCache(model, min(w.config.batch_size, len(seqs)), context, devices.dtype, self.dense_device, seed)
        self.timer = Timer(devices.accel if devices.is_cuda else None)
        self._check_accelerator_memory()
        self.runtime = OffloadRuntime(self.store, devices, setup.memory.capacities, setup.memory.prefetch_slots,
                                      setup.memory.staging_slots, cpu_threads=self.cpu_threads, timer=self.timer,
                                      spin_s=1e-6 * opts.spin_us,
                                      copy_delay_s=opts.copy_delay_s, pairs=w.config.batch_size * model.top_k)
        self.runtime.load(self.controller.initial_resident)

    def _check_accelerator_memory(self) -> None:
        """The expert slots, allocated next, must fit what the accelerator has free (the dense blocks and the KV
        cache already hold theirs)."""
        m, model = self.setup.memory, self.setup.model
        slots = (int(m.capacities.sum()) + m.prefetch_slots + m.staging_slots) * model.expert_bytes
        free = self.dev.accel_free_bytes()
        if self.dev.is_cuda and slots > free:
            dense = sum(b.nbytes for b in self.blocks) + self.kv.nbytes if self.dense_device == self.dev.accel else 0
            raise ValueError(f"the replay's expert slots need {slots / 2**30:.2f} GiB on {self.dev.accel_name()} but "
                             f"{free / 2**30:.2f} GiB are free (its dense blocks and KV cache hold "
                             f"{dense / 2**30:.2f} GiB): lower --gpu-memory or --scale, or use fewer --layers")

    def _step_input(self, step: int, tokens: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(self.seed, STEP_INPUT, step))
        return to_device_async(torch.randn((tokens, self.setup.model.hidden_size), generator=g), self.dense_device,
                               self.dev.dtype)

    def _dense(self, block: DenseBlock, x, attn, what: Activity):
        """The dense part on its device: the accelerator in this thread, the CPU on the CPU lane
        (:meth:`OffloadRuntime.on_cpu_lane`: its worker, unless this thread has the lane's threads)."""
        track = self.setup.sysconf.dense_device
        on_cuda = self.dev.is_cuda and track == "gpu"
        stream = self.runtime.compute_stream if on_cuda else None

        def run():
            start = self.timer.mark(stream)
            out = block(x, attn, self.kv)
            self.timer.add(track, what, start, self.timer.mark(stream))
            return out

        return run() if track == "gpu" else self.runtime.on_cpu_lane(run)

    def run(self, on_layer: Callable[[LayerRecord], None] | None = None) -> SimResult:
        setup, w, dev = self.setup, self.setup.workload, self.dev
        L = w.num_layers
        counters = PlanCounters(L)
        decision = LayerSeconds(L)  # wall, thread CPU
        host = self.runtime.bookkeeping_seconds  # (the runtime's own sums: with the decisions', a visit's host work)
        per_visit = np.zeros((2, w.num_steps * L))  # decision + bookkeeping of each layer visit: wall, thread CPU
        prefetching = np.zeros(w.num_steps * L, bool)  # whether its plan issued prefetches
        visit = 0
        layer_time = np.zeros(L)
        starts, ends = np.zeros(w.num_steps), np.zeros(w.num_steps)
        prev_threads = torch.get_num_threads()
        handed = self.runtime.handoffs()  # (the runtime's counts so far: this run's are their growth)
        woken = self.runtime.cpu.wakes
        waited = self.runtime.prefetches_waited
        if self.accel_threads is not None:
            torch.set_num_threads(self.accel_threads)
        moe_blocks = set(setup.model.moe_layers)
        bar = tqdm(total=w.num_steps, desc=f"exec {setup.sysconf.name}", unit="step", disable=not self.opts.progress,
                   delay=2, leave=False)
        try:
            self.timer.start(ahead=stamps_ahead(w.num_steps * L, min(setup.model.num_experts,
                                                                     w.config.batch_size * setup.model.top_k)))
            with paused_gc():  # no collector pauses in the middle of layers
                for step in range(w.num_steps):
                    starts[step] = self.timer.now()
                    seq, pos = w.step_positions(step)
                    attn = StepAttention(np.array([self.slot_of_seq[s] for s in seq.tolist()]), pos, self.dense_device)
                    x = self._step_input(step, len(seq))
                    layer = 0
                    for b, block in enumerate(self.blocks):
                        if b not in moe_blocks:
                            x, _ = self._dense(block, x, attn, Activity("block", step, b))
                            continue
                        before = decision.sum_at(layer, host)  # (this visit's share: the sums' growth)
                        t0 = self.timer.now()
                        sw, book = Stopwatch(), Stopwatch()
                        host0 = sw.start().at  # (the decision's start and end: the stopwatch's readings)
                        plan = self.controller.plan(step, layer)
                        counters.add(plan)
                        sw.hand_to(book)  # the layer's bookkeeping starts as the decision ends (one reading)
                        self.runtime.start_layer(plan, running=book)
                        self.timer.add_activity("host", "host", step, layer, host0, sw.at)
                        decision.add(layer, sw)
                        residual, gate_input = self._dense(block, x, attn, Activity("dense", step, layer))
                        ids, weights = w.routing(step, layer)  # the trace's stand-in for the router's output
                        # (grouped by expert and checked against the plan in the runtime's bookkeeping)
                        x = residual + self.runtime.run_experts(plan, gate_input, (ids, weights))
                        after = decision.sum_at(layer, host)
                        per_visit[0, visit], per_visit[1, visit] = after[0] - before[0], after[1] - before[1]
                        prefetching[visit] = bool(plan.prefetches)
                        visit += 1
                        dev.synchronize()
                        layer_time[layer] += self.timer.now() - t0
                        if on_layer is not None:
                            on_layer(LayerRecord(step, layer, plan, gate_input, residual, x, ids, weights))
                        layer += 1
                    dev.synchronize()
                    ends[step] = self.timer.now()
                    bar.update()
            self.runtime.finish()
        finally:
            bar.close()
            torch.set_num_threads(prev_threads)
        busy, count, intervals = self.timer.summary()  # intervals resolved when read (a timeline)
        handoffs = {k: n - handed[k] for k, n in self.runtime.handoffs().items()}
        out = EngineOutput(starts, ends, layer_time, self.runtime.layer_wait.copy(), busy, count, intervals,
                           handoffs=handoffs, prefetches_waited=self.runtime.prefetches_waited - waited)
        executor = {
            "devices": dev.describe(),
            "options": {k: v for k, v in dataclasses.asdict(self.opts).items() if k != "progress"},
            "cpu_threads": self.cpu_threads, "accel_threads": self.accel_threads,
            # the CPU lane's worker's spin in effect (0 where it cannot spin: doorbell.spin_available) and how many of
            # the lane's hand-overs found it asleep (each woke it; the others found it spinning)
            "cpu_lane_spin_s": self.runtime.cpu.spin_s, "cpu_lane_wakes": self.runtime.cpu.wakes - woken,
            "expert_activation": self.store.layout.activation,
            "host_weights_pinned": self.store.pinned,
            "slot_bytes": self.runtime.slot_bytes,
            "grouped_calls": self.runtime.grouped_calls(),
            "dense_part": "RMSNorm + QKV projection + attention over a KV cache + output projection + router "
                          "logits + shared experts (docs/executor.md)",
            "gate_weights": "trace" if setup.trace.meta.has_weights else "1/top_k (the trace has none)",
        }
        rt = self.runtime
        bookkeeping = np.stack([rt.layer_bookkeeping, rt.layer_bookkeeping_cpu])
        return assemble_result(setup, self.controller, counters, out, decision_s=decision.array(),
                               bookkeeping_s=bookkeeping, per_visit_s=per_visit[:, :visit],
                               prefetching=prefetching[:visit],
                               batch_size=w.config.batch_size, prefill_chunk=w.config.prefill_chunk,
                               seed=self.seed, executor=executor)

    def close(self) -> None:
        self.runtime.close()
        self.timer.clear()  # (its records hold the copies' tickets, hence the run's slot table)


def execute(trace: Trace | str | Path, system: str, options: ReplayOptions = ReplayOptions(),
            exec_options: ExecOptions = ExecOptions(), *, hardware: str | Path = DEFAULT_HARDWARE,
            batch_size: int = 1, prefill_chunk: int = 0, seed: int = 0,
            overrides: Mapping[str, Mapping[str, str]] | None = None,
            on_layer: Callable[[LayerRecord], None] | None = None,
            profiling: ProfileSpec | None = None) -> SimResult:
    """Replay ``trace`` under ``system`` on real devices; the result has the layout of ``simulate()``
    (``profiling`` as there: by default the first 25% of the sequences profile and are not replayed)."""
    if not isinstance(trace, Trace):
        trace = read_trace(trace)
    setup = prepare_replay(trace, system, options, hardware=str(hardware), batch_size=batch_size,
                           prefill_chunk=prefill_chunk, overrides=overrides, profiling=profiling)
    devices = Devices.create(exec_options.device, options.dtype)
    replay = Replay(setup, devices, exec_options, seed=seed)
    try:
        return replay.run(on_layer)
    finally:
        replay.close()
