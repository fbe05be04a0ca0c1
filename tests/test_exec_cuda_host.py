"""The CUDA branches' host side, run on the CPU with torch.cuda's stream calls stood in for: on-demand copies are
issued with the copy stream current and the issuing thread's stream made current again after them (also when a
copy fails), without ``torch.cuda.stream`` (which asks whether CUDA is available, twice a call); the copy thread
makes the copy stream its own once; a stamp takes an event made ahead, each event one stamp."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from dali_exec.executor import timing  # noqa: E402
from dali_exec.executor.copies import BACKGROUND, CopyEngine  # noqa: E402
from dali_exec.executor.timing import Timer, stamps_ahead  # noqa: E402
from dali_sim.sim.engine import Activity  # noqa: E402


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited: list = []

    def wait_event(self, ev):
        self.waited.append(ev)


class Streams:
    """torch.cuda's per-thread current stream, stood in for (``home``: every thread's until it sets one)."""

    def __init__(self, home):
        self.home, self.current, self.set_by = home, {}, []

    def set_stream(self, s):
        self.current[threading.get_ident()] = s
        self.set_by.append((threading.current_thread().name, s.name))

    def current_stream(self, device=None):
        assert isinstance(device, int) or getattr(device, "index", None) is not None, \
            "asked with a device index (else torch asks whether CUDA is available)"
        return self.current.get(threading.get_ident(), self.home)


class StampEvent:
    """A CUDA event stand-in: each record notes the stream given and the thread's current stream."""

    streams: Streams | None = None

    def __init__(self, **kwargs):
        self.records: list = []

    def record(self, stream=None):
        self.records.append((stream.name, StampEvent.streams.current_stream(0).name))

    def synchronize(self):
        pass


@pytest.fixture
def cuda_calls(monkeypatch):
    streams = Streams(FakeStream("home"))
    StampEvent.streams = streams
    monkeypatch.setattr(torch.cuda, "set_stream", streams.set_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", streams.current_stream)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def no_context(stream):
        raise AssertionError("torch.cuda.stream(...) used")

    monkeypatch.setattr(torch.cuda, "stream", no_context)
    return streams


def engine(streams, home=None):
    copy = FakeStream("copy")
    return CopyEngine(copy, Timer(event=StampEvent), device=torch.device("cuda", 0), home=home), copy


@pytest.mark.parametrize("given_home", [False, True])
def test_on_demand_copies_run_on_the_copy_stream_and_the_home_stream_comes_back(cuda_calls, given_home):
    eng, copy = engine(cuda_calls, cuda_calls.home if given_home else None)
    try:
        src = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
        dst = torch.zeros(3, 4)
        after = [StampEvent(), None]
        ends = eng.issue_now(dst, src, [2, 0], 1, [1, 2], step=0, after=after)
        assert dst[2].tolist() == src[1, 1].tolist() and dst[0].tolist() == src[1, 2].tolist()
        assert copy.waited == [after[0]]  # (each copy after the compute that last read its row)
        assert len(ends) == 2 and all(e.records == [("copy", "copy")] for e in ends)  # stamped with copy current
        assert cuda_calls.current_stream(0) is cuda_calls.home
        start, end = eng.copy_one(dst[1], src[0, 0], after=ends[0])
        assert dst[1].tolist() == src[0, 0].tolist() and copy.waited[-1] is ends[0]
        assert start.records == end.records == [("copy", "copy")]
        assert cuda_calls.current_stream(0) is cuda_calls.home
        with pytest.raises(RuntimeError):  # a failed copy (shapes differ): the home stream still comes back
            eng.copy_one(dst[1], torch.zeros(5))
        assert cuda_calls.current_stream(0) is cuda_calls.home
        with pytest.raises(RuntimeError):
            eng.issue_now(dst, torch.zeros(2, 3, 5), [0], 0, [0], step=0)
        assert cuda_calls.current_stream(0) is cuda_calls.home
    finally:
        eng.close()


def test_the_copy_thread_makes_the_copy_stream_its_own_once(cuda_calls):
    eng, copy = engine(cuda_calls)
    try:
        src, dst = torch.arange(8, dtype=torch.float32).view(2, 4), torch.zeros(2, 4)
        for i in range(2):
            t = eng.submit(dst[i], src[1 - i], BACKGROUND, Activity("prefetch", 0, 0, i))
            t.wait()
            assert t.starts[0].records == t.ends[0].records == [("copy", "copy")]
        assert dst.tolist() == [src[1].tolist(), src[0].tolist()]
        assert cuda_calls.set_by == [("dali-copy", "copy")]  # once, by the copy thread
        assert cuda_calls.current_stream(0) is cuda_calls.home  # (this thread's is its own)
    finally:
        eng.close()


def test_a_stamp_takes_an_event_made_ahead_each_event_once(cuda_calls):
    timer = Timer(torch.device("cuda", 0), event=StampEvent)
    timer.start(ahead=3)
    stock = list(timer._stock)
    assert len(stock) == 3 and all(ev.records == [("home", "home")] for ev in stock)  # made: recorded once
    s = FakeStream("compute")
    stamps = [timer.mark(s) for _ in range(5)]
    assert len({id(e) for e in stamps}) == 5  # every stamp its own event
    assert sorted(map(id, stamps[:3])) == sorted(map(id, stock))  # the stock first, then new ones
    assert [len(e.records) for e in stamps] == [2, 2, 2, 1, 1]
    timer.start(ahead=2)  # a new run: the stock topped up, no event of the last run's stamps in it
    assert len(timer._stock) == 2 and not {id(e) for e in timer._stock} & {id(e) for e in stamps}


def test_the_estimate_of_a_runs_stamps_is_capped():
    assert stamps_ahead(10, 4) == 10 * (2 * 4 + 8)
    assert stamps_ahead(10**6, 128) == timing.MAX_AHEAD
    assert stamps_ahead(0, 8) == 0 and stamps_ahead(5, -1) == 40
