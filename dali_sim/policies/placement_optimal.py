"""BOUND: the exact per-layer optimum of DALI's assignment objective.

Per (step, MoE layer), with the cost model of :mod:`dali_sim.policies.placement_dali`::

    minimise   T
    subject to sum_e t_gpu(e) x_e            <= T        (GPU lane)
               sum_e t_cpu(e) (1 - x_e)      <= T        (CPU lane)
               sum_{e needs a buffer} x_e    <= M        (optimal-mem only: see fetch_limit)
               x_e in {0, 1} (1 = GPU),  T >= 0

This is the exact optimum of the *model* DALI's greedy approximates, per layer: it is a bound on what
any per-layer assignment can achieve under that model, not a bound on the simulated time (which adds
copies serialised on the link, waiting and cache effects on later layers).

Canonical order: the experts are sorted by (t_gpu, t_cpu, needs_buffer), identical experts by their
input position, so equal multisets of experts get the same solution (repeated layers are answered from
a memo). In that order, bit ``i`` of a mask is expert ``i``, and among equally good assignments the one
returned is the **first in mask order** (the smallest mask as a binary number): the fewest experts of
the types with the largest ``t_gpu`` (those that need copies) on the GPU.

Solvers (``placement.solver``):

* up to :data:`ENUMERATE_MAX` experts: all ``2^n`` masks are evaluated (:func:`_enumerate`);
* ``dp`` (default): a dynamic program over *types*, the distinct (t_gpu, t_cpu, needs_buffer) triples
  (:func:`dp_assign`; Qwen3-30B-A3B at batch 32: about 10 types for 90 experts);
* ``milp``: ``scipy.optimize.milp`` (HiGHS branch and bound, relative gap 0, times rescaled so the
  optimum is about 1e6), the reference; ties as HiGHS returns them.

Why the DP is exact (proof sketch). (1) Experts of one type are interchangeable, so an assignment is
determined, up to cost, by the count ``k_j`` of each type ``j`` on the GPU: ``G = sum k_j g_j``,
``C = sum (m_j - k_j) c_j``, ``B = sum k_j b_j``. (2) Level ``j`` of the DP holds states ``(G, C, B)`` of
the first ``j`` types. If a state is no better than another in all three, every completion of it is
also a completion of the other that is no worse (the makespan ``max(G, C)`` and the constraint ``B <=
M`` are monotone), so dropping dominated states keeps an optimal completion and, for the backward
pass, keeps every *feasibility* answer. (3) A state whose loads cannot end within the greedy's makespan
``U`` (an upper bound on the optimum, since the greedy with the memory rule is feasible) is dropped:
``G > U``, ``C > U`` or ``(G + C + R_j) / 2 > U``, where ``R_j`` is the least the later types add to
``G + C`` (each expert adds at least ``min(g, c)``) and ``max(G', C') >= (G' + C') / 2``; no optimal
assignment passes through such a state. (4) The last level then contains an optimal assignment, and
``OPT`` is its least ``max(G, C)``. (5) Mask order compares the highest bits first; the highest bits are
the last type's, and with ``k`` of a type on the GPU the smallest mask puts its first ``k`` experts
there; so the first optimal mask in mask order minimises ``k_T``, then ``k_{T-1}``, and so on. The
backward pass does exactly that: from the last type down it takes the smallest ``k_j`` for which level
``j`` still holds a state that completes the fixed suffix within ``OPT``; by (2) and (3) that test is
exact. Loads are float sums in another order than a mask's own; comparisons allow ``TIE_TOL``
(relative, 1e-12): assignments that close to the optimum count as ties. Tests: the DP against the
enumeration on small layers (masks equal) and against HiGHS on random and recorded layers (optimum
equal), tests/test_placement_dali.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import PLACEMENTS, LayerView, PlacementPolicy, registered
from dali_sim.policies.placement_dali import (
    DaliGreedyConfig,
    MemoryRuleConfig,
    _check_inputs,
    _MemoryLimited,
    expert_times,
    greedy_assign,
    makespan,
)

TARGET_SCALE = 1e6  # the optimum's magnitude after rescaling (see the module docstring)
MEMO_SIZE = 1 << 16


class SolverError(RuntimeError):
    """HiGHS did not prove optimality (time limit, numerical trouble)."""


def _scale(t_gpu: np.ndarray, t_cpu: np.ndarray) -> float:
    """Factor that brings the optimum to about TARGET_SCALE, with no coefficient above 1e9."""
    low = np.minimum(t_gpu, t_cpu)
    # OPT >= sum_e min(t_gpu, t_cpu) / 2 (the two lanes hold at least that work) and >= max_e min(...)
    lower = max(float(low.sum()) / 2, float(low.max(initial=0.0)))
    top = float(max(t_gpu.max(initial=0.0), t_cpu.max(initial=0.0)))
    if top <= 0:
        return 1.0
    if lower <= 0:
        return TARGET_SCALE / top
    return min(TARGET_SCALE / lower, 1e9 / top)


ENUMERATE_MAX = 12  # up to this many experts, every one of the 2^n assignments is evaluated


def _enumerate(t_gpu: np.ndarray, t_cpu: np.ndarray, needs: np.ndarray, max_new: int | None) -> np.ndarray:
    """Exact by exhaustion (small layers): the first minimiser in mask order."""
    n = len(t_gpu)
    masks = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(bool)
    cost = np.maximum(masks @ t_gpu, ~masks @ t_cpu)
    if max_new is not None:
        cost[(masks & needs).sum(axis=1) > max_new] = np.inf
    return masks[int(np.argmin(cost))]


#: relative slack within which two assignments count as equally good (float sums in another order)
TIE_TOL = 1e-12
SOLVERS = ("dp", "milp")


def _types_dp(g, c, b, m, limit, cap, tol):
    """Exact dynamic program over expert *types* (see :func:`dp_assign`): ``k[j]`` of the ``m[j]``
    identical experts of type ``j`` (GPU time ``g[j]``, CPU time ``c[j]``, ``b[j]`` = 1 if each needs a
    buffer) go to the GPU. Returns ``(k, ok)``; ``ok`` is False if no assignment with makespan within
    ``cap`` exists (``cap`` >= a feasible makespan never gives that).

    Forward: level ``j`` holds the states ``(G, C, B)`` (GPU load, CPU load, buffers taken) of the first
    ``j`` types that no other state of the level beats in all three (dominated ones cannot lead to a
    better completion), G ascending; states that cannot finish within ``cap`` are dropped. Backward:
    the optimum ``OPT`` is the least ``max(G, C)`` of the last level; from the last type down, ``k[j]``
    is the smallest count for which the earlier types can still finish within ``OPT (1 + tol)``, which
    is the assignment first in mask order (module docstring)."""
    T = g.shape[0]
    rest = np.zeros(T + 1)  # what the later types add to G + C at least
    for j in range(T - 1, -1, -1):
        rest[j] = rest[j + 1] + m[j] * min(g[j], c[j])
    size = 1024
    fg = np.zeros(size)
    fc = np.zeros(size)
    fb = np.zeros(size, np.int64)
    off = np.zeros(T + 2, np.int64)
    off[1] = 1  # level 0: the empty prefix
    minc = np.empty(limit + 1)
    for j in range(T):
        lo = off[j]
        hi = off[j + 1]
        mj = m[j]
        total = (hi - lo) * (mj + 1)
        cg = np.empty(total)
        cc = np.empty(total)
        cb = np.empty(total, np.int64)
        q = 0
        for s in range(lo, hi):
            for k in range(mj + 1):
                G = fg[s] + k * g[j]
                C = fc[s] + (mj - k) * c[j]
                B = fb[s] + k * b[j]
                if G > cap or C > cap or B > limit or G + C + rest[j + 1] > 2.0 * cap:
                    continue
                cg[q] = G
                cc[q] = C
                cb[q] = B
                q += 1
        by_c = np.argsort(cc[:q], kind="mergesort")
        order = by_c[np.argsort(cg[:q][by_c], kind="mergesort")]  # G ascending, then C ascending
        if hi + q > size:
            while hi + q > size:
                size *= 2
            fg2 = np.zeros(size)
            fc2 = np.zeros(size)
            fb2 = np.zeros(size, np.int64)
            fg2[:hi] = fg[:hi]
            fc2[:hi] = fc[:hi]
            fb2[:hi] = fb[:hi]
            fg, fc, fb = fg2, fc2, fb2
        minc[:] = np.inf
        w = hi
        for i in order:
            B = cb[i]
            best = np.inf
            for bb in range(B + 1):
                best = min(best, minc[bb])
            if cc[i] < best:  # no kept state with G, B no larger has C no larger
                fg[w] = cg[i]
                fc[w] = cc[i]
                fb[w] = B
                minc[B] = cc[i]
                w += 1
        off[j + 2] = w
    k_out = np.zeros(T, np.int64)
    opt = np.inf
    for s in range(off[T], off[T + 1]):
        opt = min(opt, max(fg[s], fc[s]))
    if opt == np.inf:
        return k_out, False
    bound = opt * (1.0 + tol)
    sg = 0.0
    sc = 0.0
    sb = 0
    for j in range(T - 1, -1, -1):
        lo = off[j]
        hi = off[j + 1]
        found = False
        for k in range(m[j] + 1):
            g2 = sg + k * g[j]
            c2 = sc + (m[j] - k) * c[j]
            b2 = sb + k * b[j]
            if b2 > limit:
                break
            for s in range(lo, hi):
                if fg[s] + g2 > bound:
                    break
                if fc[s] + c2 <= bound and fb[s] + b2 <= limit:
                    found = True
                    break
            if found:
                k_out[j] = k
                sg, sc, sb = g2, c2, b2
                break
        if not found:
            return k_out, False
    return k_out, True


_COMPILED: list = []


def _types_kernel():
    """:func:`_types_dp` compiled by numba (same float64 operations in the same order), else itself."""
    if not _COMPILED:
        _COMPILED.append(kernels.jit(_types_dp) or _types_dp)
    return _COMPILED[0]


def dp_assign(t_gpu: np.ndarray, t_cpu: np.ndarray, needs: np.ndarray, max_new: int | None,
              kernel=None) -> np.ndarray:
    """The exact optimum in canonical order (inputs sorted by (t_gpu, t_cpu, needs), as :func:`_solve`
    gets them) by a dynamic program over distinct expert types, pruned by DALI's greedy makespan.

    Identical experts are contiguous in canonical order; ``k`` of a type on the GPU are its first ``k``.
    Among the assignments within ``TIE_TOL`` (relative) of the optimum it returns the first in mask order
    (bit ``i`` = expert ``i``): the one :func:`_enumerate` returns. ``kernel``: the DP to run (default
    the compiled one; tests pass :func:`_types_dp` itself)."""
    n = len(t_gpu)
    key_change = np.flatnonzero((t_gpu[1:] != t_gpu[:-1]) | (t_cpu[1:] != t_cpu[:-1]) | (needs[1:] != needs[:-1])) + 1
    first = np.concatenate(([0], key_change))
    m = np.diff(np.append(first, n)).astype(np.int64)
    g, c = t_gpu[first], t_cpu[first]
    limited = max_new is not None and int(needs.sum()) > max_new
    b = needs[first].astype(np.int64) if limited else np.zeros(len(first), np.int64)
    limit = int(max_new) if limited else 0
    # an upper bound on the optimum: the better of DALI's greedy (with the memory rule) and all-CPU
    greedy = greedy_assign(t_gpu, t_cpu, needs_buffer=needs, max_new=max_new if limited else None)
    ub = min(makespan(greedy, t_gpu, t_cpu), float(t_cpu.sum()))
    k, ok = (kernel or _types_kernel())(g, c, b, m, limit, ub * (1.0 + 4 * TIE_TOL), TIE_TOL)
    if not ok:
        raise AssertionError(f"type DP found no assignment within the greedy makespan {ub!r} ({n} experts)")
    pos = np.arange(n) - np.repeat(first, m)  # position within its type
    return pos < np.repeat(k, m)


def _solve(t_gpu: np.ndarray, t_cpu: np.ndarray, needs: np.ndarray, max_new: int | None,
           time_limit: float, solver: str = "dp") -> np.ndarray:
    n = len(t_gpu)
    if n <= ENUMERATE_MAX:
        return _enumerate(t_gpu, t_cpu, needs, max_new)
    if solver == "dp":
        return dp_assign(t_gpu, t_cpu, needs, max_new)
    return _milp(t_gpu, t_cpu, needs, max_new, time_limit)


def _milp(t_gpu: np.ndarray, t_cpu: np.ndarray, needs: np.ndarray, max_new: int | None,
          time_limit: float) -> np.ndarray:
    """The same optimum by 0-1 programming (HiGHS): the reference the DP is tested against; among
    equally good assignments whichever HiGHS returns."""
    n = len(t_gpu)
    from scipy.optimize import Bounds, LinearConstraint, milp  # here: scipy takes long to import

    s = _scale(t_gpu, t_cpu)
    g, c = t_gpu * s, t_cpu * s
    rows = [np.append(g, -1.0), np.append(-c, -1.0)]
    upper = [0.0, -float(c.sum())]
    if max_new is not None and int(needs.sum()) > max_new:
        rows.append(np.append(needs.astype(float), 0.0))
        upper.append(float(max_new))
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    for presolve in (True, False):  # HiGHS' presolve occasionally reports a solve error: retry without
        res = milp(
            cost,
            integrality=np.append(np.ones(n), 0.0),
            bounds=Bounds(np.zeros(n + 1), np.append(np.ones(n), np.inf)),
            constraints=LinearConstraint(np.array(rows), -np.inf, np.array(upper)),
            options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "presolve": presolve},
        )
        if res.status == 0 and res.x is not None:
            break
    if res.status != 0 or res.x is None:
        raise SolverError(f"HiGHS did not solve the {n}-expert assignment to optimality (status {res.status}: "
                          f"{res.message}); raise placement.time_limit_s")
    return np.asarray(res.x[:n]) > 0.5


def optimal_assign(t_gpu, t_cpu, *, needs_buffer=None, max_new: int | None = None, time_limit: float = 10.0,
                   solver: str = "dp") -> np.ndarray:
    """Exact minimiser of ``max(sum t_gpu[x], sum t_cpu[~x])`` over bool masks ``x`` (True = GPU),
    with at most ``max_new`` experts of ``needs_buffer`` on the GPU when ``max_new`` is given.

    ``solver``: ``dp`` or ``milp`` for more than :data:`ENUMERATE_MAX` experts (:class:`OptimalConfig`).
    Raises :class:`SolverError` if HiGHS stops before proving optimality (``time_limit`` seconds)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    t_gpu, t_cpu, needs = _check_inputs(t_gpu, t_cpu, needs_buffer, max_new)
    n = len(t_gpu)
    if n == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((np.arange(n), needs, t_cpu, t_gpu))  # canonical order, stable for equal experts
    out = np.zeros(n, dtype=bool)
    out[order] = _solve(t_gpu[order], t_cpu[order], needs[order], max_new, time_limit, solver)
    return out


@dataclass(frozen=True)
class OptimalConfig(DaliGreedyConfig):
    solver: str = field(default="dp", metadata={
        "help": "layers of more than 12 experts: dp (the exact dynamic program over expert types; ties: the first "
                "assignment in mask order, as the enumeration of smaller layers) or milp (HiGHS, the reference: "
                "the same optimum, ties as HiGHS returns them)"})
    time_limit_s: float = field(default=10.0, metadata={
        "help": "solver = milp: HiGHS time limit per layer in seconds; a layer not solved to optimality in time is "
                "an error"})

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise ValueError(f"placement.solver must be one of {', '.join(SOLVERS)}, got {self.solver!r}")
        if not self.time_limit_s > 0:
            raise ValueError(f"placement.time_limit_s must be > 0, got {self.time_limit_s}")


@dataclass(frozen=True)
class OptimalMemConfig(OptimalConfig, MemoryRuleConfig):
    def __post_init__(self) -> None:
        OptimalConfig.__post_init__(self)
        MemoryRuleConfig.__post_init__(self)


@registered(PLACEMENTS)
class Optimal(PlacementPolicy[OptimalConfig]):
    name = "optimal"
    description = ("BOUND: exact 0-1 optimum (HiGHS) of DALI's per-layer objective min max(T_cpu, T_gpu); "
                   "ignores GPU memory")
    Config = OptimalConfig
    is_bound = True
    bound_of = "DALI's per-layer objective max(T_cpu, T_gpu) for the layer's cache contents (not the time)"

    def __init__(self, config=None):
        super().__init__(config)
        self._memo: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def _limit(self, view: LayerView) -> int | None:
        return None

    def place(self, view: LayerView) -> np.ndarray:
        t_gpu, t_cpu, needs = expert_times(view, overlap=self.config.overlap,
                                           pending_resident=self.config.pending_resident)
        max_new = self._limit(view)
        n = len(t_gpu)
        if n == 0:
            return np.zeros(0, dtype=bool)
        order = np.lexsort((np.arange(n), needs, t_cpu, t_gpu))
        g, c, b = t_gpu[order], t_cpu[order], needs[order]
        if max_new is not None and max_new >= int(b.sum()):
            max_new = None  # the memory row cannot bind
        key = (g.tobytes(), c.tobytes(), b.tobytes(), max_new)
        sol = self._memo.get(key)
        if sol is None:
            sol = _solve(g, c, b, max_new, self.config.time_limit_s, self.config.solver)
            self._memo[key] = sol
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        out = np.zeros(n, dtype=bool)
        out[order] = sol
        return out


@registered(PLACEMENTS)
class OptimalMem(_MemoryLimited, Optimal):
    name = "optimal-mem"
    description = ("BOUND: exact 0-1 optimum (HiGHS) of DALI's per-layer objective with the GPU memory "
                   "constraint of dali-greedy-mem (at most M non-resident, non-prefetched experts on the GPU)")
    Config = OptimalMemConfig

    def _limit(self, view: LayerView) -> int | None:
        return self.limit(view)


__all__ = ["SOLVERS", "Optimal", "OptimalConfig", "OptimalMem", "OptimalMemConfig", "SolverError", "dp_assign",
           "optimal_assign"]
