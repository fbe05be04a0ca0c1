"""Preallocated accelerator slots for expert weights and the table of what each one holds.

One tensor of ``sum(capacities) + prefetch_slots + staging_slots`` rows (one expert each) is allocated
up front, exactly the memory plan's ``expert_cache + prefetch_buffers + staging_buffers`` bytes; nothing
else is allocated for weights while the run lasts. Rows are handed between three roles:

* the **cache** of each layer: ``capacities[layer]`` slots, each free or holding one expert;
* **prefetch buffers**, shared by all layers; a prefetched expert that the cache admits keeps its row,
  which becomes a cache slot, and a free cache slot of that layer becomes a prefetch buffer (no copy);
* **staging buffers** for fetched experts that the cache does not admit.

The counts per role never change (:meth:`SlotPool.check`). Every slot remembers the copy that last wrote
it (``ticket``) and, on CUDA, the event after the last compute that read it (``last_use``): a copy into
the slot waits for that event, and a compute calls :meth:`Slot.check_ready`, which raises
:class:`SlotNotReady` unless the slot holds the expert asked for and its copy has landed.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from dali_exec.executor.copies import CopyTicket


class SlotNotReady(AssertionError):
    """A compute was about to read a slot whose copy has not completed (or that holds another expert)."""


class Slot:
    __slots__ = ("index", "data", "holds", "ticket", "last_use")

    def __init__(self, index: int, data: torch.Tensor):
        self.index, self.data = index, data
        self.holds: tuple[int, int] | None = None  # (layer, expert)
        self.ticket: CopyTicket | None = None  # the last copy into this slot
        self.last_use = None  # CUDA event after the last compute that read it

    def ready(self) -> bool:
        return self.ticket is None or self.ticket.is_done()

    def check_ready(self, layer: int, expert: int) -> None:
        if self.holds != (layer, expert):
            raise SlotNotReady(f"slot {self.index} holds {self.holds}, but layer {layer} expert {expert} was to be "
                               "computed from it")
        if not self.ready():
            raise SlotNotReady(f"slot {self.index}: the copy of layer {layer} expert {expert} has not completed")
        if self.ticket is not None and self.ticket.error is not None:
            self.ticket.wait()  # raises the copy's error


class SlotPool:
    """The slot table (see the module docstring)."""

    def __init__(self, capacities: np.ndarray, prefetch_slots: int, staging_slots: int, numel: int,
                 dtype: torch.dtype, device: torch.device):
        caps = [int(c) for c in np.asarray(capacities)]
        if any(c < 0 for c in caps) or prefetch_slots < 0 or staging_slots < 0:
            raise ValueError(f"slot counts must be >= 0: capacities {caps}, prefetch {prefetch_slots}, "
                             f"staging {staging_slots}")
        self.capacities = caps
        self.num_prefetch, self.num_staging = prefetch_slots, staging_slots
        n = sum(caps) + prefetch_slots + staging_slots
        self.buffer = torch.empty((n, numel), dtype=dtype, device=device)
        slots = [Slot(i, self.buffer[i]) for i in range(n)]
        it = iter(slots)
        self.cache: list[dict[int, Slot]] = [{} for _ in caps]
        self.cache_free: list[deque[Slot]] = [deque(next(it) for _ in range(c)) for c in caps]
        self.prefetch_free: deque[Slot] = deque(next(it) for _ in range(prefetch_slots))
        self.prefetched: dict[tuple[int, int], Slot] = {}
        self.staging_free: deque[Slot] = deque(next(it) for _ in range(staging_slots))
        self.slots = slots

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    # ---- cache --------------------------------------------------------------------------------
    def cached(self, layer: int, expert: int) -> Slot:
        try:
            return self.cache[layer][expert]
        except KeyError:
            raise AssertionError(f"layer {layer} expert {expert} is not in the slot table's cache") from None

    def admit(self, layer: int, expert: int) -> Slot:
        """A free cache slot of ``layer`` now holds ``expert`` (its copy is the caller's)."""
        if expert in self.cache[layer]:
            raise AssertionError(f"layer {layer} expert {expert} is already cached")
        if not self.cache_free[layer]:
            raise AssertionError(f"layer {layer}: all {self.capacities[layer]} cache slots are taken")
        slot = self.cache_free[layer].popleft()
        slot.holds = (layer, expert)
        self.cache[layer][expert] = slot
        return slot

    def evict(self, layer: int, expert: int) -> None:
        slot = self.cached(layer, expert)
        del self.cache[layer][expert]
        slot.holds = None
        self.cache_free[layer].append(slot)

    def swap(self, layer: int, expert_in: int, expert_out: int) -> Slot:
        """``expert_in`` takes ``expert_out``'s slot (the caller copies it in)."""
        slot = self.cached(layer, expert_out)
        del self.cache[layer][expert_out]
        if expert_in in self.cache[layer]:
            raise AssertionError(f"layer {layer} expert {expert_in} is already cached")
        slot.holds = (layer, expert_in)
        self.cache[layer][expert_in] = slot
        return slot

    # ---- prefetch buffers ---------------------------------------------------------------------
    def take_prefetch(self, layer: int, expert: int) -> Slot:
        if (layer, expert) in self.prefetched:
            raise AssertionError(f"layer {layer} expert {expert} is already prefetched")
        if not self.prefetch_free:
            raise AssertionError(f"all {self.num_prefetch} prefetch buffers are taken")
        slot = self.prefetch_free.popleft()
        slot.holds = (layer, expert)
        self.prefetched[(layer, expert)] = slot
        return slot

    def pop_prefetched(self, layer: int, expert: int) -> Slot:
        try:
            return self.prefetched.pop((layer, expert))
        except KeyError:
            raise AssertionError(f"layer {layer} expert {expert} was not prefetched") from None

    def release_prefetch(self, slot: Slot) -> None:
        slot.holds = None
        self.prefetch_free.append(slot)

    def adopt(self, layer: int, expert: int, slot: Slot) -> None:
        """The cache admits a prefetched expert in its buffer: the buffer becomes a cache slot and a free
        cache slot of the layer becomes a prefetch buffer."""
        if not self.cache_free[layer]:
            raise AssertionError(f"layer {layer}: no free cache slot to exchange for a prefetch buffer")
        self.prefetch_free.append(self.cache_free[layer].popleft())
        self.cache[layer][expert] = slot

    # ---- staging buffers ----------------------------------------------------------------------
    def take_staging(self, layer: int, expert: int) -> Slot | None:
        if not self.staging_free:
            return None
        slot = self.staging_free.popleft()
        slot.holds = (layer, expert)
        return slot

    def release_staging(self, slot: Slot) -> None:
        slot.holds = None
        self.staging_free.append(slot)

    # ---- invariants ---------------------------------------------------------------------------
    def check_layer(self, layer: int, staging_in_use: int = 0) -> None:
        """The cheap per-layer part of :meth:`check`: the layer's cache and the shared buffers keep their counts."""
        cached, free, cap = len(self.cache[layer]), len(self.cache_free[layer]), self.capacities[layer]
        if cached + free != cap:
            raise AssertionError(f"layer {layer}: {cached} cached + {free} free slots, capacity {cap}")
        if len(self.prefetched) + len(self.prefetch_free) != self.num_prefetch:
            raise AssertionError(f"{len(self.prefetched)} prefetched + {len(self.prefetch_free)} free buffers, "
                                 f"expected {self.num_prefetch}")
        if len(self.staging_free) + staging_in_use != self.num_staging:
            raise AssertionError(f"{len(self.staging_free)} free + {staging_in_use} used staging buffers, "
                                 f"expected {self.num_staging}")

    def check(self, staging_in_use: int = 0) -> None:
        """Each role keeps its number of slots and no slot is in two places."""
        seen: list[int] = []
        for layer in range(len(self.capacities)):
            self.check_layer(layer, staging_in_use)
            seen += [s.index for s in self.cache[layer].values()] + [s.index for s in self.cache_free[layer]]
        seen += [s.index for s in self.prefetched.values()] + [s.index for s in self.prefetch_free]
        seen += [s.index for s in self.staging_free]
        if len(seen) != len(set(seen)):
            raise AssertionError("a slot is in two places of the slot table")

    def resident(self) -> np.ndarray:
        """(L, E) bool: which experts the cache slots hold (compare with the controller's contents)."""
        num_experts = 1 + max((e for c in self.cache for e in c), default=-1)
        out = np.zeros((len(self.capacities), max(num_experts, 1)), dtype=bool)
        for layer, c in enumerate(self.cache):
            out[layer, list(c)] = True
        return out
