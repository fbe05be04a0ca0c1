"""One transfer for a group's index arrays (dali_exec/executor/packed.py): the int64 arrays and the 4-byte ones
(int32 offsets, float32 weights) come back exactly, as views of one buffer of a ring made at set-up; a ring
buffer is written again only after the copy from it has run; the runtime's CUDA branch slices them as its
callers expect (run here with the ring on the CPU device: unpinned buffers, a stand-in event class)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dali_exec.executor import runtime  # noqa: E402
from dali_exec.executor.packed import PinnedRing  # noqa: E402

CPU = torch.device("cpu")


class LoggedEvent:
    """A CUDA event stand-in that logs its records and waits (``log``: (what, event number))."""

    log: list = []
    made = 0

    def __init__(self, **kwargs):
        self.n = LoggedEvent.made
        LoggedEvent.made += 1
        self.on_wait = None  # called before a wait returns (a test's check of the ring's buffers)

    def record(self, stream=None):
        LoggedEvent.log.append(("record", self.n))

    def synchronize(self):
        LoggedEvent.log.append(("wait", self.n))
        if self.on_wait is not None:
            self.on_wait()


@pytest.fixture
def events():
    LoggedEvent.log, LoggedEvent.made = [], 0
    return LoggedEvent


def ring(events, words=64, slots=16):
    return PinnedRing(CPU, "stream", words, slots, pin=False, event=events)


@pytest.mark.parametrize("n4", [0, 1, 2, 5])
def test_every_array_comes_back_exactly_from_one_buffer(n4, events):
    rng = np.random.default_rng(n4)
    ints = [rng.integers(-2**62, 2**62, 7), np.zeros(0, np.int64), np.arange(3, dtype=np.int64)]
    offs = np.array([0, 2**31 - 1, -2**31, 5, 9][:n4], np.int32)
    w = np.array([np.nan, -0.0, 1e-45, np.inf, 0.3][:n4], np.float32)  # (bit patterns a cast would not keep)
    r = ring(events)
    out64, out4 = r.send(ints, [offs, w])
    for a, t in zip(ints, out64):
        assert t.dtype == torch.int64 and np.array_equal(t.numpy(), a)
    assert out4[0].dtype == torch.int32 and np.array_equal(out4[0].numpy(), offs)
    assert out4[1].dtype == torch.float32 and out4[1].numpy().view(np.int32).tolist() == w.view(np.int32).tolist()
    base = r.host[0].data_ptr()
    assert all(t.untyped_storage().data_ptr() == r.host.untyped_storage().data_ptr() for t in out64 + out4)
    assert out64[0].data_ptr() == base  # (the first buffer of the ring: views of one buffer, one transfer)
    assert events.log == [("record", 0)]  # the transfer's event, on the ring's stream


def test_a_buffer_is_written_again_only_after_the_copy_from_it_has_run(events):
    r = ring(events, slots=2)
    first = np.arange(5, dtype=np.int64)
    r.send([first], [])
    r.send([first + 10], [])
    # the third transfer comes round to buffer 0: it waits for the first copy's event before it writes there
    r.events[0].on_wait = lambda: seen.append(r.arrays[0][:5].tolist())
    seen: list = []
    (out,), _ = r.send([first + 20], [])
    assert seen == [first.tolist()]  # buffer 0 still held the first transfer's data while the ring waited
    assert out.tolist() == (first + 20).tolist()
    assert events.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 0)]


def test_a_transfer_larger_than_the_buffers_gets_larger_buffers(events):
    r = ring(events, words=4, slots=2)
    (small,), _ = r.send([np.arange(3, dtype=np.int64)], [])
    big = np.arange(100, dtype=np.int64)
    (a, b), (w,) = r.send([big, big * 2], [np.full(7, 0.5, np.float32)])
    assert r.words >= 200 + 4 and a.tolist() == big.tolist() and b.tolist() == (big * 2).tolist()
    assert w.tolist() == [0.5] * 7
    assert small.tolist() == [0, 1, 2]  # (the old buffers are left to the transfers queued from them)


def test_other_four_byte_types_are_refused(events):
    with pytest.raises(TypeError, match="must be int32 or float32, not int16"):
        ring(events).send([], [np.zeros(2, np.int16)])


def test_a_ring_needs_a_buffer(events):
    with pytest.raises(ValueError, match="at least one buffer of one word, got 0 of 8"):
        PinnedRing(CPU, None, 8, 0, pin=False, event=events)


@pytest.mark.parametrize("bias", [False, True])
def test_cuda_branches_slice_the_transfer_as_their_callers_expect(bias, events):
    sent = []
    r = ring(events)

    def send(int64s, fours):  # the CUDA branch's transfer, made on the CPU
        sent.append(len(int64s))
        return r.send(int64s, fours)

    pairs, tokens = np.array([4, 1, 6], np.int64), np.array([2, 0, 3], np.int64)
    offs, rows = np.array([1, 3], np.int32), np.array([0, 1, 1], np.int64)
    weights = np.array([0.5, 0.25, 0.125], np.float32)
    pos, tok, o, rw, w = runtime._device_indices(pairs, tokens, offs, lambda: rows, weights, send, torch.bfloat16,
                                                 bias)
    assert pos.tolist() == [4, 1, 6] and tok.tolist() == [2, 0, 3] and o.dtype == torch.int32 and o.tolist() == [1, 3]
    assert (rw.tolist() == [0, 1, 1]) if bias else rw is None
    assert w.shape == (3, 1) and w.dtype == torch.bfloat16 and w[:, 0].float().tolist() == [0.5, 0.25, 0.125]
    rt = runtime.OffloadRuntime.__new__(runtime.OffloadRuntime)
    rt.dev = type("Dev", (), {"is_cuda": True, "accel": torch.device("cuda"), "dtype": torch.float32})()
    rt._send = send
    pos, tok, w = rt._pairs_on_accel(pairs, tokens, weights)
    assert pos.tolist() == [4, 1, 6] and tok.tolist() == [2, 0, 3]
    assert w.shape == (3, 1) and w[:, 0].tolist() == [0.5, 0.25, 0.125]
    assert sent == [3 if bias else 2, 2]
