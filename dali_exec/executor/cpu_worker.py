"""The CPU lane: one thread with its own torch thread count, computing while the accelerator lane runs.

torch operators release the GIL, so the worker's experts run concurrently with the main thread's
accelerator work. ``torch.set_num_threads`` is called inside the worker thread (OpenMP thread counts
are per calling thread), so the CPU lane uses ``threads`` cores whatever the main thread uses.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class CpuWorker:
    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dali-cpu",
                                        initializer=torch.set_num_threads, initargs=(threads,))

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def run(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` on the worker and wait for it (work that must use the CPU lane's threads)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
