"""A layer's small index arrays sent to the accelerator in one transfer.

A group's indices are int64 arrays (pair positions, token rows, rows within the span) and 4-byte ones (the
grouped product's int32 offsets, float32 gate weights). Each array sent by itself costs CUDA calls on the
host: a pinned copy, a transfer and, for int32 offsets sent as int64, a cast kernel on the device. Here they
are written into one int64 buffer, the 4-byte arrays' bits in its tail, which is copied into pinned memory and
sent once; on the device the arrays are views of it (``Tensor.view(dtype)`` reinterprets the bits: no kernel,
and the values are exactly the host's).
"""

from __future__ import annotations

import numpy as np
import torch

_AS_TORCH = {np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def to_device(int64s: list[np.ndarray], fours: list[np.ndarray], device: torch.device) -> tuple[list, list]:
    """``int64s`` (int64 arrays) and ``fours`` (int32 or float32 arrays) as tensors on ``device``, views of one
    buffer sent in one transfer (on CUDA from new pinned memory, without a wait: the arrays may be reused at
    once). Returns (the int64 tensors, the 4-byte tensors), each in the order given."""
    n64 = sum(len(a) for a in int64s)
    n4 = sum(len(a) for a in fours)
    buf = np.empty(n64 + (n4 + 1) // 2, np.int64)
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
    t = torch.from_numpy(buf)
    t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
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


__all__ = ["to_device"]
