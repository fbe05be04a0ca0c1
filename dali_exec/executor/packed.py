"""A layer's small index arrays sent to the accelerator in one transfer, from pinned buffers made at set-up.

A group's indices are int64 arrays (pair positions, token rows, rows within the span) and 4-byte ones (the
grouped product's int32 offsets, float32 gate weights). Each array sent by itself costs CUDA calls on the
host: a pinned copy, a transfer and, for int32 offsets sent as int64, a cast kernel on the device. Here they
are written into one int64 buffer, the 4-byte arrays' bits in its tail, which is sent once; on the device the
arrays are views of it (``Tensor.view(dtype)`` reinterprets the bits: no kernel, and the values are exactly
the host's).

The buffer is one of a ring of pinned buffers made at set-up (:class:`PinnedRing`), not new pinned memory
per transfer: ``pin_memory()`` and ``.to()`` took 21 us of host time a transfer on the H200, writing into a
pinned buffer and copying 10 (benchmarks/cuda_host_calls.py). A transfer from pinned memory is queued
(``non_blocking``), so a ring buffer is written again only after the copy from it has run: an event recorded
after each copy is waited for when the ring comes round to its buffer (many transfers later, so in practice
it has passed).
"""

from __future__ import annotations

import numpy as np
import torch

_AS_TORCH = {np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def words_of(int64s: list[np.ndarray], fours: list[np.ndarray]) -> tuple[int, int]:
    """(int64 words of the packed buffer, of which the first hold the int64 arrays)."""
    n64 = sum(len(a) for a in int64s)
    return n64 + (sum(len(a) for a in fours) + 1) // 2, n64


def pack(buf: np.ndarray, int64s: list[np.ndarray], fours: list[np.ndarray], n64: int) -> None:
    """Write ``int64s`` and then the bits of ``fours`` (int32 or float32) into the int64 array ``buf``."""
    o = 0
    for a in int64s:
        buf[o:o + len(a)] = a
        o += len(a)
    tail = buf[n64:].view(np.int32)
    o = 0
    for a in fours:
        if a.dtype not in _AS_TORCH:
            raise TypeError(f"a 4-byte array must be int32 or float32, not {a.dtype}")
        tail[o:o + len(a)] = a.view(np.int32)
        o += len(a)


def unpack(t: torch.Tensor, int64s: list[np.ndarray], fours: list[np.ndarray], n64: int) -> tuple[list, list]:
    """The arrays as views of the sent buffer ``t``: (the int64 tensors, the 4-byte tensors), in order."""
    out64, o = [], 0
    for a in int64s:
        out64.append(t[o:o + len(a)])
        o += len(a)
    words, out4, o = t[n64:].view(torch.int32), [], 0
    for a in fours:
        v = words[o:o + len(a)]
        out4.append(v if a.dtype == np.int32 else v.view(_AS_TORCH[a.dtype]))
        o += len(a)
    return out64, out4


class PinnedRing:
    """``slots`` pinned int64 buffers of ``words`` each, used in turn by :meth:`send`. ``stream``: the stream the
    transfers are queued on (the caller's current one), where each buffer's event is recorded. ``pin`` and
    ``event`` (tests, on the CPU device): whether the buffers are pinned, and the event class."""

    def __init__(self, device: torch.device, stream, words: int, slots: int = 16, *, pin: bool = True,
                 event=None):
        if slots < 1 or words < 1:
            raise ValueError(f"a pinned ring needs at least one buffer of one word, got {slots} of {words}")
        self.device, self.stream, self.pin = device, stream, pin
        self._event = event if event is not None else torch.cuda.Event
        self.events = [self._event() for _ in range(slots)]
        self.used = [False] * slots  # whether a copy from the buffer was queued (its event recorded)
        self.next = 0
        self._alloc(words)

    def _alloc(self, words: int) -> None:
        """Buffers of ``words`` each (the old ones are freed by torch once the copies queued from them have run)."""
        self.host = torch.empty((len(self.events), words), dtype=torch.int64, pin_memory=self.pin)
        self.rows = list(self.host.unbind(0))
        self.arrays = [r.numpy() for r in self.rows]
        self.words = words

    def send(self, int64s: list[np.ndarray], fours: list[np.ndarray]) -> tuple[list, list]:
        """:func:`pack` into the next buffer (once the copy from it has run), sent in one transfer on ``stream``
        without a wait; the arrays as views of the sent buffer (:func:`unpack`). The arrays may be reused at once."""
        words, n64 = words_of(int64s, fours)
        if words > self.words:
            self._alloc(max(words, 2 * self.words))
        k = self.next
        self.next = k + 1 if k + 1 < len(self.events) else 0
        if self.used[k]:
            self.events[k].synchronize()
        pack(self.arrays[k], int64s, fours, n64)
        t = self.rows[k][:words].to(self.device, non_blocking=True)
        self.events[k].record(self.stream)
        self.used[k] = True
        return unpack(t, int64s, fours, n64)


__all__ = ["PinnedRing", "pack", "unpack", "words_of"]
