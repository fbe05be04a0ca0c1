"""Integral minimum-cost flows with HiGHS, for the exact cache optimum and the time lower bound.

A flow problem's constraint matrix (node-arc incidence) is totally unimodular and its bases have
integral duals, so with integer capacities and costs the vertex HiGHS's dual simplex ends on is an
integral, exactly optimal flow. The MILP solver (integrality enforced) is the fallback should a
solution come back fractional.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog, milp


def min_cost_flow(tail: np.ndarray, head: np.ndarray, cost: np.ndarray, upper: np.ndarray, supply: np.ndarray,
                  *, time_limit_s: float = 600.0, what: str = "flow") -> np.ndarray:
    """Integer arc flows ``x`` minimising ``cost . x`` with ``0 <= x <= upper`` and, at every node,
    outflow - inflow = ``supply`` (positive at sources, negative at sinks). Arcs run ``tail -> head``."""
    tail, head = np.asarray(tail, np.int64), np.asarray(head, np.int64)
    m, nodes = len(tail), len(supply)
    arcs = np.arange(m)
    A = sp.csr_array((np.concatenate((np.ones(m), -np.ones(m))), (np.concatenate((tail, head)),
                                                                    np.concatenate((arcs, arcs)))), shape=(nodes, m))
    cost, upper, supply = (np.asarray(v, float) for v in (cost, upper, supply))
    res = linprog(cost, A_eq=A, b_eq=supply, bounds=np.column_stack((np.zeros(m), upper)), method="highs-ds",
                  options={"time_limit": time_limit_s})
    if res.status == 0 and np.abs(res.x - np.round(res.x)).max(initial=0.0) < 1e-6:
        return np.round(res.x).astype(np.int64)
    res = milp(cost, constraints=LinearConstraint(A, supply, supply), integrality=np.ones(m),
               bounds=Bounds(0, upper), options={"time_limit": time_limit_s})
    if res.status != 0 or res.x is None:
        raise RuntimeError(f"{what}: HiGHS did not prove optimality ({res.message})")
    return np.round(res.x).astype(np.int64)


__all__ = ["min_cost_flow"]
