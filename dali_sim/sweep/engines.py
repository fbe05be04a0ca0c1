"""Where a sweep's tasks run: this process, local worker processes, or Ray (one machine or a cluster).

Every engine runs the same task function (:func:`dali_sim.sweep.worker.run_task`) and yields the
:class:`Outcome` of each configuration as tasks finish, so the caller stores results as they stream in.
Closing the generator (Ctrl-C, SIGTERM, an error) stops the work: worker processes are terminated,
Ray tasks cancelled. A task whose worker dies (killed, out of memory) gives failed outcomes; the
sweep goes on.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Iterable, Iterator

from dali_sim.sweep.worker import Outcome, SweepTask, clear_caches, failed, iter_task, run_task

RAY_HINT = "install the ray extra: pip install -e '.[ray]'"


class SerialEngine:
    """Every task in this process, one configuration after another (``--workers 1``)."""

    slots = 1
    name = "this process"

    def run(self, tasks: Iterable[SweepTask]) -> Iterator[Outcome]:
        try:
            for task in tasks:
                yield from iter_task(task)
        finally:
            clear_caches()


def _ignore_interrupts() -> None:
    """Worker processes leave Ctrl-C (sent to the whole terminal's process group) to the main process,
    which stops them itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LocalEngine:
    """``workers`` processes of this machine, started fresh (``spawn``: no threads or state inherited, and the
    parent's import path, so they run the same dali as this process wherever it was started from)."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.slots = workers
        self.name = f"{workers} local worker processes"

    def _pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.slots, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_ignore_interrupts)

    def run(self, tasks: Iterable[SweepTask]) -> Iterator[Outcome]:
        queue = deque(tasks)
        while queue:
            pool = self._pool()
            running: dict = {}
            clean = False
            try:
                while queue or running:
                    while queue and len(running) < self.slots:  # in flight: one task per worker
                        task = queue.popleft()
                        running[pool.submit(run_task, task)] = task
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                    broken = False
                    for future in done:
                        task = running.pop(future)
                        try:
                            outcomes = future.result()
                        except BrokenProcessPool:
                            broken = True
                            outcomes = failed(task, "a worker process died while running this task (killed or out "
                                                    "of memory); rerun with --retry-failed")
                        except Exception as exc:
                            outcomes = failed(task, f"{type(exc).__name__}: {exc}")
                        yield from outcomes
                    if broken:  # the pool is unusable: its other tasks died with it; a new pool takes the rest
                        for future, task in running.items():
                            yield from failed(task, "a worker process died while this task ran beside it; rerun "
                                                    "with --retry-failed")
                        running.clear()
                        break
                clean = not running
            finally:
                if clean:
                    pool.shutdown(wait=True)
                else:  # interrupted, or the pool broke: stop now
                    _stop(pool)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut ``pool`` down now: pending tasks cancelled, running workers terminated."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
    pool.shutdown(wait=True, cancel_futures=True)  # the pool's threads and queues cleaned up, workers gone


def import_ray():
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ValueError(f"--ray needs Ray, which is not installed; {RAY_HINT}") from None


class RayEngine:
    """Tasks on Ray: ``address`` ``auto`` (the cluster this machine is part of, else a new local Ray) or
    a cluster address (``HOST:6379``, ``ray://HOST:10001``). A Ray already initialised in this process
    (``ray.init`` by the caller) is used as it is and left running. Traces travel by path: every node must
    see them (and the output folder) at the same path, e.g. on a shared file system."""

    def __init__(self, address: str = "auto", max_in_flight: int | None = None):
        self.ray = import_ray()
        self.address = address
        self.max_in_flight = max_in_flight
        self._started = False
        if not self.ray.is_initialized():
            self.ray.init(address=None if address == "auto" else address, log_to_driver=False,
                          logging_level="ERROR")
            self._started = True
        cpus = int(self.ray.cluster_resources().get("CPU", 1))
        self.slots = max_in_flight or cpus
        self.name = f"Ray ({cpus} CPUs)"

    def run(self, tasks: Iterable[SweepTask]) -> Iterator[Outcome]:
        ray = self.ray
        remote = ray.remote(num_cpus=1, max_retries=0)(run_task)
        queue = deque(tasks)
        running: dict = {}
        try:
            while queue or running:
                while queue and (self.max_in_flight is None or len(running) < self.max_in_flight):
                    task = queue.popleft()
                    running[remote.remote(task)] = task
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    task = running.pop(ref)
                    try:
                        outcomes = ray.get(ref)
                    except Exception as exc:  # RayTaskError, WorkerCrashedError, ...: the task's runs fail
                        outcomes = failed(task, f"Ray: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}")
                    yield from outcomes
        finally:
            for ref in running:
                ray.cancel(ref, force=True)
            self.close()

    def close(self) -> None:
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
            self._started = False


def default_workers() -> int:
    """Every core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def make_engine(workers: int | None = None, ray: str | None = None):
    """The engine of ``dali sweep --workers N`` / ``--ray ADDRESS``."""
    if ray is not None:
        return RayEngine(ray, max_in_flight=workers)
    workers = default_workers() if workers is None else workers
    return SerialEngine() if workers == 1 else LocalEngine(workers)


__all__ = ["LocalEngine", "RayEngine", "SerialEngine", "default_workers", "import_ray", "make_engine"]
