"""Timing one piece of work on the accelerator or the host: warm-up runs, then the median of repeats.

On CUDA a run is bracketed by events on the current stream (device time, no host sync inside); on the
host by ``perf_counter``. The median resists the odd slow run of a shared machine. ``prepare`` runs
before each timed run, outside the timing (e.g. to flush caches, so a piece of work is timed as cold
as it is in a replay, where other experts have passed through the caches since it last ran).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_call(fn: Callable[[int], object], *, cuda: torch.device | None, repeats: int, warmup: int,
              prepare: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn(i)`` over ``repeats`` runs after ``warmup`` runs (``i`` = the run index,
    for callers that rotate their inputs so weights are not cache-resident)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for i in range(warmup):
        fn(i)
    times = []
    if cuda is not None:
        torch.cuda.synchronize(cuda)
        stream = torch.cuda.current_stream(cuda)
        for i in range(repeats):
            if prepare is not None:
                prepare()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn(warmup + i)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for i in range(repeats):
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            fn(warmup + i)
            times.append(time.perf_counter() - t0)
    return float(statistics.median(times))
