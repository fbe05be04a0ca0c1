"""Microbenchmarks with the executor's own code: expert time vs tokens on each lane, host-to-device copy
time vs bytes, and the dense part of a layer (and of a non-MoE block) vs tokens and context length.

Each is timed by :func:`.bench.time_call` with the same pieces the executor runs: ``ExpertLayout.forward``
on accelerator slots and on host memory (the CPU lane's worker thread and thread count), the
``CopyEngine`` (pinned memory and the copy stream on CUDA), and ``DenseBlock`` with its attention over a
KV cache in decode layout (each of ``n`` queries attends to ``c`` cached tokens of its own sequence, as
docs/hardware.md defines the dense tables). Weights are cycled through enough distinct copies that they
are not served from a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dali_exec.executor.copies import ON_DEMAND, CopyEngine
from dali_exec.executor.cpu_worker import CpuWorker
from dali_exec.executor.dense import DenseBlock, KVCache, StepAttention
from dali_exec.executor.devices import Devices
from dali_exec.executor.ffn import ExpertLayout
from dali_exec.executor.timing import Timer
from dali_exec.calibrate.bench import time_call
from dali_sim.models.spec import ModelSpec
from dali_sim.sim.engine import Activity


@dataclass(frozen=True)
class MicroSettings:
    repeats: int = 5
    warmup: int = 2
    rotate_bytes: int = 256 << 20  # distinct weight copies cycled through per measurement (>= this many bytes)
    max_copies: int = 16  # at most this many copies
    seed: int = 0


class Microbench:
    """Measures one model shape on one pair of lanes (the accelerator in this thread, the CPU on a worker)."""

    def __init__(self, model: ModelSpec, devices: Devices, worker: CpuWorker, settings: MicroSettings = MicroSettings()):
        self.model, self.dev, self.worker, self.s = model, devices, worker, settings
        self.layout = ExpertLayout.of(model)
        self.cuda = devices.accel if devices.is_cuda else None
        self.gen = torch.Generator().manual_seed(settings.seed)

    def _copies(self, nbytes: int) -> int:
        return int(min(self.s.max_copies, max(2, math.ceil(self.s.rotate_bytes / max(nbytes, 1)))))

    def _timed(self, lane: str, fn) -> float:
        if lane == "gpu":
            return time_call(fn, cuda=self.cuda, repeats=self.s.repeats, warmup=self.s.warmup)
        return self.worker.run(time_call, fn, cuda=None, repeats=self.s.repeats, warmup=self.s.warmup)

    def expert_seconds(self, lane: str, tokens: list[int]) -> list[float]:
        """One routed expert with ``n`` tokens, for each ``n``, on ``lane`` (gpu | cpu)."""
        device = self.dev.of(lane)
        lay = self.layout
        nbytes = lay.numel * torch.empty((), dtype=self.dev.dtype).element_size()
        k = self._copies(nbytes)
        w = (torch.randn((k, lay.numel), generator=self.gen) * 0.02).to(device=device, dtype=self.dev.dtype)
        out = []
        for n in tokens:
            x = torch.randn((n, lay.hidden), generator=self.gen).to(device=device, dtype=self.dev.dtype)
            out.append(self._timed(lane, lambda i, x=x: lay.forward(w[i % k], x)))
        return out

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

    def dense_seconds(self, lane: str, tokens: list[int], contexts: list[int], moe: bool = True) -> list[list[float]]:
        """``seconds[i][j]``: the dense part of an MoE layer (``moe``) or a non-MoE block, ``tokens[j]``
        queries each attending to ``contexts[i]`` cached tokens of its own sequence, on ``lane``."""
        device = self.dev.of(lane)
        block = self.model.moe_layers[0] if moe else next(b for b in range(self.model.num_layers)
                                                         if b not in set(self.model.moe_layers))
        probe = DenseBlock(self.model, block, moe, self.dev.dtype, device, self.s.seed)
        k = self._copies(probe.nbytes)
        blocks = [probe] + [DenseBlock(self.model, block, moe, self.dev.dtype, device, self.s.seed + 1 + i)
                            for i in range(k - 1)]
        rows = []
        for c in contexts:
            row = []
            for n in tokens:
                kv = KVCache(self.model, n, c, self.dev.dtype, device, self.s.seed)
                attn = StepAttention(np.arange(n), np.full(n, c - 1), device)
                x = torch.randn((n, self.model.hidden_size), generator=self.gen).to(device=device, dtype=self.dev.dtype)
                row.append(self._timed(lane, lambda i, x=x, attn=attn, kv=kv: blocks[i % k](x, attn, kv)))
            rows.append(row)
        return rows
