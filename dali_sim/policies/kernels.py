"""The policies' inner loops that cannot be vectorised (each step depends on the last), compiled with
numba when it is installed, else run as the same Python code.

One source per loop: a kernel is written in the subset of Python numba compiles (``for``/``while``,
scalar arithmetic, indexing, ``np.zeros``) and reads its array arguments by index only, so the plain
Python fallback runs it unchanged on lists (``.tolist()`` of the arrays: faster to index than arrays).
Both give the same result bit for bit: float64 arithmetic in the same order, no fast-math (tested in
tests/test_policy_kernels.py). numba is imported, and each kernel compiled (cached on disk beside
this file, keyed also by the kernel sources: :mod:`.kernel_cache`), on the first call only;
``DALI_NUMBA=0`` in the environment disables it.

:func:`backend` says which is in use (``"numba X.Y"`` or ``"python"``).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from dali_sim.policies.kernel_cache import njit_cached


def _numba():
    if os.environ.get("DALI_NUMBA", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


def backend() -> str:
    nb = _numba()
    return f"numba {nb.__version__}" if nb is not None else "python"


def _greedy(order, t_gpu, t_cpu, needs, limit):
    """DALI Algorithm 1 over ``order``: GPU iff ``T_gpu + t_gpu <= T_cpu + t_cpu`` and, for an expert that
    ``needs`` a buffer, fewer than ``limit`` such experts went to the GPU so far."""
    out = np.zeros(len(order), np.bool_)
    t_g = 0.0
    t_c = 0.0
    new = 0
    for j in order:
        tg = t_gpu[j]
        tc = t_cpu[j]
        if t_g + tg <= t_c + tc and (not needs[j] or new < limit):
            out[j] = True
            t_g += tg
            if needs[j]:
                new += 1
        else:
            t_c += tc
    return out


def _hss(order, cached, t_gpu, t_cpu, xfer):
    """HybriMoE's HSS two-pointer schedule over ``order`` (see ``hybrimoe._hss``): (on_gpu, fetched,
    GPU end, CPU end)."""
    n = len(order)
    on_gpu = np.zeros(n, np.bool_)
    fetched = np.zeros(n, np.bool_)
    g = 0.0
    c = 0.0
    moved = 0.0
    lo = 0
    hi = n - 1
    while lo <= hi:
        head = order[lo]
        tail = order[hi]
        if cached[head]:
            g_next = g + t_gpu[head]
        else:
            g_next = max(g, moved + xfer) + t_gpu[head]
        c_next = c + t_cpu[tail]
        if g_next <= c_next:
            if not cached[head]:
                moved += xfer
                fetched[head] = True
            on_gpu[head] = True
            g = g_next
            lo += 1
        else:
            c = c_next
            hi -= 1
    return on_gpu, fetched, g, c


def _impact(by_load, cached, t_gpu, t_cpu, xfer, cand):
    """HybriMoE's impact prefix under HSS (see ``hybrimoe.impact_prefix``): bringing ``cand[:j]`` to the
    GPU lowers the makespan by ``G_j``; returns (the largest G_j, its j: the shortest on ties), or (0, 0)
    if none gains. The HSS order for a cached mask is ``by_load`` (descending load, ties lower index)
    with the cached experts first, stably. The order is kept from prefix to prefix (each newly cached
    expert moves from the uncached part into its place in the cached part).

    HSS's two pointers merge two non-decreasing series, the GPU's end after the first a experts of the order
    (``gpu[a]``) and the CPU's after the last b (``cpu[b]``), ties to the GPU, for n steps: the GPU ends up
    with the largest a such that ``gpu[a] <= cpu[n - a + 1]`` (:func:`_hss` step by step). Both series
    are kept from prefix to prefix, each recomputed (with the schedule's own float operations, in its order)
    only from where the moved expert changed the order, and the meeting point is searched from the last
    prefix's: the same ends as a schedule per prefix, without walking the whole order each time."""
    n = len(by_load)
    order = np.zeros(n, np.int64)
    mask = np.zeros(n, np.bool_)
    rank = np.zeros(n, np.int64)  # each expert's position in by_load
    n_cached = 0
    for i in range(n):
        rank[by_load[i]] = i
        mask[i] = cached[i]
        if cached[i]:
            n_cached += 1
    k = 0
    u = n_cached
    for i in by_load:
        if mask[i]:
            order[k] = i
            k += 1
        else:
            order[u] = i
            u += 1
    moved = np.zeros(n + 1)  # moved[u]: the copies' clock after u copies (summed as the schedule sums it)
    for i in range(n):
        moved[i + 1] = moved[i] + xfer
    gpu = np.zeros(n + 1)  # gpu[a]: the GPU's end after the first a experts of the order, valid to gv
    cpu = np.zeros(n + 1)  # cpu[b]: the CPU's end after the last b, valid to cv
    gv = 0
    cv = 0
    a = 0  # the meeting point: the GPU's share of the order
    best_gain = 0.0
    best_j = 0
    base = 0.0
    for j in range(len(cand) + 1):
        if j > 0 and not mask[cand[j - 1]]:
            x = cand[j - 1]
            mask[x] = True
            p = n_cached
            while order[p] != x:  # x leaves the uncached part (which keeps its order)
                p += 1
            cv = min(cv, n - 1 - p)  # (the experts after x keep their places)
            while p > n_cached:
                order[p] = order[p - 1]
                p -= 1
            while p > 0 and rank[order[p - 1]] > rank[x]:  # and takes its place in the cached part
                order[p] = order[p - 1]
                p -= 1
            order[p] = x
            n_cached += 1
            gv = min(gv, p)  # (the experts before x keep theirs)
        while True:  # down to the largest a (or 0) with gpu[a] <= cpu[n - a + 1], then up while a + 1 has it
            if a == 0:
                break
            while gv < a:
                h = order[gv]
                gpu[gv + 1] = gpu[gv] + t_gpu[h] if gv < n_cached else max(gpu[gv], moved[gv - n_cached + 1]) + t_gpu[h]
                gv += 1
            while cv < n - a + 1:
                cpu[cv + 1] = cpu[cv] + t_cpu[order[n - 1 - cv]]
                cv += 1
            if gpu[a] <= cpu[n - a + 1]:
                break
            a -= 1
        while a < n:
            while gv < a + 1:
                h = order[gv]
                gpu[gv + 1] = gpu[gv] + t_gpu[h] if gv < n_cached else max(gpu[gv], moved[gv - n_cached + 1]) + t_gpu[h]
                gv += 1
            while cv < n - a:
                cpu[cv + 1] = cpu[cv] + t_cpu[order[n - 1 - cv]]
                cv += 1
            if not gpu[a + 1] <= cpu[n - a]:
                break
            a += 1
        span = max(gpu[a], cpu[n - a])
        if j == 0:
            base = span
        elif base - span > best_gain:
            best_gain = base - span
            best_j = j
    return best_gain, best_j


def _impact_prefix(pred, cached, gpu_table, cpu_table, xfer):
    """``hybrimoe.impact_prefix`` under HSS in one call (compiled only; callers keep the NumPy path):
    ``pred`` (E,) float64 predicted workloads, every one below the tables' length, ``cached`` (E,) bool;
    the same selection, sorts (stable: ties to the lower id) and times as the NumPy path. Returns
    (the largest gain, its prefix length j, the predicted uncached experts in fetch order)."""
    experts = np.flatnonzero(pred > 0)
    counts = pred[experts]
    n = experts.shape[0]
    c = np.zeros(n, np.bool_)
    t_gpu = np.empty(n)
    t_cpu = np.empty(n)
    for i in range(n):
        c[i] = cached[experts[i]]
        k = np.int64(counts[i])  # predicted counts come as floats: truncated, as astype(int64)
        t_gpu[i] = gpu_table[k]
        t_cpu[i] = cpu_table[k]
    by_load = np.argsort(-counts, kind="mergesort")  # descending load, ties: lower index
    cand = np.empty(n, np.int64)  # the uncached ones in that order (a stable sort of them alone)
    m = 0
    for i in by_load:
        if not c[i]:
            cand[m] = i
            m += 1
    cand = cand[:m]
    gain, j = _impact_fn(by_load, c, t_gpu, t_cpu, xfer, cand)
    return gain, j, experts[cand]


def _ranked(experts, counts, ranks, k):
    """Positions of the experts with a count > 0 by descending count, then ascending rank, then id (an
    insertion sort on that whole key: a total order, the same as the NumPy lexsort); at most ``k`` (0 = all)
    (compiled only). ``experts`` are distinct, in any order."""
    n = experts.shape[0]
    order = np.empty(n, np.int64)
    m = 0
    for j in range(n):
        c = counts[j]
        if not c > 0:
            continue
        r = ranks[j]
        x = experts[j]
        i = m
        while i > 0:
            o = order[i - 1]
            if counts[o] > c or (counts[o] == c and (ranks[o] < r or (ranks[o] == r and experts[o] < x))):
                break
            order[i] = o
            i -= 1
        order[i] = j
        m += 1
    if 0 < k < m:
        m = k
    return order[:m]


def _top_predicted(counts, rank, k):
    """``prefetch_lookahead.top_predicted`` in one call (compiled only): :func:`_ranked` over every expert
    (``rank`` all zeros: no rank)."""
    return _ranked_fn(np.arange(counts.shape[0]), counts, rank, k)


def _as_pairs(experts, target):
    """The (m, 2) int64 prefetch requests ``(target, expert)`` of ``experts``."""
    pairs = np.empty((experts.shape[0], 2), np.int64)
    for i in range(experts.shape[0]):
        pairs[i, 0] = target
        pairs[i, 1] = experts[i]
    return pairs


def _top_pairs(counts, rank, k, target):
    """:func:`_top_predicted` as prefetch requests (compiled only)."""
    return _as_pairs_fn(_top_predicted_fn(counts, rank, k), target)


def _top_pairs_sparse(experts, counts, ranks, k, target):
    """:func:`_top_pairs` from the sparse form of the prediction (compiled only): ``experts`` (distinct, any
    order) with their predicted ``counts`` and best ``ranks``."""
    return _as_pairs_fn(experts[_ranked_fn(experts, counts, ranks, k)], target)


def _impact_requests(preds, distances, seen, layer, gpu_table, cpu_table, xfer, threshold, k):
    """``HybriMoEPrefetch.prefetch`` (source impact, schedule hss) after its lookups, in one call (compiled
    only): per predicted layer ``layer + distances[i]`` (``preds[i]`` its (E,) predicted workloads, below
    the tables' length), :func:`_impact_prefix` on ``seen[target]``; the prefixes whose gain per copy
    reaches ``threshold``, expert by expert ordered by (-gain per copy, distance, position), at most
    ``k`` (0 = all). Returns (whether every prediction was below the tables' length, the (m, 2) pairs of
    target layer and expert): when one was not, nothing is computed (the caller takes the NumPy path)."""
    total = 0
    top = min(gpu_table.shape[0], cpu_table.shape[0])
    for pred in preds:
        total += pred.shape[0]
        for x in range(pred.shape[0]):
            if not pred[x] < top:
                return False, np.empty((0, 2), np.int64)
    neg_gain = np.empty(total)
    dist = np.empty(total, np.int64)
    pos = np.empty(total, np.int64)
    expert = np.empty(total, np.int64)
    m = 0
    for i in range(len(preds)):
        d = distances[i]
        gain, j, order = _impact_prefix_fn(preds[i], seen[layer + d], gpu_table, cpu_table, xfer)
        if j == 0:
            continue
        per_copy = gain / j
        if per_copy < threshold:
            continue
        for p in range(j):
            neg_gain[m] = -per_copy
            dist[m] = d
            pos[m] = p
            expert[m] = order[p]
            m += 1
    rank = np.empty(m, np.int64)  # insertion sort of 0..m-1 on (-gain, distance, position)
    for a in range(m):
        i = a
        while i > 0:
            o = rank[i - 1]
            if neg_gain[o] < neg_gain[a] or (neg_gain[o] == neg_gain[a] and (
                    dist[o] < dist[a] or (dist[o] == dist[a] and pos[o] < pos[a]))):
                break
            rank[i] = o
            i -= 1
        rank[i] = a
    if 0 < k < m:
        m = k
    pairs = np.empty((m, 2), np.int64)
    for i in range(m):
        pairs[i, 0] = layer + dist[rank[i]]
        pairs[i, 1] = expert[rank[i]]
    return True, pairs


def _mrs_update(score, experts, counts, tokens, a):
    """``hybrimoe.mrs_update`` of one layer's (E,) scores in place (compiled only): the same float64
    operations in the same order, ``a * s + (1 - a) * S`` with ``s`` the activated experts' token shares."""
    s = np.zeros(score.shape[0])
    if tokens > 0:
        for i in range(experts.shape[0]):
            s[experts[i]] = np.float64(counts[i]) / tokens
    b = 1.0 - a
    for x in range(score.shape[0]):
        score[x] = a * s[x] + b * score[x]


_PYTHON = {"greedy": _greedy, "hss": _hss, "impact": _impact}
_hss_fn = _hss  # what the plan kernel calls: the compiled _hss
_impact_fn = _impact  # what _impact_prefix calls: the compiled _impact
_impact_prefix_fn = _impact_prefix  # what _impact_requests calls: the compiled _impact_prefix
_top_predicted_fn = _top_predicted  # what _top_pairs calls: the compiled _top_predicted
_ranked_fn = _ranked  # what _top_predicted and _top_pairs_sparse call: the compiled _ranked
_as_pairs_fn = _as_pairs  # what _top_pairs and _top_pairs_sparse call: the compiled _as_pairs
_impls: dict[str, Callable] | None = None
_fused: dict[str, Callable] = {}  # kernels with no Python fallback (callers keep a NumPy path)


def _on_lists(fn: Callable) -> Callable:
    return lambda *args: fn(*(a.tolist() if isinstance(a, np.ndarray) else a for a in args))


def _load() -> dict[str, Callable]:
    global _impls, _hss_fn, _impact_fn, _impact_prefix_fn, _top_predicted_fn, _ranked_fn, _as_pairs_fn
    nb = _numba()
    _fused.clear()
    if nb is None:
        _hss_fn, _impact_fn, _impact_prefix_fn = _hss, _impact, _impact_prefix
        _impls = {name: _on_lists(fn) for name, fn in _PYTHON.items()}
    else:
        _hss_fn = jit(_hss)
        _impact_fn = jit(_impact)
        _impls = {"greedy": jit(_greedy), "hss": _hss_fn, "impact": _impact_fn}
        _impact_prefix_fn = _fused["impact_prefix"] = jit(_impact_prefix)
        _ranked_fn, _as_pairs_fn = jit(_ranked), jit(_as_pairs)
        _top_predicted_fn = _fused["top_predicted"] = jit(_top_predicted)
        for name, fn in (("top_pairs", _top_pairs), ("top_pairs_sparse", _top_pairs_sparse),
                         ("impact_requests", _impact_requests), ("mrs_update", _mrs_update)):
            _fused[name] = jit(fn)
    return _impls


def fused(name: str) -> Callable | None:
    """A compiled kernel without a Python fallback (``impact_prefix``, ``impact_requests``, ``top_predicted``,
    ``top_pairs``, ``top_pairs_sparse``, ``mrs_update``), or None without numba."""
    if _impls is None:
        _load()
    return _fused.get(name)


def cost_tables(owner, costs) -> tuple[np.ndarray, np.ndarray, float] | None:
    """``(GPU time table, CPU time table, one expert's copy)`` of ``costs`` (None: it has no tables), kept on
    ``owner`` (a policy) for the cost model it last asked about: asked at every layer visit."""
    cached = getattr(owner, "_cost_tables", None)
    if cached is not None and cached[0] is costs:
        return cached[1]
    table = getattr(costs, "expert_time_table", None)
    tables = None if table is None else (table("gpu"), table("cpu"), float(costs.expert_transfer_time()))
    owner._cost_tables = (costs, tables)
    return tables


def jit(fn: Callable) -> Callable | None:
    """``fn`` compiled by numba on its first call (``nogil``, cached on disk beside its module, keyed by the
    kernel sources: :mod:`.kernel_cache`), or None when numba is not installed or ``DALI_NUMBA=0``: for other
    packages' loops (the executor's index building), whose callers keep a NumPy path for None."""
    nb = _numba()
    return None if nb is None else njit_cached(nb, fn)


def entry(dispatcher, calls: list[tuple]) -> Callable:
    """``dispatcher``'s compiled function for the argument types of ``calls`` (example argument tuples, compiled
    if need be), callable without the dispatcher's typing and look-up of every argument (a large share of a
    call's cost when the caches are cold): for a caller whose arguments have these types at every call, as
    nothing checks them then. The dispatcher itself when the examples' types differ."""
    sigs = {tuple(dispatcher.typeof_pyval(a) for a in args) for args in calls}
    if len(sigs) != 1:
        return dispatcher
    return dispatcher.compile(sigs.pop())


def run(name: str, *args):
    """Call kernel ``name`` (``greedy``, ``hss``, ``impact``) compiled, or as Python on lists."""
    return (_impls or _load())[name](*args)


def python(name: str) -> Callable:
    """The kernel as plain Python (on arrays or lists), whatever the backend: the reference in tests."""
    return _PYTHON[name]


__all__ = ["backend", "cost_tables", "entry", "fused", "jit", "python", "run"]
