"""The waiting threads' doorbell: a thread spins for its work before it sleeps, and no ring is lost."""

import random
import threading
import time

import pytest

pytest.importorskip("torch")

from dali_exec.executor.cpu_worker import CpuWorker  # noqa: E402
from dali_exec.executor.doorbell import Doorbell, check_spin_us, spin_available, spin_in_effect  # noqa: E402

needs_spin = pytest.mark.skipif(not spin_available(), reason="the compiled spin needs x86-64 and numba")


def _waiter(bell: Doorbell, rounds: int, seen_rings: list):
    """A thread that waits ``rounds`` times, each after reading the ring count (as a worker that found no work)."""
    def run():
        for _ in range(rounds):
            bell.wait(bell.rings)
            seen_rings.append(bell.rings)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _until(predicate, limit_s: float = 10.0) -> bool:
    """Poll ``predicate`` until true or ``limit_s`` passed (a bound against a hang, not a timing)."""
    end = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True


@needs_spin
def test_a_ring_while_the_thread_spins_needs_no_wake():
    bell = Doorbell(60.0)  # (it spins until rung)
    seen: list = []
    t = _waiter(bell, 1, seen)
    assert _until(lambda: bell.waiting)
    assert not bell.asleep
    assert bell.ring() is False  # (nothing to wake)
    t.join(10)
    assert not t.is_alive() and seen == [1] and bell.sleeps == 0 and not bell.waiting


@pytest.mark.parametrize("spin_s", [0.0, 0.001])
def test_a_thread_that_spun_its_time_sleeps_and_a_ring_wakes_it(spin_s):
    bell = Doorbell(spin_s)
    seen: list = []
    t = _waiter(bell, 1, seen)
    assert _until(lambda: bell.asleep)
    assert bell.ring() is True  # (woke it)
    t.join(10)
    assert not t.is_alive() and seen == [1] and bell.sleeps == 1


def test_a_ring_before_the_wait_is_not_lost():
    """The count is read before looking for work: a ring after that read returns the wait at once, spin or not."""
    for spin_s in (0.0, 0.001):
        bell = Doorbell(spin_s)
        seen = bell.rings
        bell.ring()
        bell.wait(seen)  # (returns: it would hang otherwise)
        assert bell.sleeps == 0 and not bell.waiting


@pytest.mark.parametrize("spin_us", [0.0, 200.0, 2000.0])
def test_every_job_runs_once_in_order_whatever_the_gaps(spin_us):
    """Jobs submitted back to back, and after gaps on both sides of the spin, all run in order; only hand-overs
    that found the worker asleep woke it."""
    rng = random.Random(3)
    worker = CpuWorker(1, 1e-6 * spin_us)
    try:
        done: list = []
        jobs = []
        for i in range(300):
            jobs.append(worker.submit(done.append, i))
            if rng.random() < 0.3:
                time.sleep(rng.choice([0.0, 0.0001, 0.001, 0.004]))
        for j in jobs:
            j.result()
        assert done == list(range(300))
        assert 0 < worker.wakes <= 300
        assert worker.spin_s == spin_in_effect(spin_us)
    finally:
        worker.close()
    assert worker._thread is None


@needs_spin
def test_closing_a_spinning_worker_stops_it():
    worker = CpuWorker(1, 60.0)
    assert worker.run(lambda: 7) == 7
    thread = worker._thread
    assert _until(lambda: worker._bell.waiting)
    worker.close()
    assert not thread.is_alive() and worker.wakes == 0  # (the first job found it spinning too, or busy)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_a_job_that_raises_raises_in_its_submitter():
    worker = CpuWorker(1, 0.001)
    try:
        with pytest.raises(ZeroDivisionError):
            worker.run(lambda: 1 / 0)
        assert worker.run(lambda: 2) == 2
    finally:
        worker.close()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_spin_must_be_a_finite_number_at_least_zero(bad):
    with pytest.raises(ValueError, match="spin_us must be a finite number >= 0"):
        check_spin_us(bad)
    with pytest.raises(ValueError, match="spin_s must be a finite number >= 0"):
        Doorbell(bad)


def test_the_spin_in_effect_is_zero_where_a_thread_cannot_spin():
    assert spin_in_effect(0.0) == 0.0
    assert spin_in_effect(250.0) == (250e-6 if spin_available() else 0.0)
    assert Doorbell(250e-6).spin_s == spin_in_effect(250.0)


def test_the_cli_default_spin_is_the_executors():
    from dali_exec.executor.doorbell import DEFAULT_SPIN_US
    from dali_exec.executor.replay import ExecOptions
    from dali_sim.cli.exec_cmd import DEFAULT_SPIN_US as CLI_DEFAULT

    assert CLI_DEFAULT == DEFAULT_SPIN_US == ExecOptions().spin_us
    with pytest.raises(ValueError, match="spin_us"):
        ExecOptions(spin_us=-5)
