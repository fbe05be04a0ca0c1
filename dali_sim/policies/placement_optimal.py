"""BOUND: the exact per-layer optimum of DALI's assignment objective, by 0-1 programming (HiGHS).

Per (step, MoE layer), with the cost model of :mod:`dali_sim.policies.placement_dali`::

    minimise   T
    subject to sum_e t_gpu(e) x_e            <= T        (GPU lane)
               sum_e t_cpu(e) (1 - x_e)      <= T        (CPU lane)
               sum_{e needs a buffer} x_e    <= M        (optimal-mem only: see fetch_limit)
               x_e in {0, 1} (1 = GPU),  T >= 0

solved with ``scipy.optimize.milp`` (HiGHS branch and bound, relative gap 0). This is the exact
optimum of the *model* DALI's greedy approximates, per layer: it is a bound on what any per-layer
assignment can achieve under that model, not a bound on the simulated time (which adds copies
serialised on the link, waiting and cache effects on later layers).

Exactness: times are rescaled so the optimum is about 1e6 before solving (HiGHS' absolute gap,
1e-6, is then ~1e-12 of the optimum) and the returned assignment's objective is recomputed in
seconds from the rounded 0-1 solution; it equals the true optimum up to floating-point tolerance
(~1e-9 relative). Ties between assignments of equal cost: whichever HiGHS returns, deterministic for
a given input and scipy/HiGHS version. The problem is put in a canonical order first (experts sorted
by (t_gpu, t_cpu, needs_buffer), identical experts by their input position), so equal multisets of
experts get the same solution and repeated layers are answered from a memo.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies.base import PLACEMENTS, LayerView, PlacementPolicy, registered
from dali_sim.policies.placement_dali import (
    DaliGreedyConfig,
    MemoryRuleConfig,
    _check_inputs,
    _MemoryLimited,
    expert_times,
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


def _solve(t_gpu: np.ndarray, t_cpu: np.ndarray, needs: np.ndarray, max_new: int | None,
           time_limit: float) -> np.ndarray:
    n = len(t_gpu)
    if n <= ENUMERATE_MAX:
        return _enumerate(t_gpu, t_cpu, needs, max_new)
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


def optimal_assign(t_gpu, t_cpu, *, needs_buffer=None, max_new: int | None = None, time_limit: float = 10.0
                   ) -> np.ndarray:
    """Exact minimiser of ``max(sum t_gpu[x], sum t_cpu[~x])`` over bool masks ``x`` (True = GPU),
    with at most ``max_new`` experts of ``needs_buffer`` on the GPU when ``max_new`` is given.

    Raises :class:`SolverError` if HiGHS stops before proving optimality (``time_limit`` seconds)."""
    t_gpu, t_cpu, needs = _check_inputs(t_gpu, t_cpu, needs_buffer, max_new)
    n = len(t_gpu)
    if n == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((np.arange(n), needs, t_cpu, t_gpu))  # canonical order, stable for equal experts
    out = np.zeros(n, dtype=bool)
    out[order] = _solve(t_gpu[order], t_cpu[order], needs[order], max_new, time_limit)
    return out


@dataclass(frozen=True)
class OptimalConfig(DaliGreedyConfig):
    time_limit_s: float = field(default=10.0, metadata={
        "help": "HiGHS time limit per layer in seconds; a layer not solved to optimality in time is an error"})

    def __post_init__(self) -> None:
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
            sol = _solve(g, c, b, max_new, self.config.time_limit_s)
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


__all__ = ["Optimal", "OptimalConfig", "OptimalMem", "OptimalMemConfig", "SolverError", "optimal_assign"]
