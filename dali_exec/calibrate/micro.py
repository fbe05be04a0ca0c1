"""Microbenchmarks with the executor's own code: expert time vs tokens on each lane, host-to-device copy
time vs bytes, device-to-host copies of activations, the dense part of a layer (and of a non-MoE block)
vs tokens and context length, and how much each lane slows while the others work (contention).

Each is timed by :func:`.bench.time_call` with the same pieces the executor runs: ``ExpertLayout.forward``
on accelerator slots and on host memory (the CPU lane's worker thread and thread count), the
``CopyEngine`` (pinned memory and the copy stream on CUDA), and ``DenseBlock`` with its attention over a
KV cache in decode layout (each of ``n`` queries attends to ``c`` cached tokens of its own sequence) and
in prefill layout (``s`` sequences of ``q`` new tokens each), as docs/hardware.md defines the dense
tables. Weights are cycled through enough distinct copies that they
are not served from a cache.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import siegelslopes
import torch

from dali_exec.executor.copies import ON_DEMAND, CopyEngine
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.dense import DenseBlock, KVCache, StepAttention
from dali_exec.executor.devices import Devices
from dali_exec.executor.doorbell import spin_for
from dali_exec.executor.ffn import ExpertLayout
from dali_exec.executor.store import drawing_pool
from dali_exec.executor.timing import Timer
from dali_exec.calibrate.bench import time_call
from dali_sim.hardware.contention import LANES, lane_combinations
from dali_sim.models.spec import ModelSpec
from dali_sim.sim.engine import Activity


#: group sizes of the grouped calls whose time, fitted as a line, separates an expert's share from the
#: call's fixed part (capped at the model's experts and ``MicroSettings.max_group``). A share taken from
#: calls of 1 and 4 experts only measured 47-81 us for a 1 MB expert whose calls of 8-24 experts took
#: 90-105 us more per expert on the 2-core VM (the first expert of a cold call is dearer than the rest):
#: larger groups, as a replay's layer computes (8-24 experts), weigh in the fit. Calls of one are in it:
#: a CPU lane of dali computes one or two experts per layer, and the robust fit (:meth:`expert_seconds`)
#: keeps a noisy call of one from moving the line.
GROUP_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class MicroSettings:
    repeats: int = 5
    warmup: int = 2
    rotate_bytes: int = 256 << 20  # distinct weight copies cycled through per measurement (>= this many bytes)
    max_copies: int = 16  # at most this many copies (a grouped call of g experts always gets g + 1)
    max_group: int = 16  # largest grouped call of the expert tables (GROUP_SIZES)
    seed: int = 0
    cold: bool = True  # flush the caches before each timed run, as a replay's other experts do
    contention_tokens: int = 1  # expert workload of the contention measurements (decode-like)
    # rounds of (alone, under load) measurements per slowdown, the median ratio kept: one round gave 1.0 in
    # two calibrations and 1.89 in a third on the 2-core VM (docs/validation.md, "What dominates the error")
    contention_rounds: int = 5
    # rounds of the tables (expert, copy, dense): each round measures every table in turn and each point keeps
    # its median over the rounds, so a slowdown of a shared machine spoils one round of a point, not the point
    # (one cell of a DeepSeek-V2-Lite dense table measured 2.7x its neighbours in one round on the 2-core VM)
    table_rounds: int = 3
    # the sleep before a call in the wake-up measurement (Microbench.wake_seconds): longer than a kernel's
    # idle polling (KVM polls a halted vCPU for 0.2 ms by default), as short as the dense part of a layer
    wake_gap_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("repeats", "contention_rounds", "table_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"calibration warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.wake_gap_s < 1:
            raise ValueError(f"calibration wake_gap_s must be in [0, 1) seconds, got {self.wake_gap_s}")


def llc_bytes() -> int:
    """The host's last-level cache size (Linux sysfs), or 32 MiB when unknown."""
    for index in (3, 2):
        p = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        try:
            text = p.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG") or 0) * scale
    return 32 << 20


def robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of Siegel's repeated-medians line through the points (per point the median of its
    slopes to the others, then the median of those): up to half the points can be off without moving it,
    where one point of four moves a least-squares line."""
    fit = siegelslopes(y, x, method="hierarchical")
    return float(fit.slope), float(fit.intercept)


def _nothing() -> None:
    """The job of :meth:`Microbench.handoff_seconds`."""


def _busy(seconds: float) -> None:
    """Keeps this thread running (reading the clock) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Flush:
    """Evicts a device's caches: writes a buffer twice the last-level cache (host LLC or GPU L2)."""

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            size = 2 * int(torch.cuda.get_device_properties(device).L2_cache_size)
        else:
            size = 2 * llc_bytes()
        self.buf = torch.zeros(max(size, 1 << 20), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buf.add_(1)


class _Loop:
    """Runs ``fn(i)`` over and over on its own thread (with ``threads`` torch threads) until stopped: the
    load of one lane while another lane is measured."""

    def __init__(self, fn, threads: int | None, cuda: torch.device | None = None):
        self.fn, self.threads, self.cuda = fn, threads, cuda
        self._stop = threading.Event()
        self._started = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="dali-calibrate-load")

    def _run(self) -> None:
        try:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            stream = torch.cuda.Stream(self.cuda) if self.cuda is not None else None
            i = 0
            while not self._stop.is_set():
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.fn(i)
                    stream.synchronize()
                else:
                    self.fn(i)
                i += 1
                self._started.set()
        except BaseException as exc:  # reported by __exit__
            self.error = exc
            self._started.set()

    def __enter__(self) -> "_Loop":
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"calibration load failed: {self.error}") from self.error


class Microbench:
    """Measures one model shape on one pair of lanes (the accelerator in this thread, the CPU on a worker)."""

    def __init__(self, model: ModelSpec, devices: Devices, worker: CpuWorker, settings: MicroSettings = MicroSettings(),
                 accel_threads: int | None = None):
        self.model, self.dev, self.worker, self.s = model, devices, worker, settings
        self.accel_threads = accel_threads
        self.layout = ExpertLayout.of(model)
        self.cuda = devices.accel if devices.is_cuda else None
        self.gen = torch.Generator().manual_seed(settings.seed)
        self._flush = {lane: _Flush(devices.of(lane)) for lane in ("gpu", "cpu")} if settings.cold else {}
        # drawn once per bench and reused by every measurement (one thread draws about 200 M values/s: a Mixtral
        # copy source of 256 MiB took 0.77 s on the 2-core VM, and the contention rounds asked for 40 of them)
        self._weights: dict[str, tuple[torch.Tensor, int]] = {}
        self._copy_src: tuple[torch.Tensor, int] | None = None
        self._blocks: dict[tuple[str, bool], list[DenseBlock]] = {}  # by (device, MoE block or not)

    def _copies(self, nbytes: int) -> int:
        return int(min(self.s.max_copies, max(2, math.ceil(self.s.rotate_bytes / max(nbytes, 1)))))

    def flush(self, lane: str):
        """The cache flush made before each timed call on ``lane`` (nothing when not ``cold``)."""
        return self._flush.get(lane) or (lambda: None)

    def _timed(self, lane: str, fn, gap_s: float = 0.0, spinning: bool = False) -> float:
        """Median seconds of ``fn`` on ``lane``'s thread, caches flushed before each run (``cold``) and the
        thread then asleep for ``gap_s`` (``spinning``: in the waiting worker's compiled spin, not asleep)."""
        flush = self._flush.get(lane)

        def slept() -> None:
            if flush is not None:
                flush()
            if spinning:
                spin_for(gap_s)
            else:
                time.sleep(gap_s)
        kw = dict(repeats=self.s.repeats, warmup=self.s.warmup, prepare=slept if gap_s > 0 else flush)
        if lane == "gpu":
            return time_call(fn, cuda=self.cuda, **kw)
        return self.worker.run(time_call, fn, cuda=None, **kw)

    def _expert_weights(self, lane: str) -> tuple[torch.Tensor, int]:
        if lane not in self._weights:
            lay = self.layout
            nbytes = lay.numel * torch.empty((), dtype=self.dev.dtype).element_size()
            k = max(self._copies(nbytes), max(self.group_sizes()) + 1)  # a grouped call reads distinct experts
            w = (torch.randn((k, lay.numel), generator=self.gen) * 0.02).to(device=self.dev.of(lane), dtype=self.dev.dtype)
            self._weights[lane] = (w, k)
        return self._weights[lane]

    def expert_op(self, lane: str, n: int, group: int = 1):
        """``fn(i)``: ``group`` routed experts with ``n`` tokens each as the executor's lane computes them in
        one grouped call (dali_exec/executor/runtime.py, grouped.py): the experts' tokens gathered from a
        layer's activations, the grouped expert products, the gate weights, and (on the accelerator lane)
        the scatter into the layer's output buffer."""
        device = self.dev.of(lane)
        lay, dt, top_k = self.layout, self.dev.dtype, self.model.top_k
        w, k = self._expert_weights(lane)
        if group > k:
            raise ValueError(f"a group of {group} experts needs at least {group} weight copies, have {k}")
        T = max(n, top_k)  # the layer's tokens; each expert gets n of them
        x = torch.randn((T, lay.hidden), generator=self.gen).to(device=device, dtype=dt)
        tok = torch.arange(n, device=device).repeat(group)
        gate = torch.rand((n * group, 1), generator=self.gen).to(device=device, dtype=dt)
        counts = np.full(group, n, np.int64)
        offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(device)
        rows = torch.arange(group, device=device).repeat_interleave(n) if lay.bias else None
        pos = torch.arange(n * group, device=device)
        out = torch.zeros((max(T * top_k, n * group), lay.hidden), dtype=dt, device=device)
        starts = k - group + 1  # groups of consecutive copies, cycled

        def op(i: int):
            lo = (i * group) % starts
            y = lay.forward_grouped(w[lo:lo + group], x.index_select(0, tok), offs, counts, rows) * gate
            return out.index_copy_(0, pos, y) if lane == "gpu" else y
        return op

    def group_sizes(self) -> tuple[int, ...]:
        """The grouped calls' sizes of :meth:`expert_seconds`: :data:`GROUP_SIZES` up to the model's routed
        experts and ``max_group`` (calls of 1 and 2 where fewer than two sizes remain)."""
        cap = min(self.model.num_experts, self.s.max_group)
        sizes = tuple(g for g in GROUP_SIZES if g <= cap)
        return sizes if len(sizes) >= 2 else (1, 2)

    def expert_seconds(self, lane: str, tokens: list[int]) -> tuple[list[float], float]:
        """Per ``n`` of ``tokens``: the seconds one more routed expert with ``n`` tokens adds to a lane's
        grouped call on ``lane`` (gpu | cpu), and the call's fixed seconds (the median over ``n``).

        Calls of every size of :meth:`group_sizes` are timed; per ``n`` a robust line (:func:`robust_line`)
        through (experts, seconds) gives an expert's share (its slope) and the fixed part (its intercept:
        index handling, gather, scatter) that a lane pays once per layer it computes in
        (``MeasuredProfile.lanes``). A least-squares line let one call move both: on the 2-core VM a Mixtral
        call of 8 experts on the accelerator lane took 10% more per expert than calls of 1-6, and the line
        through calls of 1, 2, 4 and 8 had a share of 1.54 ms and an intercept of -0.20 ms (clipped to 0:
        a call of 3 simulated 9% slow, one of 1 1% fast); the repeated-medians line has 1.38 ms and 0.14 ms,
        within 1.2% of the measured calls of 1, 2, 3, 4 and 6 in that run (docs/hardware.md). A slope below zero (noise
        at tiny sizes) falls back to the largest call's mean per expert, a negative intercept to zero."""
        return self.lanes_expert_seconds((lane,), tokens)[0]

    def lanes_expert_seconds(self, lanes: tuple[str, ...], tokens: list[int]) -> tuple[tuple[list[float], float], ...]:
        """:meth:`expert_seconds` of each of ``lanes`` (in that order), their calls interleaved: every (tokens,
        group size) point is timed on each lane in turn, so the lanes' tables see the machine at the same moments
        and a drift of its speed between two tables, a second or two apart, does not become a difference between
        the lanes (docs/hardware.md, "The measured model")."""
        sizes = self.group_sizes()
        g = np.asarray(sizes, float)
        out = []
        times = [[[self._timed(lane, self.expert_op(lane, n, size)) for lane in lanes] for size in sizes]
                 for n in tokens]  # [n][size][lane]
        for j in range(len(lanes)):
            per, fixed = [], []
            for by_size in times:
                t = np.asarray([point[j] for point in by_size])
                slope, intercept = robust_line(g, t)
                if slope <= 0:
                    slope, intercept = t[-1] / g[-1], 0.0
                per.append(float(slope))
                fixed.append(max(float(intercept), 0.0))
            out.append((per, float(np.median(fixed))))
        return tuple(out)

    def spin_gap_s(self) -> float:
        """The gap before a hand-over that finds the CPU lane's worker still spinning: half its spin."""
        if self.worker.spin_s <= 0:
            raise ValueError("the CPU lane's worker does not spin (its spin in effect is 0)")
        return self.worker.spin_s / 2

    def wake_seconds(self, lane: str, spinning: bool = False) -> float:
        """What a call of 2 one-token experts on ``lane`` costs more when the lane's thread slept
        ``wake_gap_s`` before it (``spinning``: spun for :meth:`spin_gap_s`, as the worker does for its next job
        before it sleeps) than when it runs straight after the previous one: the median over
        ``contention_rounds`` rounds of the difference, >= 0. The executor's CPU-lane worker sleeps on its
        queue between layers; on the 2-core VM (quiet, 6 rounds) a Mixtral expert's call (scale 1/4) took
        1.65 ms straight and 1.94 ms after 5 ms of sleep, a DeepSeek-V2-Lite call of 4 experts 0.59 and
        0.76 ms (a halted vCPU comes back on a cold, possibly slowed core; on bare metal C-states and
        frequency ramps do the same)."""
        op = self.expert_op(lane, 1, min(2, self.model.num_experts))
        gap = self.spin_gap_s() if spinning else self.s.wake_gap_s
        diffs = [self._timed(lane, op, gap, spinning) - self._timed(lane, op)
                 for _ in range(max(1, self.s.contention_rounds))]
        return max(0.0, float(np.median(diffs)))

    def handoff_seconds(self, spinning: bool = False) -> float:
        """What handing a job to the CPU lane's worker (``CpuWorker.submit`` of a call that does nothing) costs the
        calling thread when the worker slept ``wake_gap_s``; ``spinning``: when it still spins for it, its last job
        :meth:`spin_gap_s` before (a job just before each hand-over restarts its spin). Wall seconds of the hand-over
        alone, the median over ``contention_rounds`` x ``repeats`` hand-overs. Before each the
        host's caches are flushed and the calling thread stays busy for the gap (as a replay's thread runs the
        layer's dense part while the worker sleeps: a caller that slept too would pay its own wake-up)."""
        flush, gap = self.flush("cpu"), self.spin_gap_s() if spinning else self.s.wake_gap_s
        times = []
        for _ in range(max(1, self.s.contention_rounds) * self.s.repeats):
            flush()
            if spinning:  # (a job just before: the worker's spin starts after the flush)
                self.worker.run(_nothing)
            _busy(gap)
            t0 = time.perf_counter()
            job = self.worker.submit(_nothing)
            times.append(time.perf_counter() - t0)
            job.result()
        return float(np.median(times))

    def beside_wake_seconds(self, spinning: bool = False) -> float:
        """What the accelerator lane's call of 2 one-token experts costs more when, as it starts, the CPU lane's
        worker (asleep ``wake_gap_s``; ``spinning``: its last job :meth:`spin_gap_s` before, still spinning) is
        handed a call of its own, as a layer with experts on both lanes starts
        them (dali_exec/executor/runtime.py ``run_experts``), than when it runs beside the sleeping worker: the
        median over ``contention_rounds`` rounds of the difference, >= 0 (caches flushed before every call).
        On the 2-core VM (2026-12-02, ``benchmarks/lane_contention.py``) the accelerator's call took 0.2-0.4 ms
        more for every group size (a time added per call, not a rate), where the calibration's loops
        (:meth:`contention`: a loop keeps the other vCPU awake) measured 1.0-1.26x for the accelerator."""
        group = min(2, self.model.num_experts)
        acc, cpu = self.expert_op("gpu", 1, group), self.expert_op("cpu", 1, group)
        flush_acc, flush_cpu = self.flush("gpu"), self.flush("cpu")
        gap = self.spin_gap_s() if spinning else self.s.wake_gap_s
        jobs: list = []

        def asleep() -> None:
            flush_acc()
            self.worker.run(flush_cpu)  # (after the previous round's job: the worker runs in order)
            time.sleep(gap)

        def woken() -> None:
            asleep()
            jobs.append(self.worker.submit(cpu, len(jobs)))

        kw = dict(cuda=self.cuda, repeats=self.s.repeats, warmup=self.s.warmup)
        diffs = []
        for _ in range(max(1, self.s.contention_rounds)):
            alone = time_call(acc, prepare=asleep, **kw)
            beside = time_call(acc, prepare=woken, **kw)
            for job in jobs:
                job.result()
            jobs.clear()
            diffs.append(beside - alone)
        return max(0.0, float(np.median(diffs)))

    def transfer_seconds(self, sizes: list[int]) -> list[float]:
        """Host-to-accelerator copies of ``b`` bytes through the executor's copy lane (pinned on CUDA)."""
        dt = self.dev.dtype
        elem = torch.empty((), dtype=dt).element_size()
        largest = max(sizes) // elem
        k = self._copies(max(sizes))
        src = torch.empty((k, largest), dtype=dt, pin_memory=self.dev.is_cuda)
        src.uniform_(generator=self.gen)
        dst = torch.empty((largest,), dtype=dt, device=self.dev.accel)
        timer = Timer(self.cuda)
        engine = CopyEngine(self.dev.copy_stream, timer, device=self.dev.accel)
        what = Activity("fetch", 0, 0, 0)
        out = []
        try:
            for b in sizes:
                n = b // elem
                times = []
                for i in range(self.s.warmup + self.s.repeats):
                    t = engine.submit(dst[:n], src[i % k, :n], ON_DEMAND, what)
                    t.wait()
                    if i >= self.s.warmup:
                        times.append(timer.seconds(t.end) - timer.seconds(t.start))
                out.append(float(np.median(times)))
        finally:
            engine.close()
        return out

    def d2h_seconds(self, sizes: list[int]) -> list[float]:
        """Accelerator-to-host copies of ``b`` bytes (a CPU lane's activations), synchronous as the executor's
        ``x.to(host)``; CUDA only (on the CPU device the CPU lane reads the same tensor)."""
        elem = torch.empty((), dtype=self.dev.dtype).element_size()
        src = torch.empty((max(sizes) // elem,), dtype=self.dev.dtype, device=self.dev.accel)
        out = []
        for b in sizes:
            view = src[: b // elem]
            out.append(time_call(lambda i, v=view: v.to("cpu"), cuda=None, repeats=self.s.repeats,
                                 warmup=self.s.warmup))
        return out

    def _copy_op(self):
        """``fn(i)``: one expert's host-to-accelerator copy as the copy lane makes it (pinned on CUDA), from host
        copies drawn once per bench, into a destination of its own."""
        dt, numel = self.dev.dtype, self.layout.numel
        if self._copy_src is None:
            k = self._copies(numel * torch.empty((), dtype=dt).element_size())
            src = torch.empty((k, numel), dtype=dt, pin_memory=self.dev.is_cuda)
            src.uniform_(generator=self.gen)
            self._copy_src = (src, k)
        src, k = self._copy_src
        dst = torch.empty((numel,), dtype=dt, device=self.dev.accel)
        return lambda i: dst.copy_(src[i % k], non_blocking=self.dev.is_cuda)

    def _load(self, lane: str):
        """A background loop of ``lane``'s typical activity (``contention_tokens`` per expert, one copy)."""
        n = self.s.contention_tokens
        if lane == "h2d":
            return _Loop(self._copy_op(), 1, self.cuda)
        if lane == "gpu":
            return _Loop(self.expert_op("gpu", n), self.accel_threads, self.cuda)
        return _Loop(self.expert_op("cpu", n), self.worker.threads)

    def _measure_lane(self, lane: str) -> float:
        n = self.s.contention_tokens
        if lane == "h2d":
            op = self._copy_op()
            kw = dict(repeats=self.s.repeats, warmup=self.s.warmup)
            if self.cuda is None:
                return time_call(op, cuda=None, **kw)
            stream = torch.cuda.Stream(self.cuda)

            def timed():
                with torch.cuda.stream(stream):
                    return time_call(op, cuda=self.cuda, **kw)
            return timed()
        return self._timed(lane, self.expert_op(lane, n))

    def contention(self) -> dict[str, dict[str, float]]:
        """Slowdown of each lane's activity (a ``contention_tokens`` expert on the accelerator and CPU lanes,
        an expert's copy on the copy lane) while the other lanes of each combination run theirs in loops, the
median over ``contention_rounds`` rounds of (alone, under load):
        ``{"cpu+h2d": {"cpu": t_cpu_with_copies / t_cpu_alone, "h2d": ...}, ...}``, every factor >= 1
        (a measured speed-up, noise, is clipped to 1)."""
        ratios: dict[tuple[str, str], list[float]] = {}
        for _ in range(max(1, self.s.contention_rounds)):
            alone = {lane: self._measure_lane(lane) for lane in LANES}
            for key in lane_combinations():
                lanes = key.split("+")
                for lane in lanes:
                    loads = [self._load(other) for other in lanes if other != lane]
                    with contextlib.ExitStack() as stack:
                        for load in loads:
                            stack.enter_context(load)
                        t = self._measure_lane(lane)
                    ratios.setdefault((key, lane), []).append(t / alone[lane] if alone[lane] > 0 else 1.0)
        table: dict[str, dict[str, float]] = {}
        for (key, lane), r in ratios.items():
            table.setdefault(key, {})[lane] = max(1.0, float(np.median(r)))
        return table

    def dense_seconds(self, lane: str, tokens: list[int], contexts: list[int], moe: bool = True) -> list[list[float]]:
        """``seconds[i][j]``: the dense part of an MoE layer (``moe``) or a non-MoE block, ``tokens[j]``
        queries each attending to ``contexts[i]`` cached tokens of its own sequence, on ``lane``."""
        return self._dense_grid(lane, moe, [[(np.arange(n), np.full(n, c - 1), n, c) for n in tokens] for c in contexts])

    def prefill_seconds(self, lane: str, sequences: list[int], queries: list[int], moe: bool = True) -> list[list[float]]:
        """``seconds[i][j]``: as :meth:`dense_seconds` in prefill layout: ``sequences[j]`` sequences of
        ``queries[i]`` new tokens each, at positions ``0 .. queries[i] - 1`` (a prompt's prefill)."""
        return self._dense_grid(lane, moe, [[(np.repeat(np.arange(s), q), np.tile(np.arange(q), s), s, q)
                                             for s in sequences] for q in queries])

    def _dense_grid(self, lane: str, moe: bool, cells: list[list[tuple]]) -> list[list[float]]:
        """Seconds of the dense part for each cell ``(KV slot of each token, its position, slots, context)``."""
        device = self.dev.of(lane)
        key = (str(device), moe)
        blocks = self._blocks.get(key)
        if blocks is None:  # (the same seeded blocks every time: made once per device and kind)
            block = self.model.moe_layers[0] if moe else next(b for b in range(self.model.num_layers)
                                                             if b not in set(self.model.moe_layers))
            probe = DenseBlock(self.model, block, moe, self.dev.dtype, device, self.s.seed)
            more = self._copies(probe.nbytes) - 1
            with drawing_pool(more) as pool:  # (each copy has its own generator)
                blocks = self._blocks[key] = [probe] + list(pool.map(
                    lambda i: DenseBlock(self.model, block, moe, self.dev.dtype, device, self.s.seed + 1 + i),
                    range(more)))
        k = len(blocks)
        rows = []
        for cells_of_row in cells:
            row = []
            for slots, positions, kv_slots, context in cells_of_row:
                kv = KVCache(self.model, kv_slots, context, self.dev.dtype, device, self.s.seed)
                attn = StepAttention(slots, positions, device)
                x = torch.randn((len(slots), self.model.hidden_size), generator=self.gen).to(device=device,
                                                                                               dtype=self.dev.dtype)
                row.append(self._timed(lane, lambda i, x=x, attn=attn, kv=kv: blocks[i % k](x, attn, kv)))
            rows.append(row)
        return rows
