"""The CPU lane: one thread with its own torch thread count, computing while the accelerator lane runs.

torch operators release the GIL, so the worker's experts run concurrently with the main thread's
accelerator work. ``torch.set_num_threads`` is called inside the worker thread (OpenMP thread counts
are per calling thread), so the CPU lane uses ``threads`` cores whatever the main thread uses.

A job is handed over through a deque and a :class:`~.doorbell.Doorbell` (the worker spins for up to
``spin_s`` after each job before it sleeps: a job that comes meanwhile needs no wake) and its completion
signalled by releasing a lock the submitter holds: C-level primitives only. A ``ThreadPoolExecutor``'s
``submit`` makes a future with a condition, a work item and a semaphore check in Python: on the 2-core
development VM 4.6 us of the calling thread's CPU time warm and 20 us after a pass over 32 MB (the state of the
caches after a layer's tensor work), against 2.8 and 8.6 us for a ``SimpleQueue`` (most of it waking the worker).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from dali_exec.executor.doorbell import Doorbell


class CpuJob:
    """A submitted call; :meth:`result` waits for it and returns its value (or raises its exception)."""

    __slots__ = ("fn", "args", "kwargs", "value", "error", "_done", "_waited")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value = self.error = None
        self._done = threading.Lock()
        self._done.acquire()  # released by the worker once the call has run
        self._waited = False

    def result(self):
        if not self._waited:
            self._done.acquire()
            self._waited = True
        if self.error is not None:
            raise self.error
        return self.value


class CpuWorker:
    """``spin_s``: how long the worker spins for its next job after each one before it sleeps (0: at once;
    :class:`~.doorbell.Doorbell`)."""

    def __init__(self, threads: int, spin_s: float = 0.0):
        if threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {threads}")
        self.threads = threads
        self._jobs: deque = deque()
        self._bell = Doorbell(spin_s)
        self._closing = False
        self.wakes = 0  #: jobs submitted while the worker slept (each woke it)
        self._thread = threading.Thread(target=self._loop, name="dali-cpu", daemon=True)
        self._thread.start()

    @property
    def spin_s(self) -> float:
        """The worker's spin in effect (0 where spinning is off: :func:`~.doorbell.spin_available`)."""
        return self._bell.spin_s

    def _next(self) -> CpuJob | None:
        """The next job, waiting for one (None: closed and no job left)."""
        jobs, bell = self._jobs, self._bell
        while True:
            seen = bell.rings  # (before looking: a job submitted after this rings)
            if jobs:
                return jobs.popleft()
            if self._closing:
                return None
            bell.wait(seen)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        while (job := self._next()) is not None:
            try:
                job.value = job.fn(*job.args, **job.kwargs)
            except BaseException as exc:  # the submitter's result() raises it
                job.error = exc
            finally:
                job.fn = job.args = job.kwargs = None
                job._done.release()

    def submit(self, fn: Callable, *args, **kwargs) -> CpuJob:
        if self._thread is None:
            raise RuntimeError("the CPU worker is closed")
        job = CpuJob(fn, args, kwargs)
        self._jobs.append(job)
        self.wakes += self._bell.ring()
        return job

    def run(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` on the worker and wait for it (work that must use the CPU lane's threads)."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Finish the submitted jobs and stop the thread (idempotent)."""
        if self._thread is not None:
            self._closing = True
            self._bell.ring()
            self._thread.join()
            self._thread = None
