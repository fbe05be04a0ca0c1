"""Preallocated accelerator slots for expert weights and the table of what each one holds.

One tensor of ``sum(capacities) + prefetch_slots + staging_slots`` rows (one expert each) is allocated
up front, exactly the memory plan's ``expert_cache + prefetch_buffers + staging_buffers`` bytes (each row
padded to a multiple of 16 bytes, which grouped matrix products need for their strides); nothing else is
allocated for weights while the run lasts. Rows are handed between three roles:

* the **cache** of each layer: ``capacities[layer]`` slots, each free or holding one expert;
* **prefetch buffers**, shared by all layers; a prefetched expert that the cache admits keeps its row,
  which becomes a cache slot, and a free cache slot of that layer becomes a prefetch buffer (no copy);
* **staging buffers** for fetched experts that the cache does not admit.

The table is a set of arrays (which row holds which (layer, expert), which cache row each expert has,
copies in flight per row), so a layer's many experts are looked up, admitted and evicted in a few
array operations (the ``*_many`` methods); per-slot methods serve single experts. The counts per role
never change (:meth:`SlotPool.check`). Every row remembers the copy that last wrote it (``ticket``), how
many copies into it are in flight (``inflight``) and, on CUDA, the event after the last compute that
read it (``last_use``; a copy into the row waits for it). Computes call :meth:`SlotPool.check_rows` (or
:meth:`Slot.check_ready`), which raises :class:`SlotNotReady` unless each row holds the expert asked for
and its copies have landed.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import numpy as np
import torch

from dali_exec.executor import kernels as _kernels
from dali_exec.executor.copies import CopyTicket

ALIGN_BYTES = 16


class SlotNotReady(AssertionError):
    """A compute was about to read a slot whose copy has not completed (or that holds another expert)."""


class Slot:
    """One row of the pool (a view of its arrays). It refers to its pool weakly: the pool holds its slots, and a
    cycle between them would keep a finished run's slot table (the largest buffer a run allocates) alive until
    the cyclic collector ran, which replays, running with it paused, leave to chance: a validation of 5 systems x
    3 replays kept them all and ran out of host memory."""

    __slots__ = ("index", "data", "_pool")

    def __init__(self, index: int, data: torch.Tensor, pool: "SlotPool"):
        self.index, self.data, self._pool = index, data, weakref.ref(pool)

    @property
    def pool(self) -> "SlotPool":
        pool = self._pool()
        if pool is None:
            raise RuntimeError(f"slot {self.index}: its slot pool is gone")
        return pool

    @property
    def holds(self) -> tuple[int, int] | None:
        layer, expert = int(self.pool.hold_layer[self.index]), int(self.pool.hold_expert[self.index])
        return None if layer < 0 else (layer, expert)

    @property
    def ticket(self) -> CopyTicket | None:
        """The last copy into this slot."""
        return self.pool.tickets[self.index]

    @ticket.setter
    def ticket(self, t: CopyTicket | None) -> None:
        self.pool.tickets[self.index] = t
        (self.pool.ticketed.discard if t is None else self.pool.ticketed.add)(self.index)

    @property
    def last_use(self):
        """CUDA event after the last compute that read this slot."""
        return self.pool.last_use[self.index]

    @last_use.setter
    def last_use(self, event) -> None:
        self.pool.last_use[self.index] = event

    def ready(self) -> bool:
        t = self.ticket
        return self.pool.inflight[self.index] == 0 and (t is None or t.is_done())

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
                 dtype: torch.dtype, device: torch.device, num_experts: int | None = None):
        caps = [int(c) for c in np.asarray(capacities)]
        if any(c < 0 for c in caps) or prefetch_slots < 0 or staging_slots < 0:
            raise ValueError(f"slot counts must be >= 0: capacities {caps}, prefetch {prefetch_slots}, "
                             f"staging {staging_slots}")
        self.capacities = caps
        self.num_prefetch, self.num_staging = prefetch_slots, staging_slots
        n = sum(caps) + prefetch_slots + staging_slots
        per = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        self.numel = numel
        self.buffer = torch.empty((n, -(-numel // per) * per), dtype=dtype, device=device)
        if self.buffer.device.type == "cpu":
            # commit the pages now, as a CUDA allocation is: else the first copy into each row pays the
            # page faults (on the development VM 0.2-1 GB/s, a prefill 4-15x its simulated time)
            self.buffer.zero_()
        self.table = self.buffer  # the rows as a weight table (grouped computation reads [:, :numel])
        self.rows_view = self.buffer[:, :numel]  # the rows without their padding (copies write these)
        self.slots = [Slot(i, self.buffer[i, :numel], self) for i in range(n)]
        #: per row: the layer and expert it holds (-1: none) and its copies not yet landed, as one array (the
        #: compiled per-layer loops take it as one argument) and as its three rows
        self.state = np.zeros((3, n), np.int64)
        self.state[:2] = -1
        self.hold_layer, self.hold_expert, self.inflight = self.state
        self.tickets: list[CopyTicket | None] = [None] * n
        self.ticketed: set[int] = set()  # the rows whose ticket is not None
        self.last_use: list = [None] * n
        L, E = len(caps), int(num_experts or 1)
        self.row_of = np.full((L, E), -1, np.int64)  # cache row of (layer, expert), -1: not cached
        #: prefetch buffer row of (layer, expert) while it is prefetched, -1: none (an array: the compiled route call
        #: reads it); ``n_prefetched`` of them
        self.prefetch_row = np.full((L, E), -1, np.int64)
        self.n_prefetched = 0
        it = iter(range(n))
        self.cache_free: list[deque[int]] = [deque(next(it) for _ in range(c)) for c in caps]
        self.prefetch_free: deque[int] = deque(next(it) for _ in range(prefetch_slots))
        #: the staging buffers, consecutive rows: a layer visit takes the first free ones as one block and returns
        #: it (a stack: the free ones are ``staging_rows[staging_taken:]``), so a block is a slice of rows
        self.staging_first = n - staging_slots
        self.staging_rows = np.arange(self.staging_first, n, dtype=np.int64)
        self.staging_taken = 0
        self.n_cached = [0] * L  # (Python ints: read and written per layer visit)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _width(self, expert: int) -> None:
        if expert >= self.row_of.shape[1]:
            grow = np.full((self.row_of.shape[0], expert + 1 - self.row_of.shape[1]), -1, np.int64)
            self.row_of = np.concatenate([self.row_of, grow], axis=1)
            self.prefetch_row = np.concatenate([self.prefetch_row, grow], axis=1)

    def _hold(self, rows, layer: int, experts) -> None:
        self.hold_layer[rows] = layer
        self.hold_expert[rows] = experts

    def _release(self, rows) -> None:
        self.hold_layer[rows] = -1
        self.hold_expert[rows] = -1

    @property
    def cache(self) -> list[dict[int, Slot]]:
        """Per layer: expert -> slot of its cache (a snapshot)."""
        out: list[dict[int, Slot]] = []
        for layer in range(len(self.capacities)):
            experts = np.flatnonzero(self.row_of[layer] >= 0)
            out.append({int(e): self.slots[int(self.row_of[layer, e])] for e in experts})
        return out

    # ---- cache --------------------------------------------------------------------------------
    def cached(self, layer: int, expert: int) -> Slot:
        return self.slots[int(self.cached_rows(layer, np.array([expert]))[0])]

    def cached_rows(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Cache rows of ``experts`` of ``layer`` (each must be cached)."""
        experts = np.asarray(experts, np.int64)
        if experts.size and experts.max() >= self.row_of.shape[1]:
            self._width(int(experts.max()))
        rows = self.row_of[layer, experts]
        if (rows < 0).any():
            e = int(experts[np.argmax(rows < 0)])
            raise AssertionError(f"layer {layer} expert {e} is not in the slot table's cache")
        return rows

    def admit(self, layer: int, expert: int) -> Slot:
        """A free cache slot of ``layer`` now holds ``expert`` (its copy is the caller's)."""
        return self.slots[int(self.admit_many(layer, np.array([expert]))[0])]

    def admit_many(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Free cache rows of ``layer`` now hold ``experts`` (copies are the caller's); returns the rows."""
        experts = np.asarray(experts, np.int64)
        m = len(experts)
        if not m:
            return experts
        free = self.cache_free[layer]
        kernel = _kernels.compiled("admit")
        if kernel is not None:  # the checks and the table in one compiled loop
            self._enough_free(layer, m)
            rows = np.fromiter(itertools.islice(free, m), np.int64, m)
            bad = kernel(self.row_of[layer], experts, rows, layer, self.hold_layer, self.hold_expert)
            if bad == _kernels.TOO_WIDE:
                self._width(int(experts.max()))
                bad = kernel(self.row_of[layer], experts, rows, layer, self.hold_layer, self.hold_expert)
            if bad >= 0:
                self._already_cached(layer, experts[bad])
            self.took_free(layer, m)
            return rows
        self._width(int(experts.max()))
        if (self.row_of[layer, experts] >= 0).any():
            self._already_cached(layer, experts[np.argmax(self.row_of[layer, experts] >= 0)])
        self._enough_free(layer, m)
        rows = np.array([free.popleft() for _ in range(m)], np.int64)
        self.row_of[layer, experts] = rows
        self._hold(rows, layer, experts)
        self.n_cached[layer] += m
        return rows

    def took_free(self, layer: int, m: int) -> None:
        """The first ``m`` free cache rows of ``layer`` now hold experts (the table set by a compiled loop)."""
        free = self.cache_free[layer]
        if m == len(free):
            free.clear()
        else:
            for _ in range(m):
                free.popleft()
        self.n_cached[layer] += m

    def _already_cached(self, layer: int, expert) -> None:
        raise AssertionError(f"layer {layer} expert {int(expert)} is already cached")

    def _enough_free(self, layer: int, m: int) -> None:
        if len(self.cache_free[layer]) < m:
            raise AssertionError(f"layer {layer}: all {self.capacities[layer]} cache slots are taken")

    def evict(self, layer: int, expert: int) -> None:
        self.evict_many(layer, np.array([expert]))

    def evict_many(self, layer: int, experts: np.ndarray) -> None:
        experts = np.asarray(experts, np.int64)
        if not len(experts):
            return
        kernel = _kernels.compiled("evict")
        if kernel is None:
            rows = self.cached_rows(layer, experts)
            self.row_of[layer, experts] = -1
            self._release(rows)
        else:  # the check and the table in one compiled loop
            bad, rows = kernel(self.row_of[layer], experts, self.hold_layer, self.hold_expert)
            if bad >= 0:
                raise AssertionError(f"layer {layer} expert {int(experts[bad])} is not in the slot table's cache")
        self.cache_free[layer].extend(rows.tolist())
        self.n_cached[layer] -= len(rows)

    def swap(self, layer: int, expert_in: int, expert_out: int) -> Slot:
        """``expert_in`` takes ``expert_out``'s slot (the caller copies it in)."""
        row = int(self.cached_rows(layer, np.array([expert_out]))[0])
        self._width(expert_in)
        if self.row_of[layer, expert_in] >= 0:
            raise AssertionError(f"layer {layer} expert {expert_in} is already cached")
        self.row_of[layer, expert_out] = -1
        self.row_of[layer, expert_in] = row
        self._hold(row, layer, expert_in)
        return self.slots[row]

    def swap_many(self, layer: int, ins: list[int], outs: list[int]) -> np.ndarray:
        """:meth:`swap` of each pair in turn (one compiled loop); returns the rows the ``ins`` now hold."""
        kernel = _kernels.compiled("swap")
        if kernel is None or max(outs) >= self.row_of.shape[1]:
            return np.array([self.swap(layer, a, b).index for a, b in zip(ins, outs)], np.int64)
        self._width(max(ins))
        rows, bad, why = kernel(self.row_of[layer], np.array(ins, np.int64), np.array(outs, np.int64), layer,
                                self.hold_layer, self.hold_expert)
        if why == 1:
            raise AssertionError(f"layer {layer} expert {outs[bad]} is not in the slot table's cache")
        if why == 2:
            raise AssertionError(f"layer {layer} expert {ins[bad]} is already cached")
        return rows

    # ---- prefetch buffers ---------------------------------------------------------------------
    def take_prefetch(self, layer: int, expert: int) -> Slot:
        self._width(expert)
        if self.prefetch_row[layer, expert] >= 0:
            raise AssertionError(f"layer {layer} expert {expert} is already prefetched")
        if not self.prefetch_free:
            raise AssertionError(f"all {self.num_prefetch} prefetch buffers are taken")
        row = self.prefetch_free.popleft()
        self._hold(row, layer, expert)
        self.prefetch_row[layer, expert] = row
        self.n_prefetched += 1
        return self.slots[row]

    def pop_prefetched(self, layer: int, expert: int) -> Slot:
        row = int(self.prefetch_row[layer, expert]) if expert < self.prefetch_row.shape[1] else -1
        if row < 0:
            raise AssertionError(f"layer {layer} expert {expert} was not prefetched")
        self.prefetch_row[layer, expert] = -1
        self.n_prefetched -= 1
        return self.slots[row]

    def release_prefetch(self, slot: Slot) -> None:
        self._release(slot.index)
        self.prefetch_free.append(slot.index)

    def adopt(self, layer: int, expert: int, slot: Slot) -> None:
        """The cache admits a prefetched expert in its buffer: the buffer becomes a cache slot and a free
        cache slot of the layer becomes a prefetch buffer."""
        if not self.cache_free[layer]:
            raise AssertionError(f"layer {layer}: no free cache slot to exchange for a prefetch buffer")
        self._width(expert)
        self.prefetch_free.append(self.cache_free[layer].popleft())
        self.row_of[layer, expert] = slot.index
        self.n_cached[layer] += 1

    def took_prefetched(self, layer: int, prefetched: int, adopted: int) -> None:
        """``prefetched`` experts of ``layer`` were taken from their buffers and the first ``adopted`` of them
        adopted (the table set by a compiled loop: ``kernels._route_partition``): what :meth:`pop_prefetched` and
        :meth:`adopt` leave to the pool, the first ``adopted`` free cache rows of the layer becoming prefetch
        buffers."""
        self.n_prefetched -= prefetched
        free, buffers = self.cache_free[layer], self.prefetch_free
        for _ in range(adopted):
            buffers.append(free.popleft())
        self.n_cached[layer] += adopted

    # ---- staging buffers ----------------------------------------------------------------------
    @property
    def staging_free(self) -> list[int]:
        """The free staging buffers, in the order they are taken."""
        return self.staging_rows[self.staging_taken:].tolist()

    def take_staging(self, layer: int, expert: int) -> Slot | None:
        if self.staging_taken == self.num_staging:
            return None
        row = int(self.take_staging_rows(1)[0])
        self._hold(row, layer, expert)
        return self.slots[row]

    def release_staging(self, slot: Slot) -> None:
        self.release_staging_rows(np.array([slot.index]))

    def take_staging_rows(self, n: int) -> np.ndarray:
        """``n`` free staging buffers for a layer's staged experts, consecutive rows (a view of
        ``staging_rows``; they hold nothing until a copy is issued into them: :meth:`hold_rows`); returned with
        :meth:`release_staging_rows`."""
        rows = self.free_staging_rows(n)
        self.staging_taken += n
        return rows

    def free_staging_rows(self, n: int) -> np.ndarray:
        """The first ``n`` free staging buffers, not taken: for a lane settled before its device work uses them (the
        CPU device's, ``kernels._route_partition``), when nothing else can take a staging buffer."""
        top = self.staging_taken
        if n > self.num_staging - top:
            raise AssertionError(f"{n} staging buffers asked, {self.num_staging - top} of {self.num_staging} free")
        return self.staging_rows[top:top + n]

    def release_staging_rows(self, rows: np.ndarray) -> None:
        """Return the last staging buffers taken (:meth:`take_staging_rows`'s block), cleared."""
        n, top = len(rows), self.staging_taken
        if not n:
            return
        first = int(rows[0])
        if n > top or first != self.staging_first + top - n:
            raise AssertionError(f"staging buffers {np.asarray(rows).tolist()} returned, but the last ones taken are "
                                 f"{self.staging_rows[max(0, top - n):top].tolist()}")
        self.staging_taken = top - n
        if n <= 2:  # (a layer's staging turns' two buffers: scalar writes, several times cheaper than a slice's)
            hold_layer, hold_expert = self.hold_layer, self.hold_expert
            for r in range(first, first + n):
                hold_layer[r] = hold_expert[r] = -1
        else:
            self.state[:2, first:first + n] = -1  # (consecutive rows)

    def hold_rows(self, rows, layer: int, experts) -> None:
        """The rows now hold these experts of ``layer`` (a copy into them is being issued)."""
        if len(rows) == 1:
            self.hold_layer[rows[0]] = layer
            self.hold_expert[rows[0]] = experts[0]
        else:
            self._hold(rows, layer, experts)

    # ---- readiness ----------------------------------------------------------------------------
    def landed(self, rows: np.ndarray) -> np.ndarray:
        """Bool per row: every copy into it has landed."""
        return self.inflight[rows] == 0

    def check_rows(self, rows: np.ndarray, layer: int, experts: np.ndarray) -> None:
        """Each row holds (layer, expert) and its copies have landed, else :class:`SlotNotReady`."""
        if len(rows) == 1:  # a staging turn: scalars
            r = int(rows[0])
            if self.hold_layer[r] == layer and self.hold_expert[r] == experts[0] and self.inflight[r] == 0:
                return
        else:
            ready = _kernels.compiled("rows_ready")
            if ready is not None and ready(rows, experts, layer, self.hold_layer, self.hold_expert, self.inflight):
                return
        wrong = (self.hold_layer[rows] != layer) | (self.hold_expert[rows] != experts)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise SlotNotReady(f"slot {int(rows[i])} holds {self.slots[int(rows[i])].holds}, but layer {layer} expert "
                               f"{int(experts[i])} was to be computed from it")
        busy = self.inflight[rows] > 0
        if busy.any():
            i = int(np.argmax(busy))
            raise SlotNotReady(f"slot {int(rows[i])}: the copy of layer {layer} expert {int(experts[i])} has not "
                               "completed")

    # ---- invariants ---------------------------------------------------------------------------
    def check_layer(self, layer: int, staging_in_use: int = 0) -> None:
        """The cheap per-layer part of :meth:`check`: the layer's cache and the shared buffers keep their counts."""
        if self.n_cached[layer] + len(self.cache_free[layer]) != self.capacities[layer]:
            cached, free, cap = int(self.n_cached[layer]), len(self.cache_free[layer]), self.capacities[layer]
            raise AssertionError(f"layer {layer}: {cached} cached + {free} free slots, capacity {cap}")
        if self.n_prefetched + len(self.prefetch_free) != self.num_prefetch:
            raise AssertionError(f"{self.n_prefetched} prefetched + {len(self.prefetch_free)} free buffers, "
                                 f"expected {self.num_prefetch}")
        if self.staging_taken != staging_in_use:
            raise AssertionError(f"{self.num_staging - self.staging_taken} free + {staging_in_use} used staging "
                                 f"buffers, expected {self.num_staging}")

    def check(self, staging_in_use: int = 0) -> None:
        """Each role keeps its number of slots and no slot is in two places."""
        seen: list[int] = []
        for layer in range(len(self.capacities)):
            self.check_layer(layer, staging_in_use)
            cached = self.row_of[layer][self.row_of[layer] >= 0].tolist()
            if len(cached) != self.n_cached[layer]:
                raise AssertionError(f"layer {layer}: {len(cached)} experts cached, {int(self.n_cached[layer])} counted")
            seen += cached + list(self.cache_free[layer])
        prefetched = self.prefetch_row[self.prefetch_row >= 0].tolist()
        if len(prefetched) != self.n_prefetched:
            raise AssertionError(f"{len(prefetched)} experts prefetched, {self.n_prefetched} counted")
        seen += prefetched + list(self.prefetch_free) + self.staging_free
        if len(seen) != len(set(seen)):
            raise AssertionError("a slot is in two places of the slot table")

    def resident(self) -> np.ndarray:
        """(L, E) bool: which experts the cache slots hold (compare with the controller's contents)."""
        out = self.row_of >= 0
        used = np.flatnonzero(out.any(axis=0))
        width = int(used.max()) + 1 if used.size else 1
        return out[:, :width]
