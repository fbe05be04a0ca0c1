"""The engine's direct lane rules (a layer nothing can interfere with) as compiled loops.

The Python loops of :meth:`SimEngine._cpu_lane_end <dali_sim.sim.engine.SimEngine._cpu_lane_end>` and
:meth:`SimEngine._gpu_lane_end <dali_sim.sim.engine.SimEngine._gpu_lane_end>` are the reference: they
also record a timeline. These loops compute the same lane ends, busy seconds, waits and event counts
without one, in float64 operations in the same order (no fast-math), so results are identical bit for
bit (tests/test_sim_lanes.py runs both). They are compiled by numba on first use (cached on disk, see
:mod:`dali_sim.policies.kernels`); without numba the engine runs the reference methods.

``busy`` is the engine's per-track busy seconds, indexed as :data:`dali_sim.sim.engine.TRACKS`
(``gpu``, ``cpu``, ``pcie``, ``host``), updated in place, as is ``layer_wait``.
"""

from __future__ import annotations

import numpy as np

from dali_sim.policies import kernels

GPU, CPU, PCIE = 0, 1, 2  # indices into busy (TRACKS order)


def cpu_lane(t, times, busy):
    """The CPU lane's experts back to back from ``t`` (seconds each in ``times``); returns the end."""
    for i in range(times.shape[0]):
        d = times[i]
        busy[CPU] += (t + d) - t
        t += d
    return t


def gpu_lane(link_t, t, times, fetched, staged, free, xfer, per_group, writeback, n_evicted, waits_all, busy,
             layer_wait, layer):
    """The GPU lane of one layer (the rules of ``SimEngine._gpu_lane_end``), experts by touch position:
    ``times`` their GPU seconds, ``fetched`` whether each needs an on-demand copy, ``staged`` whether that
    copy takes a staging buffer (``free`` of them are free). Returns ``(end, events, ok)``; ``ok`` is False
    if an expert could never arrive (an engine bug, reported by the caller)."""
    events = 0
    if writeback:
        for _ in range(n_evicted):
            busy[PCIE] += (link_t + xfer) - link_t
            events += 1
            link_t += xfer
        if waits_all:
            t = max(t, link_t)
    n = times.shape[0]
    present = np.zeros(n, np.bool_)
    n_present = 0
    n_fetch = 0
    for i in range(n):
        if fetched[i]:
            n_fetch += 1
        else:
            present[i] = True
            n_present += 1
    order = np.empty(n_fetch, np.int64)  # the copies, in touch order
    k = 0
    for i in range(n):
        if fetched[i]:
            order[k] = i
            k += 1
    landed_t = np.empty(n_fetch)
    landed_p = np.empty(n_fetch, np.int64)
    releases = np.empty(n)
    r_head = 0
    r_tail = 0
    n_landed = 0
    ci = 0
    li = 0
    left = n
    group_left = 0
    while left:
        while ci < n_fetch:  # start every copy whose start time is known
            p = order[ci]
            start = link_t
            if staged[p]:
                if free == 0:
                    if r_head == r_tail:
                        break
                    start = max(start, releases[r_head])
                    r_head += 1
                    free += 1
                free -= 1
            busy[PCIE] += (start + xfer) - start
            events += 1
            link_t = start + xfer
            landed_t[n_landed] = link_t
            landed_p[n_landed] = p
            n_landed += 1
            ci += 1
        if waits_all and ci == n_fetch and n_landed > 0:
            t = max(t, landed_t[n_landed - 1])  # a grouped launch needs every expert's weights
        while li < n_landed and landed_t[li] <= t:
            present[landed_p[li]] = True
            n_present += 1
            li += 1
        if n_present == 0:
            if li == n_landed:
                return t, events, False
            layer_wait[layer] += landed_t[li] - t
            t = landed_t[li]
            continue
        if per_group != 0.0 and group_left == 0:  # a call on every expert present now
            group_left = n_present
            busy[GPU] += (t + per_group) - t
            events += 1
            t += per_group
            while li < n_landed and landed_t[li] <= t:  # what lands during the call's fixed part waits
                present[landed_p[li]] = True
                n_present += 1
                li += 1
        group_left -= 1
        p = 0
        while not present[p]:  # the first present expert in touch order
            p += 1
        present[p] = False
        n_present -= 1
        left -= 1
        d = times[p]
        busy[GPU] += (t + d) - t
        events += 1
        t += d
        if staged[p]:
            releases[r_tail] = t
            r_tail += 1
    return t, events, True


_COMPILED: dict = {}


def compiled():
    """``(cpu_lane, gpu_lane)`` compiled by numba, or None without numba (``DALI_NUMBA=0``)."""
    if "lanes" not in _COMPILED:
        cpu, gpu = kernels.jit(cpu_lane), kernels.jit(gpu_lane)
        _COMPILED["lanes"] = None if cpu is None or gpu is None else (cpu, gpu)
    return _COMPILED["lanes"]


__all__ = ["compiled", "cpu_lane", "gpu_lane"]
