"""The policies' compiled loops (dali_sim.policies.kernels) equal their plain-Python form bit for bit, and
the vectorised policy helpers equal the per-expert definitions they replace."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dali_sim.policies import kernels
from dali_sim.policies.hybrimoe import _hss, hybrid_schedule, impact_prefix

SETTINGS = settings(max_examples=60, deadline=None)
# small integers (ties, equal sums) and arbitrary floats
TIMES = st.one_of(st.integers(0, 4).map(float), st.floats(0, 10, allow_nan=False, allow_infinity=False))


@st.composite
def layers(draw, max_n=12):
    n = draw(st.integers(0, max_n))
    t_gpu = np.array(draw(st.lists(TIMES, min_size=n, max_size=n)), dtype=float)
    t_cpu = np.array(draw(st.lists(TIMES, min_size=n, max_size=n)), dtype=float)
    flags = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    counts = np.array(draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)), dtype=np.int64)
    return t_gpu, t_cpu, flags, counts


def test_backend_is_named():
    assert kernels.backend() == "python" or kernels.backend().startswith("numba ")


@SETTINGS
@given(layer=layers(), limit=st.integers(0, 13), seed=st.integers(0, 99))
def test_greedy_kernel_equals_python(layer, limit, seed):
    t_gpu, t_cpu, needs, _ = layer
    order = np.random.default_rng(seed).permutation(len(t_gpu))
    want = kernels.python("greedy")(order.tolist(), t_gpu.tolist(), t_cpu.tolist(), needs.tolist(), limit)
    got = kernels.run("greedy", order, t_gpu, t_cpu, needs, limit)
    assert np.array_equal(np.asarray(got, dtype=bool), np.asarray(want, dtype=bool))


@SETTINGS
@given(layer=layers(), xfer=TIMES)
def test_hss_and_impact_kernels_equal_python(layer, xfer):
    t_gpu, t_cpu, cached, counts = layer
    order = np.lexsort((np.arange(len(counts)), -counts))
    want = kernels.python("hss")(order, cached, t_gpu, t_cpu, xfer)
    got = kernels.run("hss", order, cached, t_gpu, t_cpu, xfer)
    assert [np.asarray(x).tolist() for x in got] == [np.asarray(x).tolist() for x in want]
    cand = np.flatnonzero(~cached)
    assert kernels.run("impact", order, cached, t_gpu, t_cpu, xfer, cand) == \
        kernels.python("impact")(order, cached, t_gpu, t_cpu, xfer, cand)


def _impact_reference(by_load, cached, t_gpu, t_cpu, xfer, cand):
    """The impact prefix as first written: each prefix's HSS order built afresh from its mask."""
    mask = np.asarray(cached, dtype=bool).copy()
    best_gain, best_j, base = 0.0, 0, 0.0
    for j in range(len(cand) + 1):
        if j:
            mask[cand[j - 1]] = True
        order = np.array([i for i in by_load if mask[i]] + [i for i in by_load if not mask[i]], np.int64)
        _, _, g, c = kernels.python("hss")(order, mask, t_gpu, t_cpu, xfer)
        if j == 0:
            base = max(g, c)
        elif base - max(g, c) > best_gain:
            best_gain, best_j = base - max(g, c), j
    return best_gain, best_j


@SETTINGS
@given(layer=layers(max_n=16), xfer=TIMES, seed=st.integers(0, 99), how=st.sampled_from(["load", "shuffled", "any"]))
def test_impact_kernel_equals_the_prefix_by_prefix_orders(layer, xfer, seed, how):
    """The kernel keeps one order from prefix to prefix; the same result as building each prefix's order anew,
    for candidates in load order (as impact_prefix gives them), shuffled, or any ids (repeats, cached ones)."""
    t_gpu, t_cpu, cached, counts = layer
    rng = np.random.default_rng(seed)
    by_load = np.lexsort((np.arange(len(counts)), -counts))
    uncached = by_load[~cached[by_load]]
    cand = {"load": uncached, "shuffled": rng.permutation(uncached),
            "any": rng.integers(0, max(len(counts), 1), rng.integers(0, len(counts) + 1))}[how]
    cand = cand[:0] if not len(counts) else cand
    want = _impact_reference(by_load, cached, t_gpu, t_cpu, xfer, cand)
    assert kernels.run("impact", by_load, cached, t_gpu, t_cpu, xfer, cand) == want
    assert kernels.python("impact")(by_load, cached, t_gpu, t_cpu, xfer, cand) == want


def test_impact_kernel_equals_the_prefix_by_prefix_orders_at_a_models_size():
    """As above with up to a layer's worth of experts (the kernel keeps its GPU and CPU ends from prefix to
    prefix and moves the meeting point both ways), times of every scale, ties and zero-time experts, copies
    from free to many experts' compute, few to most experts cached; 300 layers."""
    rng = np.random.default_rng(7)
    for case in range(300):
        n = int(rng.integers(0, 131))
        if case % 4 == 0:  # small integers: ties everywhere
            t_gpu, t_cpu = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, n).astype(float)
            xfer = float(rng.integers(0, 4))
        else:
            t_gpu, t_cpu = rng.random(n) * rng.choice([1e-5, 1, 10]), rng.random(n) * rng.choice([1e-5, 1, 10, 100])
            xfer = float(rng.random() * rng.choice([0, 1e-5, 1, 10]))
        counts = rng.integers(1, 9, n)
        cached = rng.random(n) < rng.random()
        by_load = np.lexsort((np.arange(n), -counts))
        uncached = by_load[~cached[by_load]]
        cand = (uncached, rng.permutation(uncached), rng.integers(0, max(n, 1), rng.integers(0, n + 1)))[case % 3]
        cand = cand[:0] if not n else cand
        want = _impact_reference(by_load, cached, t_gpu, t_cpu, xfer, cand)
        assert kernels.run("impact", by_load, cached, t_gpu, t_cpu, xfer, cand) == want, case


def _hss_reference(counts, cached, t_gpu, t_cpu, xfer):
    """The released code's HSS as first written here, expert by expert (the kernel's specification)."""
    n = counts.shape[0]
    idx = np.arange(n)
    order = np.concatenate([g[np.lexsort((g, -counts[g]))] for g in (idx[cached], idx[~cached])]).tolist()
    on_gpu, fetched = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    g = c = moved = 0.0
    lo, hi = 0, n - 1
    while lo <= hi:
        head, tail = order[lo], order[hi]
        g_next = g + float(t_gpu[head]) if cached[head] else max(g, moved + xfer) + float(t_gpu[head])
        c_next = c + float(t_cpu[tail])
        if g_next <= c_next:
            if not cached[head]:
                moved += xfer
                fetched[head] = True
            on_gpu[head], g, lo = True, g_next, lo + 1
        else:
            c, hi = c_next, hi - 1
    return on_gpu, fetched, g, c


@SETTINGS
@given(layer=layers(), xfer=TIMES)
def test_hss_equals_its_expert_by_expert_definition(layer, xfer):
    t_gpu, t_cpu, cached, counts = layer
    got, want = _hss(counts, cached, t_gpu, t_cpu, xfer), _hss_reference(counts, cached, t_gpu, t_cpu, xfer)
    assert [np.asarray(x).tolist() for x in got] == [np.asarray(x).tolist() for x in want]


class _Costs:
    """Per-token times from a table (what impact_prefix reads of a cost model)."""

    def __init__(self, gpu, cpu, xfer):
        self.gpu, self.cpu, self.xfer = np.asarray(gpu), np.asarray(cpu), xfer

    def expert_time(self, device, n):
        return (self.gpu if device == "gpu" else self.cpu)[np.asarray(n)]

    def expert_time_table(self, device):
        return (self.gpu if device == "gpu" else self.cpu).astype(float)

    def expert_transfer_time(self):
        return self.xfer


@SETTINGS
@given(pred=st.lists(st.integers(0, 4), min_size=1, max_size=10), cached=st.lists(st.booleans(), min_size=10,
       max_size=10), gpu=st.lists(TIMES, min_size=5, max_size=5), cpu=st.lists(TIMES, min_size=5, max_size=5),
       xfer=TIMES)
def test_impact_prefix_equals_the_prefix_by_prefix_definition(pred, cached, gpu, cpu, xfer):
    pred = np.array(pred, dtype=float)
    cached = np.array(cached[: len(pred)], dtype=bool)
    costs = _Costs(gpu, cpu, xfer)
    experts = np.flatnonzero(pred > 0)
    chosen, gain = impact_prefix(pred, cached, costs, "hss")
    if experts.size == 0:
        assert (chosen, gain) == ([], 0.0)
        return
    counts = pred[experts]
    c = cached[experts].copy()
    t_gpu, t_cpu = costs.expert_time("gpu", counts.astype(int)), costs.expert_time("cpu", counts.astype(int))
    base = hybrid_schedule(counts, c, t_gpu, t_cpu, xfer, "hss").makespan
    cand = np.flatnonzero(~c)
    cand = cand[np.lexsort((experts[cand], -counts[cand]))]
    best_gain, best_j = 0.0, 0
    for j, i in enumerate(cand.tolist(), start=1):
        c[i] = True
        g = base - hybrid_schedule(counts, c, t_gpu, t_cpu, xfer, "hss").makespan
        if g > best_gain:
            best_gain, best_j = g, j
    want = ([int(e) for e in experts[cand[:best_j]]], best_gain / best_j) if best_j else ([], 0.0)
    assert (chosen, gain) == want


@SETTINGS
@given(pred=st.lists(st.one_of(st.integers(0, 6).map(float), st.floats(0, 6.9)), min_size=1, max_size=40),
       cached=st.lists(st.booleans(), min_size=40, max_size=40), gpu=st.lists(TIMES, min_size=7, max_size=7),
       cpu=st.lists(TIMES, min_size=7, max_size=7), xfer=TIMES)
def test_impact_prefix_compiled_in_one_call_equals_the_numpy_path(pred, cached, gpu, cpu, xfer):
    """The fused kernel (sorts, times and the prefix loop in one compiled call) against the NumPy path on
    fractional predicted workloads (truncated for times, sorted as they are) with ties."""
    pred = np.array(pred, dtype=float)
    cached = np.array(cached[: len(pred)], dtype=bool)
    costs = _Costs(gpu, cpu, xfer)
    got = impact_prefix(pred, cached, costs, "hss")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "fused", lambda name: None)
        want = impact_prefix(pred, cached, costs, "hss")
    assert got == want


def test_impact_prefix_is_compiled_with_numba():
    assert (kernels.fused("impact_prefix") is None) == (kernels.backend() == "python")


def _plain(out):
    if isinstance(out, tuple):
        return [_plain(x) for x in out]
    return np.asarray(out).tolist()


@pytest.mark.parametrize("name", ["greedy", "hss", "impact"])
def test_python_fallback_runs_on_lists(name, monkeypatch):
    monkeypatch.setenv("DALI_NUMBA", "0")
    try:
        kernels._load()
        assert kernels.backend() == "python"
        t = np.array([1.0, 2.0, 0.5])
        order = np.array([1, 0, 2])
        flags = np.array([True, False, False])
        args = {"greedy": (order, t, t[::-1].copy(), flags, 5), "hss": (order, flags, t, t[::-1].copy(), 0.3),
                "impact": (order, flags, t, t[::-1].copy(), 0.3, np.array([1, 2]))}[name]
        assert _plain(kernels.run(name, *args)) == _plain(kernels.python(name)(*args))
    finally:  # the configured backend again, every compiled kernel with it (later tests use them)
        monkeypatch.undo()
        kernels._load()
