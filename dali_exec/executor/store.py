"""Every routed expert's weights in host memory: the source of all transfers and of the CPU lane.

One (layers, experts, params) tensor, pinned when the accelerator is CUDA (so host-to-device copies
are true asynchronous DMA). Random weights are deterministic: expert (layer, e) is drawn from a
generator seeded by (seed, layer, e), so any expert can be regenerated alone.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from dali_exec.executor.devices import host_memory_bytes
from dali_exec.executor.ffn import ExpertLayout, init_expert_
from dali_sim.models.spec import ModelSpec


#: what a derived seed is for (the first key of :func:`derive_seed`)
EXPERT, DENSE, KV_CACHE, STEP_INPUT = 1, 2, 3, 4


def drawing_pool(jobs: int) -> ThreadPoolExecutor:
    """Threads (one per core, at most ``jobs``) to draw random weights on, each piece with its own generator: torch
    lets go of the GIL while it draws (one thread draws about 200 M values/s), and the weights are those one
    thread would draw."""
    return ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, jobs)), thread_name_prefix="dali-draw")


def derive_seed(seed: int, purpose: int, *key: int) -> int:
    """A torch generator seed for one purpose and key (e.g. EXPERT, layer, expert) under a run seed."""
    return int(np.random.SeedSequence([seed, purpose, *key]).generate_state(1, np.uint64)[0] >> 1)


class HostExpertStore:
    """``weights[layer, expert]`` is the flat parameter vector of one expert (see :mod:`.ffn`)."""

    def __init__(self, weights: torch.Tensor, layout: ExpertLayout, seed: int | None = None):
        """``seed``: the seed :meth:`random` drew the weights with (None: a real model's)."""
        if weights.device.type != "cpu" or weights.dim() != 3 or weights.shape[2] != layout.numel:
            raise ValueError(f"expert store must be a host tensor (L, E, {layout.numel}), got {tuple(weights.shape)} "
                             f"on {weights.device}")
        self.weights = weights
        self.layout = layout
        self.seed = seed

    @classmethod
    def random(cls, model: ModelSpec, dtype: torch.dtype, seed: int = 0, *, pin: bool = False,
               progress: bool = False) -> "HostExpertStore":
        layout = ExpertLayout.of(model)
        L, E = model.num_moe_layers, model.num_experts
        nbytes = L * E * layout.numel * torch.empty((), dtype=dtype).element_size()
        avail = host_memory_bytes(available=True)
        if nbytes > 0.9 * avail:
            raise ValueError(f"the experts of {model.name} take {nbytes / 2**30:.2f} GiB of host memory, more than "
                             f"the {avail / 2**30:.2f} GiB available: use a smaller --scale or fewer --layers")
        weights = torch.empty((L, E, layout.numel), dtype=dtype, pin_memory=pin)
        from tqdm import tqdm

        def draw(key: tuple[int, int]) -> None:
            layer, e = key
            init_expert_(weights[layer, e], layout, torch.Generator().manual_seed(derive_seed(seed, EXPERT, layer, e)))

        keys = [(layer, e) for layer in range(L) for e in range(E)]
        with drawing_pool(len(keys)) as pool:
            for _ in tqdm(pool.map(draw, keys), total=len(keys), desc="random experts", unit="expert",
                          disable=not progress, delay=2, leave=False):
                pass
        return cls(weights, layout, seed)

    def fits(self, model: ModelSpec, dtype: torch.dtype, *, pinned: bool = False, seed: int | None = None) -> bool:
        """Are these the experts of ``model`` (layout, layers, experts) in ``dtype`` (and pinned, and drawn with
        ``seed``, if asked)?"""
        layout = ExpertLayout.of(model)
        return (layout == self.layout and tuple(self.weights.shape) == (model.num_moe_layers, model.num_experts,
                layout.numel) and self.weights.dtype == dtype and (self.pinned or not pinned)
                and (seed is None or self.seed == seed))

    @property
    def num_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def num_experts(self) -> int:
        return self.weights.shape[1]

    @property
    def expert_nbytes(self) -> int:
        return self.weights.shape[2] * self.weights.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's weights."""
        return self.num_layers * self.num_experts * self.expert_nbytes

    @property
    def pinned(self) -> bool:
        return self.weights.is_pinned()

    def host(self, layer: int, expert: int) -> torch.Tensor:
        return self.weights[layer, expert]
