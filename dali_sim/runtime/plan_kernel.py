"""The controller's per-layer bookkeeping as one compiled loop (numba): the fast path of ``Controller.plan``.

After the placement has decided, a plan needs a dozen small steps: the experts' hits and sources, the
batched admission into the layer's cache (free slots, then victims in the cache policy's order), the
cache's use stamps, the staged experts, the prefetches used or wasted, and the counters of the plan.
As NumPy calls each costs a microsecond or more of call overhead, several times that when the caches
are cold after a layer's tensor work in the executor; :func:`_layer_plan` does all of it in one call.

It applies to a cache policy with a *keyed form* (``CachePolicy.keyed_form``: its victims are the
evictable entries by ascending ``(primary, stamp, id)``, touches renew a use stamp or nothing, evictions
need no notice): lru, lfu, static, dali-window and hybrimoe-mrs. The controller's NumPy path
(``Controller.plan_reference``) stays the reference, and the path of every other cache or when numba is
off (``DALI_NUMBA=0``); both give the same plans (tests/test_plan_fast.py).

Where the policies describe their decisions as data (``PlacementPolicy.rule_form``, ``greedy_form``,
``hss_form``; ``CachePolicy.window_form``, ``mrs_form``; ``PrefetchPolicy.top_k_form``, ``impact_form``), a
whole plan is one call without a ``LayerView``: :func:`_ruled_plan` (the simple systems), :func:`_greedy_plan`
(``dali``) and :func:`_impact_plan` (HybriMoE). Their ``step`` only places the lookahead columns' segments
(segment ``step * L + layer``): a trace workload's step, or 0 for an online workload, whose columns hold the
current step only (``OnlineWorkload.step_predicted``).
"""

from __future__ import annotations

import numpy as np

from dali_sim.policies import cache_dali, kernels, placement_dali

# sources, as dali_sim.runtime.controller (repeated: that module imports this one)
_HIT, _PREFETCHED, _FETCH, _CPU = 0, 1, 2, 3
#: positions in the tally (``PlanCounters``' row) that the controller reads, or fills after the kernel
TALLY_PREFETCHES, TALLY_SWAPS = 7, 12
TALLY_PREFETCH_USED, TALLY_WASTED, TALLY_EVICTED, TALLY_STAGED = 6, 8, 10, 11
TALLY_LEN = 15  # the tally's length (the layer and the 14 COUNTERS)
TALLY_FIRST_FETCH = TALLY_LEN  # where the kernel's answer gives the first expert fetched on demand


def _victims(resident, activated, primary, stamp, want, out):
    """Up to ``want`` victims into ``out``: the evictable entries (resident, not activated) by ascending
    (``primary``, ``stamp``, id), as ``np.lexsort``; returns how many. The evictable entries are listed first;
    a few victims (or few entries) by selection among them, more by two stable sorts (the cost of selection
    grows with the victims). A full cache whose layer touches most of it has few evictable entries, however
    many misses want victims."""
    E = resident.shape[0]
    cand = np.empty(E, np.int64)
    m = 0
    for x in range(E):  # (ascending ids; written over unless evictable)
        cand[m] = x
        m += resident[x] and not activated[x]
    n = min(want, m)
    if n <= 4:
        for j in range(n):  # the smallest key left moved to j (keys are distinct: the id breaks ties)
            best = j
            for y in range(j + 1, m):
                c = cand[y]
                b = cand[best]
                if primary[c] < primary[b] or (primary[c] == primary[b] and (
                        stamp[c] < stamp[b] or (stamp[c] == stamp[b] and c < b))):
                    best = y
            c = cand[best]
            cand[best] = cand[j]
            cand[j] = c
            out[j] = c
        return n
    cand = cand[:m]
    cand = cand[np.argsort(stamp[cand], kind="mergesort")]  # stable: by stamp, then id
    cand = cand[np.argsort(primary[cand], kind="mergesort")]  # then by primary
    out[:n] = cand[:n]
    return n


def _layer_plan(experts, counts, on_gpu, resident, pending, layer, capacity, n_resident, n_pending,
                accepts, evicts, primary, stamp, clock, stamps):
    """One (step, layer) after its placement ``on_gpu``: :func:`_plan_into` with the flags it writes."""
    flags = np.zeros((3, experts.shape[0]), np.bool_)  # hit, admitted, staged (each array returned costs a boxing)
    source, out = _plan_into_fn(flags, experts, counts, on_gpu, resident, pending, layer, capacity, n_resident,
                                n_pending, accepts, evicts, primary, stamp, clock, stamps)
    return source, flags, out


def _plan_into(flags, experts, counts, on_gpu, resident, pending, layer, capacity, n_resident, n_pending,
               accepts, evicts, primary, stamp, clock, stamps):
    """One (step, layer) after its placement, as ``Controller.plan_reference`` computes it.

    ``resident``/``pending`` are the layer's (E,) rows and ``n_resident``/``n_pending`` the (L,) counts,
    all updated in place; ``accepts``: a free slot takes a fetched expert; ``evicts``: a full cache
    evicts (else a fetched expert is staged); victims by ascending (``primary``, ``stamp``, id) among the
    resident experts not activated; ``stamps``: hits and admissions get use stamps ``clock[0] + 1, ...``
    in touch order (``clock`` advanced). Returns (source, (3, n) bool: hit, admitted and staged, one
    int64 array: the tally (the plan's ``PlanCounters`` row, ``TALLY_LEN`` values, with the prefetch and
    swap counts still 0), the index of the first expert fetched on demand or -1, then the victims, the
    prefetches used and those wasted (their lengths: the tally's ``evicted``, ``prefetch_used`` and
    ``prefetch_wasted``))."""
    n = experts.shape[0]
    E = resident.shape[0]
    source = np.empty(n, np.int8)
    hit = flags[0]
    admitted = flags[1]
    staged = flags[2]
    activated = np.zeros(E, np.bool_)
    from_prefetch = np.zeros(E, np.bool_)
    had_pending = n_pending[layer] > 0
    n_hit = 0
    n_cpu = 0
    n_fetch = 0
    n_pref = 0
    n_miss = 0
    cpu_tokens = 0
    gpu_tokens = 0
    first_fetch = -1
    for i in range(n):
        e = experts[i]
        activated[e] = True
        h = resident[e]
        hit[i] = h
        if h:
            n_hit += 1
        if not on_gpu[i]:
            source[i] = _CPU
            n_cpu += 1
            cpu_tokens += counts[i]
            continue
        gpu_tokens += counts[i]
        if h:
            source[i] = _HIT
            continue
        n_miss += 1  # on the GPU, not resident: prefetched or fetched on demand
        if had_pending and pending[e]:
            source[i] = _PREFETCHED
            from_prefetch[e] = True
            n_pref += 1
        else:
            source[i] = _FETCH
            n_fetch += 1
            if first_fetch < 0:
                first_fetch = i
    # admission: the misses (touch order) fill free slots if the cache accepts, then take victims
    take = 0
    n_vict = 0
    victims = np.empty(min(n_miss, E), np.int64)
    if n_miss:
        free = capacity - n_resident[layer]
        if not (free > 0 and not accepts):
            take = min(max(free, 0), n_miss)
            if evicts and n_miss > take:
                n_vict = _victims_fn(resident, activated, primary, stamp, n_miss - take, victims)
        left = take + n_vict
        for i in range(n):
            if left == 0:
                break
            if on_gpu[i] and not hit[i]:
                admitted[i] = True
                left -= 1
        for j in range(n_vict):
            resident[victims[j]] = False
        for i in range(n):
            if admitted[i]:
                resident[experts[i]] = True
        n_resident[layer] += take
    n_admitted = take + n_vict
    if stamps:
        c = clock[0]
        for i in range(n):
            if hit[i] or admitted[i]:
                c += 1
                stamp[experts[i]] = c
        clock[0] = c
    n_staged = 0
    for i in range(n):
        if source[i] == _FETCH and not admitted[i]:
            staged[i] = True
            n_staged += 1
    n_used = 0
    n_was = 0
    if had_pending:
        for x in range(E):
            if pending[x]:
                n_was += 1
                if from_prefetch[x]:
                    n_used += 1
    # the tally, the first expert fetched on demand, then the lists: victims (eviction order), the
    # prefetches used and wasted (ascending ids); one array (each array returned costs a boxing)
    out = np.zeros(TALLY_LEN + 1 + n_vict + n_was, np.int64)
    start = TALLY_LEN + 1
    out[start:start + n_vict] = victims[:n_vict]
    if had_pending:
        u = start + n_vict
        w = u + n_used
        for x in range(E):
            if pending[x]:
                if from_prefetch[x]:
                    out[u] = x
                    u += 1
                else:
                    out[w] = x
                    w += 1
                pending[x] = False
        n_pending[layer] = 0
    out[0] = layer  # the tally: PlanCounters' row (COUNTERS' order after the layer)
    out[1] = n
    out[2] = n_hit
    out[3] = n - n_cpu
    out[4] = n_cpu
    out[5] = n_fetch
    out[TALLY_PREFETCH_USED] = n_used  # (= the experts from a prefetch: each was pending)
    out[TALLY_WASTED] = n_was - n_used
    out[9] = n_admitted if n_fetch or n_pref else 0
    out[TALLY_EVICTED] = n_vict
    out[TALLY_STAGED] = n_staged if n_fetch else 0
    out[13] = gpu_tokens
    out[14] = cpu_tokens
    out[TALLY_FIRST_FETCH] = first_fetch
    return source, out


def _ruled_plan(experts, counts, tokens, contents, totals, params, primary, stamp, clock, by_count):
    """A whole plan of (step, layer) but its prefetches and swaps, at a step of ``tokens`` tokens: the
    placement's rule form (``PlacementPolicy.rule_form``), then :func:`_plan_into`. ``contents`` (2, L, E)
    bool: every layer's cache contents and prefetched experts; ``totals`` (2, L): their counts; ``params``
    the layer's (int64): the layer, its capacity, the keyed form's ``accepts``,
    ``evicts`` and whether touches set stamps, the rule's ``resident``, ``pending``, ``gpu_layer[l]`` and
    ``min_tokens[l]``; ``by_count`` the rule's. Returns (source, (4, n) bool: hit, admitted, staged and on
    the GPU, the int64 answer of :func:`_plan_into`), or an empty answer with nothing changed when the rule
    leaves an expert undecided (a workload beyond ``by_count`` whose last entry is -1: the placement's own
    ``place`` decides)."""
    layer = params[0]
    resident = contents[0, layer]
    pending = contents[1, layer]
    n = experts.shape[0]
    flags = np.zeros((4, n), np.bool_)
    on_gpu = flags[3]
    if params[7] or tokens >= params[8]:
        on_gpu[:] = True
    else:
        on_resident = params[5] != 0
        on_pending = params[6] != 0
        top = by_count.shape[0] - 1
        for i in range(n):
            e = experts[i]
            if (on_resident and resident[e]) or (on_pending and pending[e]):
                on_gpu[i] = True
                continue
            c = counts[i]
            v = by_count[c] if 0 <= c < top else (by_count[top] if c >= top else -1)
            if v < 0:
                return np.empty(0, np.int8), flags, np.empty(0, np.int64)  # undecided: nothing changed
            on_gpu[i] = v > 0
    source, out = _plan_into_fn(flags, experts, counts, on_gpu, resident, pending, layer, params[1], totals[0],
                                totals[1], params[2] != 0, params[3] != 0, primary, stamp, clock, params[4] != 0)
    return source, flags, out


def _greedy_plan(experts, counts, step, contents, totals, params, primary, stamp, clock, times, xfer, window,
                 pred_ptr, pred_experts, pred_counts, pred_ranks):
    """A whole plan of (``step``, layer) for DALI's greedy placement (``PlacementPolicy.greedy_form``): the
    cache's windowed sums (``CachePolicy.window_form``), the placement (``placement_dali._greedy_place``),
    :func:`_plan_into`, the next layer's top-k prefetch (``PrefetchPolicy.top_k_form``, from the lookahead
    column's sparse segments ``pred_*``) issued by :func:`_issue`, and the window's swaps, in the order
    ``Controller.plan_reference`` runs them. ``contents``, ``totals``, ``primary``, ``stamp`` and ``clock`` as
    :func:`_ruled_plan`; ``times`` (2, C) float64: the GPU and CPU times by workload, ``xfer`` one copy;
    ``window`` the cache's (L, E + 1) state; ``params`` the layer's (int64): the layer, its capacity, the keyed
    form's ``accepts``, ``evicts`` and whether touches set stamps, the greedy's ``overlap`` and
    ``pending_resident``, the window's ``w`` (0: none) and ``u``, whether to prefetch (a later layer), the top-k's
    ``k``, the prefetch buffers. Returns (source, (4, n) bool: hit, admitted, staged and on the GPU, the int64
    answer of :func:`_plan_into` with ``TALLY_PREFETCHES`` and ``TALLY_SWAPS`` filled and, after its lists,
    the issued prefetches and the swaps, flat pairs; ``TALLY_PREFETCHES`` -1 and the pair: an invalid request),
    or an empty answer with nothing changed when a workload lies beyond the tables (``place`` decides)."""
    layer = params[0]
    n = experts.shape[0]
    flags = np.zeros((4, n), np.bool_)
    top = times.shape[1]
    for i in range(n):
        if counts[i] < 0 or counts[i] >= top:
            return np.empty(0, np.int8), flags, np.empty(0, np.int64)  # beyond the tables: nothing changed
    resident = contents[0, layer]
    pending = contents[1, layer]
    w = params[7]
    if w > 0:
        _observe_fn(window, layer, experts, counts)
    on_gpu = flags[3]
    on_gpu[:] = _greedy_place_fn(experts, counts, resident, pending, times[0], times[1], xfer, params[5] != 0,
                                 params[6] != 0)
    source, head = _plan_into_fn(flags, experts, counts, on_gpu, resident, pending, layer, params[1], totals[0],
                                 totals[1], params[2] != 0, params[3] != 0, primary, stamp, clock, params[4] != 0)
    issued = np.empty(0, np.int64)
    bad = -1
    asked = np.empty((0, 2), np.int64)
    if params[9]:
        free = params[11] - totals[1].sum()
        if free > 0:
            target = layer + 1
            i = step * contents.shape[1] + target
            lo = pred_ptr[i]
            hi = pred_ptr[i + 1]
            e = pred_experts[lo:hi]
            asked = _as_pairs_fn(e[_ranked_fn(e, pred_counts[lo:hi], pred_ranks[lo:hi], params[10])], target)
            issued, bad = _issue_fn(asked, contents[0], contents[1], totals[1], layer, free)
    swaps = np.empty(0, np.int64)
    if w > 0 and bad < 0 and window[layer, window.shape[1] - 1] >= w:
        E = window.shape[1] - 1
        swaps = _window_swaps_fn(window[layer, :E], resident, params[8])
        for j in range(swaps.shape[0] // 2):
            resident[swaps[2 * j + 1]] = False
            resident[swaps[2 * j]] = True
        window[layer, :] = 0
    return source, flags, _tail_fn(head, issued, bad, asked, swaps)


def _tail(head, issued, bad, asked, swaps):
    """:func:`_plan_into`'s answer ``head`` with the issued prefetches and the swaps after its lists (their
    counts in the tally), or the invalid request ``asked[bad]`` (``TALLY_PREFETCHES`` -1)."""
    m = head.shape[0]
    out = np.empty(m + issued.shape[0] + swaps.shape[0] + (2 if bad >= 0 else 0), np.int64)
    out[:m] = head
    out[m:m + issued.shape[0]] = issued
    out[m + issued.shape[0]:m + issued.shape[0] + swaps.shape[0]] = swaps
    out[TALLY_PREFETCHES] = issued.shape[0] // 2
    out[TALLY_SWAPS] = swaps.shape[0] // 2
    if bad >= 0:
        out[TALLY_PREFETCHES] = -1
        out[m] = asked[bad, 0]
        out[m + 1] = asked[bad, 1]
    return out


def _beyond(ptr, counts, i, top):
    """Whether a count of segment ``i`` is not below ``top``."""
    for x in range(ptr[i], ptr[i + 1]):
        if not counts[x] < top:
            return True
    return False


def _dense(preds, dists, j, d, ptr, experts, counts, i):
    """Row ``j`` of ``preds``: segment ``i`` as (E,) float64 counts, its distance ``d``; returns ``j + 1``."""
    for x in range(ptr[i], ptr[i + 1]):
        preds[j, experts[x]] = counts[x]
    dists[j] = d
    return j + 1


def _impact_plan(experts, counts, step, phase, tokens, contents, totals, params, fparams, times, score, stamp, clock,
                 seen, ptr1, experts1, counts1, ptr2, experts2, counts2, ptr3, experts3, counts3):
    """A whole plan of (``step``, layer) for HybriMoE (``PlacementPolicy.hss_form``, ``CachePolicy.mrs_form``,
    ``PrefetchPolicy.impact_form``): the MRS update (``kernels._mrs_update``), the placement (every expert on
    the GPU at a step of more tokens with ``single_token``, else the HSS schedule, ``kernels._hss``),
    :func:`_plan_into` keyed by the scores, then the impact-driven requests (``kernels._impact_requests``) from
    up to three lookahead columns' sparse segments (``ptr*``, ``experts*``, ``counts*``) issued by
    :func:`_issue`, in the order ``Controller.plan_reference`` runs them. ``contents``, ``totals`` as
    :func:`_ruled_plan`; ``times`` as :func:`_greedy_plan`; ``fparams``: ``a``, the prefetch threshold, one
    copy's seconds; ``params`` the layer's (int64): the layer, its capacity, whether a full cache evicts in
    decode and in prefill, the prefill phase's code, ``pending_resident``, ``single_token``, whether to
    prefetch (at the last layer too: the prefetcher notes the contents it saw), ``k``, the prefetch buffers,
    the three columns' distances (0: unused or beyond the last layer). Returns as
    :func:`_greedy_plan` (no swaps), or an empty answer with nothing changed when a workload or a prediction
    lies beyond the tables (the policies decide with a view)."""
    layer = params[0]
    n = experts.shape[0]
    E = contents.shape[2]
    L = contents.shape[1]
    flags = np.zeros((4, n), np.bool_)
    top = times.shape[1]
    hss = not (params[6] != 0 and tokens > 1)
    if hss:
        for i in range(n):
            if counts[i] < 0 or counts[i] >= top:
                return np.empty(0, np.int8), flags, np.empty(0, np.int64)  # beyond the tables: nothing changed
    if params[7]:
        base = step * L + layer
        d1, d2, d3 = params[10], params[11], params[12]
        if (d1 and _beyond_fn(ptr1, counts1, base + d1, top)) or (d2 and _beyond_fn(ptr2, counts2, base + d2, top)) or \
                (d3 and _beyond_fn(ptr3, counts3, base + d3, top)):
            return np.empty(0, np.int8), flags, np.empty(0, np.int64)
    resident = contents[0, layer]
    pending = contents[1, layer]
    at_start = resident.copy()
    row = score[layer]
    _mrs_update_fn(row, experts, counts, tokens, fparams[0])
    on_gpu = flags[3]
    xfer = fparams[2]
    if not hss:
        on_gpu[:] = True
    else:
        cached = np.empty(n, np.bool_)
        t_gpu = np.empty(n)
        t_cpu = np.empty(n)
        neg = np.empty(n, np.int64)
        for i in range(n):
            e = experts[i]
            cached[i] = resident[e] or (params[5] != 0 and pending[e])
            t_gpu[i] = times[0, counts[i]]
            t_cpu[i] = times[1, counts[i]]
            neg[i] = -np.int64(counts[i])
        by_load = np.argsort(neg, kind="mergesort")  # descending load, ties: index (as the lexsort)
        order = np.empty(n, np.int64)
        k = 0
        for i in by_load:
            if cached[i]:
                order[k] = i
                k += 1
        for i in by_load:
            if not cached[i]:
                order[k] = i
                k += 1
        on_gpu[:] = _hss_fn(order, cached, t_gpu, t_cpu, xfer)[0]
    evicts = params[2] if phase != params[4] else params[3]
    source, head = _plan_into_fn(flags, experts, counts, on_gpu, resident, pending, layer, params[1], totals[0],
                                 totals[1], True, evicts != 0, row, stamp[layer], clock, True)
    issued = np.empty(0, np.int64)
    bad = -1
    asked = np.empty((0, 2), np.int64)
    if params[7]:
        free = params[9] - totals[1].sum()
        if free > 0:
            seen[layer, :] = at_start
            m = int(d1 > 0) + int(d2 > 0) + int(d3 > 0)
            preds = np.zeros((m, E))  # each column's prediction of its layer, dense (as predicted_counts)
            dists = np.empty(m, np.int64)
            j = 0
            if d1:
                j = _dense_fn(preds, dists, j, d1, ptr1, experts1, counts1, base + d1)
            if d2:
                j = _dense_fn(preds, dists, j, d2, ptr2, experts2, counts2, base + d2)
            if d3:
                j = _dense_fn(preds, dists, j, d3, ptr3, experts3, counts3, base + d3)
            if m:
                _, asked = _impact_requests_fn(preds, dists, seen, layer, times[0], times[1], xfer, fparams[1],
                                               params[8])
                issued, bad = _issue_fn(asked, contents[0], contents[1], totals[1], layer, free)
    return source, flags, _tail_fn(head, issued, bad, asked, np.empty(0, np.int64))


def _issue(asked, resident, pending, n_pending, layer, free):
    """``Controller._issue_prefetches`` after the policy's answer ``asked`` ((m, 2) int64: target layer,
    expert), in one call: in order, skipping resident, pending and repeated requests, while fewer than
    ``free`` were issued (each marked pending at once, so a repeat is skipped as pending). Returns the
    issued pairs flat and -1, or nothing and the index of the first invalid request reached before the
    buffers ran out (the contents then as they were)."""
    L = resident.shape[0]
    E = resident.shape[1]
    out = np.empty(2 * min(free, asked.shape[0]), np.int64)
    m = 0
    for i in range(asked.shape[0]):
        if m == free:
            break  # the buffers ran out: later requests change nothing (nor are they checked)
        t = asked[i, 0]
        x = asked[i, 1]
        if not (layer < t < L and 0 <= x < E):
            for j in range(m):  # an error: the contents stay as they were
                pending[out[2 * j], out[2 * j + 1]] = False
                n_pending[out[2 * j]] -= 1
            return out[:0], i
        if not resident[t, x] and not pending[t, x]:
            pending[t, x] = True
            n_pending[t] += 1
            out[2 * m] = t
            out[2 * m + 1] = x
            m += 1
    return out[:2 * m], -1


_victims_fn = _victims  # what _plan_into calls: the compiled _victims
_plan_into_fn = _plan_into  # what _layer_plan and _ruled_plan call: the compiled _plan_into
# what _greedy_plan calls: the compiled policy kernels and _issue
_issue_fn = _issue
_greedy_place_fn = placement_dali._greedy_place
_observe_fn = cache_dali._observe
_window_swaps_fn = cache_dali._window_swaps
_ranked_fn = kernels._ranked
_as_pairs_fn = kernels._as_pairs
_tail_fn = _tail
_beyond_fn = _beyond
_dense_fn = _dense
_mrs_update_fn = kernels._mrs_update
_hss_fn = kernels._hss
_impact_requests_fn = kernels._impact_requests
_COMPILED: list = []
_COMPILED_ISSUE: list = []
_COMPILED_RULED: list = []
_COMPILED_GREEDY: list = []
_COMPILED_IMPACT: list = []


def compiled_issue():
    """:func:`_issue` compiled (on the first call), or None without numba."""
    if not _COMPILED_ISSUE:
        _COMPILED_ISSUE.append(kernels.jit(_issue))
    return _COMPILED_ISSUE[0]


def compiled():
    """:func:`_layer_plan` compiled (on the first call), or None without numba (the controller then takes
    its NumPy path)."""
    if not _COMPILED:
        global _victims_fn, _plan_into_fn
        _victims_fn = kernels.jit(_victims)
        _plan_into_fn = kernels.jit(_plan_into) if _victims_fn is not None else None
        _COMPILED.append(kernels.jit(_layer_plan) if _victims_fn is not None else None)
    return _COMPILED[0]


def compiled_ruled():
    """:func:`_ruled_plan` compiled (on the first call), or None without numba (or when :func:`compiled` is
    off: the controller then plans with a view)."""
    if not _COMPILED_RULED:
        _COMPILED_RULED.append(kernels.jit(_ruled_plan) if compiled() is not None else None)
    return _COMPILED_RULED[0]


def compiled_greedy():
    """:func:`_greedy_plan` compiled (on the first call), or None without numba (or while :func:`compiled` or a
    policy kernel it calls is off: the controller then plans with a view)."""
    if not _COMPILED_GREEDY:
        global _issue_fn, _greedy_place_fn, _observe_fn, _window_swaps_fn, _ranked_fn, _as_pairs_fn, _tail_fn
        parts = (compiled_issue(), placement_dali._compiled_place(), cache_dali._compiled_observe(),
                 cache_dali._compiled_swaps(), kernels.fused("top_pairs_sparse"))
        if compiled() is None or any(f is None for f in parts):
            return None  # (not kept: a getter switched off for a while, as the tests do, is not the last word)
        _issue_fn, _greedy_place_fn, _observe_fn, _window_swaps_fn, _ = parts
        _tail_fn = kernels.jit(_tail)
        _ranked_fn, _as_pairs_fn = kernels._ranked_fn, kernels._as_pairs_fn  # (compiled by kernels.fused)
        _COMPILED_GREEDY.append(kernels.jit(_greedy_plan))
    return _COMPILED_GREEDY[0]


def compiled_impact():
    """:func:`_impact_plan` compiled (on the first call), or None as :func:`compiled_greedy`."""
    if not _COMPILED_IMPACT:
        global _mrs_update_fn, _hss_fn, _impact_requests_fn, _beyond_fn, _dense_fn
        parts = (compiled_greedy(), kernels.fused("mrs_update"), kernels.fused("impact_requests"))
        if any(f is None for f in parts):
            return None  # (not kept, as compiled_greedy)
        _mrs_update_fn, _impact_requests_fn, _hss_fn = parts[1], parts[2], kernels._hss_fn
        _beyond_fn, _dense_fn = kernels.jit(_beyond), kernels.jit(_dense)
        _COMPILED_IMPACT.append(kernels.jit(_impact_plan))
    return _COMPILED_IMPACT[0]


__all__ = ["TALLY_EVICTED", "TALLY_FIRST_FETCH", "TALLY_LEN", "TALLY_PREFETCHES", "TALLY_PREFETCH_USED", "TALLY_STAGED",
           "TALLY_SWAPS", "TALLY_WASTED", "compiled", "compiled_greedy", "compiled_impact", "compiled_issue",
           "compiled_ruled"]
