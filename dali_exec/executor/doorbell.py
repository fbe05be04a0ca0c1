"""How a thread that waits for work (the CPU lane's worker) is told of new work: it spins for up to ``spin_s``
before it sleeps.

Waking a thread that sleeps on a lock or queue is a system call and, where its core has halted, an
interrupt to another core, which its waker pays for: on the 2-core development VM 15-25 us of the waking
thread's CPU per hand-over after a layer of milliseconds (benchmarks/README.md, "Hand-overs to sleeping
threads"), as much as the rest of a layer visit's bookkeeping. A thread that is still spinning when its work
comes needs no wake: the waker increments a counter the spinning thread reads. llama.cpp's CPU threadpool
does the same between graphs (ggml-org/llama.cpp, ``ggml/src/ggml-cpu/ggml-cpu.c``,
``ggml_graph_compute_poll_for_work``: ``1024 * 128 * poll`` relax rounds, ``poll`` 50 by default, before a
condition-variable wait; "threadpool: make polling the default to match openmp behavior", pull request 8672),
as do OpenMP runtimes (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``).

The spin is one compiled call that releases the GIL (numba; an atomic load of the counter, x86's ``pause``
between reads, the time-stamp counter for its length), so the thread that rings holds the GIL throughout and
the spinning thread costs it nothing. The price is a core kept busy for up to ``spin_s`` after each job. On
other processors than x86-64, or without numba (``DALI_NUMBA=0``), the spin is 0: every wait sleeps.

Protocol: the waiting thread reads the ring count (:attr:`Doorbell.rings`) *before* it looks for work; finding
none, it calls :meth:`Doorbell.wait` with that count, which marks it spinning, spins until the count moves or
``spin_s`` passes, then marks it asleep, looks at the count once more and only then sleeps on a queue.
:meth:`Doorbell.ring` increments the count and, only where the thread is marked asleep, marks it awake and puts
a token in its queue. Whatever the order in which the two threads' steps interleave, a ring made after the
count was read is seen: either by the spin or the last look, or, where the ring saw the mark, by its token.
A token can be left over (the last look saw the ring that also put it): the next wait then returns at once and
the thread looks for work again. The ring and the mark-then-look are Python steps made holding the GIL, whose
hand-over between the two threads orders their memory accesses: the ringer's count cannot be missed by a look that
follows the mark, as it could be on x86 without that ordering (a store may pass a later load); a Python without a
GIL would need a fence there.
"""

from __future__ import annotations

import functools
import platform
import queue
import time

import numpy as np

from dali_sim.policies import kernels as _policy_kernels

#: the executor's default spin (``--spin-us``): a millisecond covers the gap between two layers' jobs where a
#: layer computes in 0.1-1 ms (a small-expert model on a GPU: Qwen3-30B-A3B, DeepSeek-V2-Lite, the issue's
#: targets), and costs a core at most that long after each job; layers of several milliseconds find the
#: worker asleep, as before (benchmarks/README.md, "A worker that spins for its next job")
DEFAULT_SPIN_US = 1000.0

RINGS, PHASE = 0, 1  # the state array's cells: rings so far, and the waiting thread's phase
BUSY, SPINNING, ASLEEP = 0, 1, 2

try:  # (the compiled spin's pieces; without numba every wait sleeps)
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.core import cgutils as _cgutils
    from numba.core.extending import intrinsic as _intrinsic
except ImportError:  # pragma: no cover - numba is a dependency of the exec extra
    _intrinsic = None

if _intrinsic is not None:
    @_intrinsic
    def _load_acquire(typingctx, array, index):
        """``array[index]`` (int64) read as an atomic acquire load: read again at every call, never hoisted."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = _cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
            return builder.load_atomic(ptr, "acquire", 8)
        return _types.int64(array, index), codegen

    @_intrinsic
    def _relax(typingctx):
        """x86's ``pause``: a spinning core yields its pipeline to its sibling and saves power."""
        def codegen(context, builder, sig, args):
            fn = _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), []),
                                                 "llvm.x86.sse2.pause")
            builder.call(fn, [])
            return context.get_dummy_value()
        return _types.void(), codegen

    @_intrinsic
    def _cycles(typingctx):
        """The time-stamp counter (``llvm.readcyclecounter``: ``rdtsc`` on x86-64)."""
        def codegen(context, builder, sig, args):
            fn = _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.IntType(64), []),
                                                 "llvm.readcyclecounter")
            return builder.call(fn, [])
        return _types.int64(), codegen


def _spin_until_rung(state, seen, cycles):
    """Spin until ``state[RINGS]`` differs from ``seen`` (True) or ``cycles`` time-stamp counts pass (False)."""
    start = _cycles()
    while _load_acquire(state, RINGS) == seen:
        _relax()
        if _cycles() - start > cycles:
            return False
    return True


def _read_cycles():
    return _cycles()


@functools.cache
def _compiled() -> tuple | None:
    """(the compiled spin, time-stamp counts per second), or None where spinning is off (not x86-64, no numba)."""
    if _intrinsic is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    spin, read = _policy_kernels.jit(_spin_until_rung), _policy_kernels.jit(_read_cycles)
    if spin is None or read is None:
        return None
    read()  # (compiled, or loaded from the cache, before the counter is timed)
    c0, t0 = read(), time.perf_counter_ns()
    time.sleep(0.002)
    c1, t1 = read(), time.perf_counter_ns()
    return spin, (c1 - c0) / (1e-9 * (t1 - t0))


def spin_for(seconds: float) -> None:
    """This thread in the waiting threads' compiled spin for ``seconds`` (as a worker spins for a job that does not
    come; the calibration times a call after it); a sleep where spinning is off."""
    compiled = _compiled()
    if compiled is None:
        time.sleep(seconds)
        return
    spin, per_s = compiled
    spin(np.zeros(2, np.int64), 0, int(seconds * per_s))


def check_spin_us(spin_us: float, name: str = "spin_us") -> None:
    """A spin must be a finite number of microseconds >= 0."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not 0 <= spin_us < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {spin_us!r}")


def spin_available() -> bool:
    """Whether a waiting thread can spin here (x86-64 and numba)."""
    return _compiled() is not None


def spin_in_effect(spin_us: float) -> float:
    """The seconds a waiting thread given ``spin_us`` spins here (0 where it cannot: :func:`spin_available`)."""
    return 1e-6 * spin_us if spin_us > 0 and spin_available() else 0.0


class Doorbell:
    """Tells one waiting thread that there is work: :meth:`wait` (the waiting thread) returns after a
    :meth:`ring` (any other thread) made since it read :attr:`rings`, having spun up to ``spin_s`` for it
    before sleeping. It may also return without one (a token left from an earlier ring): the waiter looks for
    work and waits again."""

    __slots__ = ("spin_s", "_state", "_bell", "_spin", "_cycles", "_sleeps")

    def __init__(self, spin_s: float = 0.0):
        check_spin_us(spin_s, "spin_s")
        compiled = _compiled() if spin_s > 0 else None
        #: the spin in effect (0 where spinning is off)
        self.spin_s = spin_s if compiled is not None else 0.0
        self._spin, per_s = compiled if compiled is not None else (None, 0.0)
        self._cycles = int(spin_s * per_s)
        self._state = np.zeros(2, np.int64)
        self._bell: queue.SimpleQueue = queue.SimpleQueue()
        self._sleeps = 0

    @property
    def rings(self) -> int:
        """The rings so far: read before looking for work, given to :meth:`wait` when there is none."""
        return int(self._state[RINGS])

    @property
    def waiting(self) -> bool:
        """Whether the waiting thread spins or sleeps (it waits for a ring)."""
        return bool(self._state[PHASE])

    @property
    def asleep(self) -> bool:
        """Whether the waiting thread sleeps (a ring now wakes it: a system call)."""
        return int(self._state[PHASE]) == ASLEEP

    @property
    def sleeps(self) -> int:
        """How many times the waiting thread has gone to sleep."""
        return self._sleeps

    def ring(self) -> bool:
        """Tell the waiting thread there is work; True when that woke it from its sleep."""
        state = self._state
        state[RINGS] += 1
        if state[PHASE] != ASLEEP:
            return False
        state[PHASE] = BUSY
        self._bell.put(None)
        return True

    def wait(self, seen: int) -> None:
        """Called by the waiting thread, which found no work after reading :attr:`rings` (``seen``): returns
        once rung since (see the module's protocol)."""
        state = self._state
        if self._spin is not None:
            state[PHASE] = SPINNING
            self._spin(state, seen, self._cycles)
        state[PHASE] = ASLEEP
        if state[RINGS] != seen:  # (rung while it spun, or before it was marked asleep)
            state[PHASE] = BUSY
            return
        self._sleeps += 1
        self._bell.get()  # (the ring marked it awake)
