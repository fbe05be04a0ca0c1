"""The runtime's per-layer index building as single compiled loops (numba, :func:`dali_sim.policies.kernels.jit`).

Grouping a layer's routing by expert and building a group's indices take a dozen NumPy operations each
on arrays of a few hundred entries, where each operation costs about a microsecond of call overhead on
this scale; one compiled loop does the same in one call. :func:`group_routing` and :func:`group_index`
return exactly what the NumPy code of :mod:`.routing` and :mod:`.grouped` computes (the same values,
dtypes and orders: a stable counting sort is the stable argsort; tested in tests/test_exec_grouped.py),
which stays the path when numba is off (``DALI_NUMBA=0``) and the reference. Kernels compile on first
use (cached on disk).

The loops a layer visit runs write preallocated buffers (:mod:`.workspace`) and return counts: their
cores are the ``*_into`` kernels (``_group_routing_into``, ``_partition_into``, ``_group_index_into``,
``_evict_into``), which the allocating kernels of the same name wrap, so both compute the same thing in
one place.
"""

from __future__ import annotations

import numpy as np

from dali_sim.policies import kernels as _policy_kernels
from dali_sim.runtime.controller import CPU as _CPU, FETCH as _FETCH, HIT as _HIT, PREFETCHED as _PREFETCHED

OK, NOT_PERMUTATION, NOT_SORTED, NEGATIVE = 0, 1, 2, 3
TOO_WIDE = -2  # _admit: an expert id beyond the slot table's width


def _group_routing(flat, order_in, weights, counted, k):
    """Stable grouping of the flat (token, rank) pairs by expert id: (status, order, ptr, experts, sorted
    weights, sorted counted flags, counted pairs per expert). ``order_in``: a given permutation (checked)
    or empty; ``counted``: per token, or empty. (:func:`_group_routing_into` on new arrays.)"""
    n = flat.shape[0]
    order = np.empty(n, np.int64)
    ptr = np.empty(n + 1, np.int64)
    experts = np.empty(n, np.int64)
    w = np.empty(n, np.float32)
    c = np.empty(n if counted.shape[0] else 0, np.bool_)
    per = np.empty(n, np.int64)
    status, m = _group_routing_into_fn(flat, order_in, weights, counted, k, order, ptr, experts, w, c, per, per[:0])
    if status != OK:
        return status, order_in, order_in, order_in, weights, counted, order_in
    if order_in.shape[0]:
        order = order_in
    return OK, order, ptr[:m + 1], experts[:m], w, c if counted.shape[0] else np.zeros(0, np.bool_), per[:m]


def _group_routing_into(flat, order_in, weights, counted, k, order, ptr, experts, w, c, per, scratch):
    """:func:`_group_routing` into given arrays (``order``, ``experts``, ``w``, ``per``: at least n long,
    ``ptr`` n + 1, ``c`` n with ``counted``; a replay's layer writes a preallocated workspace instead of
    allocating seven arrays): returns (status, the number of experts m); ``ptr[:m + 1]``, ``experts[:m]``,
    ``per[:m]``, ``order[:n]``, ``w[:n]`` and ``c[:n]`` are the result. ``scratch`` (int64): the counting
    sort's, where it is longer than the largest id (else one is allocated)."""
    n = flat.shape[0]
    top = 0
    for i in range(n):
        v = flat[i]
        if v < 0:
            return NEGATIVE, 0
        if v + 1 > top:
            top = v + 1
    if order_in.shape[0] == 0:
        if scratch.shape[0] > top:
            start = scratch[:top + 1]
            for e in range(top + 1):
                start[e] = 0
        else:
            start = np.zeros(top + 1, np.int64)
        for i in range(n):
            start[flat[i] + 1] += 1
        m = 0
        for e in range(top):  # (the experts and their starts from the counts: no branch on the data)
            experts[m] = e
            ptr[m] = start[e]
            m += start[e + 1] > 0
            start[e + 1] += start[e]
        ptr[m] = n
        for i in range(n):
            e = flat[i]
            order[start[e]] = i
            start[e] += 1
    else:
        if order_in.shape[0] != n:
            return NOT_PERMUTATION, 0
        seen = np.zeros(n, np.bool_)
        for j in range(n):
            o = order_in[j]
            if o < 0 or o >= n or seen[o]:
                return NOT_PERMUTATION, 0
            seen[o] = True
        for j in range(1, n):
            if flat[order_in[j]] < flat[order_in[j - 1]]:
                return NOT_SORTED, 0
        for j in range(n):
            order[j] = order_in[j]
        m = 0
        prev = -1
        for j in range(n):
            e = flat[order[j]]
            if e != prev:
                experts[m] = e
                ptr[m] = j
                m += 1
                prev = e
        ptr[m] = n
    for j in range(n):
        w[j] = weights[order[j]]
    if counted.shape[0] == 0:
        for g in range(m):
            per[g] = ptr[g + 1] - ptr[g]
        return OK, m
    for g in range(m):
        per[g] = 0
    g = 0
    for j in range(n):
        if j == ptr[g + 1]:
            g += 1
        c[j] = counted[order[j] // k]
        if c[j]:
            per[g] += 1
    return OK, m


def _rows_ready(rows, experts, layer, hold_layer, hold_expert, inflight):
    """``SlotPool.check_rows`` without its messages: does every row hold (layer, its expert) with no copy in
    flight? (The caller asks the pool for the message when not.)"""
    for i in range(rows.shape[0]):
        r = rows[i]
        if hold_layer[r] != layer or hold_expert[r] != experts[i] or inflight[r] != 0:
            return False
    return True


def _group_index(ptr, positions, weights, experts, seg, rows, k, layer, hold_layer, hold_expert, inflight):
    """A group's indices (see ``GroupIndex``): the experts ``seg`` (indices into the routing's experts)
    in table rows ``rows``, sorted by row (stably): (pairs, weights, rows, experts, counts, lo, table
    counts, offsets (int32), token of each pair, row of each pair within the span, ready). ``ready``: with
    a slot table given (``hold_layer`` not empty), whether every row holds (layer, its expert) with no
    copy in flight (:func:`_rows_ready`); True without one. (:func:`_group_index_into` on new arrays.)"""
    g = seg.shape[0]
    total = 0
    lo = rows[0]
    hi = rows[0]
    for i in range(g):
        total += ptr[seg[i] + 1] - ptr[seg[i]]
        lo = min(lo, rows[i])
        hi = max(hi, rows[i])
    span = hi - lo + 1
    ints = np.empty((3, total), np.int64)
    small = np.empty((3, g), np.int64)
    table_counts = np.empty(span, np.int64)
    w = np.empty(total, np.float32)
    offs = np.empty(span, np.int32)
    state = np.empty((3, hold_layer.shape[0]), np.int64)
    state[0], state[1], state[2] = hold_layer, hold_expert, inflight
    total, lo, span, ready = _group_index_into_fn(ptr, positions, weights, experts, seg, rows, k, layer, state,
                                                  ints, w, small, table_counts, offs)
    return (ints[0], w, small[0], small[1], small[2], lo, table_counts, offs, ints[1], ints[2], ready)


def _group_index_into(ptr, positions, weights, experts, seg, rows, k, layer, state, ints, w, small, table_counts,
                      offs):
    """:func:`_group_index` into given arrays (a group of the accelerator lane writes the runtime's
    preallocated workspace: no arrays made per group); ``state``: the slot table's (hold_layer, hold_expert,
    inflight) rows (``SlotPool.state``: one argument, not three). ``ints`` rows 0-2 the pairs, their tokens and rows
    within the span, ``w`` their weights (each at least the group's pairs long), ``small`` rows 0-2 the
    sorted rows, experts and counts (at least g), ``table_counts`` and ``offs`` (int32; at least the span).
    Returns (pairs, lo, span, ready).

    The members are taken in row order from a bucket per row of the span (``table_counts`` the buckets: rows are
    distinct, one expert a slot), not by a sort; a repeated row (an error the readiness check reports) falls back
    to the stable sort, for the same result."""
    g = seg.shape[0]
    lo = rows[0]
    hi = rows[0]
    for i in range(1, g):
        lo = min(lo, rows[i])
        hi = max(hi, rows[i])
    span = hi - lo + 1
    for r in range(span):
        table_counts[r] = -1
    distinct = True
    for i in range(g):
        b = rows[i] - lo
        if table_counts[b] >= 0:
            distinct = False
            break
        table_counts[b] = i
    total = 0
    if distinct:
        j = 0
        for r in range(span):
            i = table_counts[r]
            table_counts[r] = 0
            if i >= 0:
                total = _group_member_fn(ptr, positions, weights, experts, seg[i], rows[i], lo, k, j, total, ints, w,
                                         small, table_counts)
                j += 1
    else:
        order = np.argsort(rows, kind="mergesort")
        for r in range(span):
            table_counts[r] = 0
        for j in range(g):
            total = _group_member_fn(ptr, positions, weights, experts, seg[order[j]], rows[order[j]], lo, k, j, total,
                                     ints, w, small, table_counts)
    acc = 0
    for r in range(span):
        acc += table_counts[r]
        offs[r] = acc
    ready = True
    if state.shape[1]:
        ready = _rows_ready_fn(small[0, :g], small[1, :g], layer, state[0], state[1], state[2])
    return total, lo, span, ready


def _group_member(ptr, positions, weights, experts, s, row, lo, k, j, a, ints, w, small, table_counts):
    """:func:`_group_index_into`'s member ``j`` in row order (the routing's expert ``s``, in table ``row``): its row,
    expert and pairs written, its pairs from position ``a`` on; returns the position after them."""
    c = ptr[s + 1] - ptr[s]
    small[0, j] = row
    small[1, j] = experts[s]
    small[2, j] = c
    table_counts[row - lo] = c
    pairs, tok, pair_rows = ints[0], ints[1], ints[2]
    for q in range(ptr[s], ptr[s + 1]):
        p = positions[q]
        pairs[a] = p
        w[a] = weights[q]
        tok[a] = p // k
        pair_rows[a] = row - lo
        a += 1
    return a


def _evict(row_of, experts, hold_layer, hold_expert):
    """``SlotPool.evict_many`` of one layer (``row_of``: its row of the table) in one loop: each expert's cache
    row is freed (it holds nothing); returns (the index of the first expert that is not cached or -1, the
    rows). Nothing changes unless every expert is cached."""
    rows = np.empty(experts.shape[0], np.int64)
    return _evict_into_fn(row_of, experts, hold_layer, hold_expert, rows), rows


def _evict_into(row_of, experts, hold_layer, hold_expert, rows):
    """:func:`_evict` writing the rows into ``rows`` (at least as long as ``experts``); returns the index."""
    m = experts.shape[0]
    width = row_of.shape[0]
    for i in range(m):
        e = experts[i]
        r = row_of[e] if 0 <= e < width else -1
        if r < 0:
            return i
        rows[i] = r
    for i in range(m):
        row_of[experts[i]] = -1
        hold_layer[rows[i]] = -1
        hold_expert[rows[i]] = -1
    return -1


def _admit(row_of, experts, rows, layer, hold_layer, hold_expert):
    """``SlotPool.admit_many`` of one layer in one loop: ``experts`` take the free cache ``rows``; returns -1,
    else (nothing changed) the index of the first expert that is already cached, or :data:`TOO_WIDE` when an
    expert lies beyond ``row_of`` (the caller widens the table and calls again)."""
    m = experts.shape[0]
    width = row_of.shape[0]
    for i in range(m):
        if experts[i] >= width:
            return TOO_WIDE
    for i in range(m):
        if row_of[experts[i]] >= 0:
            return i
    for i in range(m):
        row_of[experts[i]] = rows[i]
        hold_layer[rows[i]] = layer
        hold_expert[rows[i]] = experts[i]
    return -1


def _swap(row_of, ins, outs, layer, hold_layer, hold_expert):
    """``SlotPool.swap`` of each pair in turn (one layer, ``row_of`` wide enough for every id): ``ins[i]`` takes
    ``outs[i]``'s cache row. Returns (the rows, -1 or the index of the pair that failed, 1: its ``out`` is not
    cached / 2: its ``in`` is); the pairs before a failed one stay done, as a loop of ``swap`` calls leaves them."""
    m = ins.shape[0]
    rows = np.empty(m, np.int64)
    for i in range(m):
        r = row_of[outs[i]]
        if r < 0:
            return rows, i, 1
        if row_of[ins[i]] >= 0:
            return rows, i, 2
        row_of[outs[i]] = -1
        row_of[ins[i]] = r
        hold_layer[r] = layer
        hold_expert[r] = ins[i]
        rows[i] = r
    return rows, -1, 0


def _matches(have_experts, have_counts, experts, counts):
    """``LayerRouting.matches``: ``experts`` / ``counts`` (any order, counts > 0) are exactly the entries of
    ``have_experts`` (ascending, unique) with a nonzero ``have_counts``, with those counts."""
    m = 0
    for i in range(have_counts.shape[0]):
        if have_counts[i] > 0:
            m += 1
    if experts.shape[0] != m:
        return False
    n = have_experts.shape[0]
    seen = np.zeros(n, np.bool_)
    for j in range(m):
        e = experts[j]
        lo = 0
        hi = n
        while lo < hi:  # binary search in the ascending ids
            mid = (lo + hi) // 2
            if have_experts[mid] < e:
                lo = mid + 1
            else:
                hi = mid
        if lo == n or have_experts[lo] != e or seen[lo] or counts[j] <= 0 or have_counts[lo] != counts[j]:
            return False
        seen[lo] = True
    return True


READY, PREFETCHED_KIND, FETCHED, STAGED = 0, 1, 2, 3  # an accelerator expert's kind in a lane split


def _partition(r_experts, r_counts, p_experts, p_counts, source, admitted, row_of, codes, uncounted_on_cpu):
    """A layer's routing checked against its plan and split between the lanes, in one pass.

    ``codes``: the plan's source codes (CPU, HIT, PREFETCHED, FETCH). Returns (status, CPU experts as
    ascending indices into the routing's experts (with, if ``uncounted_on_cpu``, those only uncounted
    tokens use), ``lane``: a (5, g) array over the g accelerator experts in touch order (their positions
    in the plan, indices into the routing's experts, cache rows (-1 unless a hit), expert ids, kinds:
    READY hit / PREFETCHED_KIND / FETCHED (admitted) / STAGED), ``order``: lane positions of the hits and
    prefetched ones, then the fetched ones, then the staged ones (each in touch order), the number of
    hits, of hits and prefetched ones, and of fetched ones). Status: 0 ok, 1 the routing is not the plan's
    (``LayerRouting.matches``), 2 a hit that the slot table does not cache (``lane[3, 0]`` names it)."""
    n = r_experts.shape[0]
    m = p_experts.shape[0]
    lane = np.empty((5, m), np.int64)
    order = np.empty(m, np.int64)
    cpu = np.empty(n, np.int64)
    status, c, g, hits, ready, fetched = _partition_into_fn(r_experts, r_counts, p_experts, p_counts, source, admitted,
                                                         row_of, codes, uncounted_on_cpu, np.empty((2, n), np.bool_),
                                                         lane, order, cpu, order[:0])
    empty = np.zeros(0, np.int64)
    if status == 2:
        bad = np.zeros((5, 1), np.int64)
        bad[3, 0] = lane[3, 0]
        return 2, empty, bad, empty, 0, 0, 0
    if status != 0:
        return status, empty, np.zeros((5, 0), np.int64), empty, 0, 0, 0
    return 0, cpu[:c], lane[:, :g].copy(), order[:g], hits, ready, fetched


def _partition_into(r_experts, r_counts, p_experts, p_counts, source, admitted, row_of, codes, uncounted_on_cpu,
                    flags, lane, order, cpu, scratch):
    """:func:`_partition` into given arrays (``flags``: (2, n) bool scratch, ``lane``: (5, at least m), ``order``:
    at least m, ``cpu``: at least n; a replay's layer writes the runtime's workspace): returns (status, the
    number of CPU experts c, of accelerator experts g, hits, ready, fetched); ``cpu[:c]``, ``lane[:, :g]``
    and ``order[:g]`` are the result (on status 2 ``lane[3, 0]`` names the expert). ``scratch`` (int64): the
    routing's position of each expert id, where it is longer than the largest (else one is allocated): a plan's
    expert is found by one read, not a binary search (whose branches a new layer's ids mispredict)."""
    cpu_code, hit_code, prefetched_code = codes[0], codes[1], codes[2]
    n = r_experts.shape[0]
    m = p_experts.shape[0]
    # (the loops below write every step and count by comparisons, without a branch on the data: each branch on a
    # layer's experts is mispredicted about half the time, at its cold caches the larger part of the call)
    nonzero = 0
    for i in range(n):
        nonzero += r_counts[i] > 0
    if nonzero != m:
        return 1, 0, 0, 0, 0, 0
    on_cpu, seen = flags[0], flags[1]
    for i in range(n):
        on_cpu[i] = False
        seen[i] = False
    top = r_experts[n - 1] + 1 if n else 0  # (the routing's experts: ascending, distinct, >= 0)
    at = scratch[:top] if scratch.shape[0] >= top else np.empty(top, np.int64)
    for e in range(top):
        at[e] = -1
    for i in range(n):
        at[r_experts[i]] = i
    width = row_of.shape[0]
    g = 0
    hits = 0
    ready = 0
    fetched = 0
    for j in range(m):
        e = p_experts[j]
        lo = at[e] if 0 <= e < top else -1
        if lo < 0 or seen[lo] or p_counts[j] <= 0 or r_counts[lo] != p_counts[j]:
            return 1, 0, 0, 0, 0, 0
        seen[lo] = True
        src = source[j]
        is_cpu, is_hit, is_pf = src == cpu_code, src == hit_code, src == prefetched_code
        is_fetch = not (is_cpu | is_hit | is_pf)
        adm = admitted[j]
        on_cpu[lo] = is_cpu
        row = row_of[e if e < width else 0] if width else -1
        row = row if is_hit & (e < width) else -1
        if is_hit & (row < 0):
            lane[3, 0] = e
            return 2, 0, 0, 0, 0, 0
        lane[0, g] = j  # (a CPU expert's column is written over by the next one)
        lane[1, g] = lo
        lane[2, g] = row
        lane[3, g] = e
        lane[4, g] = READY * is_hit + PREFETCHED_KIND * is_pf + (FETCHED if adm else STAGED) * is_fetch
        g += not is_cpu
        hits += is_hit
        ready += is_hit | is_pf
        fetched += is_fetch & adm
    a = 0  # the ready ones (hits and prefetched), then the fetched ones, then the staged ones
    b = ready
    c = ready + fetched
    for i in range(g):
        kind = lane[4, i]
        first, second = (kind == READY) | (kind == PREFETCHED_KIND), kind == FETCHED
        order[a if first else (b if second else c)] = i
        a += first
        b += second
        c += not (first | second)
    c = 0
    for i in range(n):
        cpu[c] = i  # (written over unless it is one)
        c += on_cpu[i] | (uncounted_on_cpu & (r_counts[i] == 0))
    return 0, c, g, hits, ready, fetched


def _rank_order(ids, weights, rows):
    """Each token's expert ids in rank order: descending gate weight, ties keeping their column (the stable
    sort of ``np.argsort(-weights, axis=1, kind="stable")``), for the tokens ``rows`` (all if empty)."""
    T = rows.shape[0] if rows.shape[0] else ids.shape[0]
    k = ids.shape[1]
    out = np.empty((T, k), np.int64)
    w = np.empty(k, np.float64)
    for t in range(T):
        r = rows[t] if rows.shape[0] else t
        for j in range(k):  # insertion sort: stable, k is small
            v = weights[r, j]
            e = ids[r, j]
            i = j
            while i > 0 and w[i - 1] < v:
                w[i] = w[i - 1]
                out[t, i] = out[t, i - 1]
                i -= 1
            w[i] = v
            out[t, i] = e
    return out


def staging_schedule(n_staged, buffers):
    """(``per_turn``, ``halves``): the staging turns of ``n_staged`` experts through ``buffers`` free staging buffers
    (``OffloadRuntime._accelerator_lane``, and the route call that starts them): all in one turn if they fit, else
    turns of half the buffers each in two alternating sets (so a turn's copy overlaps the last turn's compute), or
    one at a time through a single buffer."""
    if n_staged <= buffers:
        return n_staged, 1
    return max(1, buffers // 2), (2 if buffers >= 2 else 1)


#: rows of the int64 workspace of :func:`_route_partition` (see ``workspace.RouteWorkspace``)
W_EVICTED, W_ORDER, W_PTR, W_EXPERTS, W_PER, W_LANE, W_LANE_ORDER, W_CPU, W_TOKENS, W_TURNS = 0, 1, 2, 3, 4, 5, 10, 11, 12, 13
W_FIRST, W_FLAGS = 17, 19  # the first group's experts and rows; scratch flags (two rows each)
W_COPIES = 21  # the accelerator lane's first copies: lane positions, slot rows, experts (three rows)
W_DECLINED = 24  # lane positions of the prefetched experts the cache declined (their buffers freed after the compute)
W_SCRATCH = 25  # the grouping's counting sort and the partition's positions of expert ids (RouteWorkspace: wide enough)
W_ROWS = 26
NOT_PREFETCHED = 3  # _route_partition's admission status: a plan's prefetched expert has no prefetch buffer
#: the plan's source codes in the order :func:`_partition` takes them (CPU, HIT, PREFETCHED, FETCH); a global
#: array, which numba compiles in as a constant
PLAN_CODES = np.array([_CPU, _HIT, _PREFETCHED, _FETCH], np.int64)


def _route_partition(flat, weights, k, p_experts, p_counts, source, admitted, row_of_all, prefetch_row_all, evicted,
                     free, layer, state, wi, wf, gi, gw, goffs, stage_lo, stage_n):
    """A replay's layer in one call: the plan's evictions (:func:`_evict`; ``row_of_all[layer]`` is the layer's
    row of the slot table), :func:`_group_routing` of the trace's ids (no given order, every token counted),
    :func:`_partition` of the result, the prefetched experts taken from their buffers (``prefetch_row_all[layer]``,
    ``SlotPool.prefetch_row``: the buffer's row in the lane's row 2, the entry cleared) and the admitted ones adopted
    (their buffer becomes their cache row; ``SlotPool.adopt`` gives one of the first free cache rows to the prefetch
    buffers in exchange, in lane order, which is the caller's: :meth:`SlotPool.took_prefetched`), and the admissions
    of the fetched experts: they take the free cache rows ``free`` (the layer's free list, then the rows just
    evicted) after those. ``state``: the slot table's (hold_layer, hold_expert, inflight) rows (``SlotPool.state``);
    the plan's source codes are :data:`PLAN_CODES`. Few arguments: with cold caches numba's dispatch costs about a
    microsecond per argument.

    Everything is written into a preallocated workspace (no array is made or returned: each would cost
    an allocation and a Python object per layer): ``wi`` (int64, :data:`W_ROWS` x at least n + 1 columns,
    n the pairs, and at least the evictions) holds the evicted rows (row :data:`W_EVICTED`), the grouping's
    order, ptr, experts and pairs per expert (:data:`W_ORDER` ..), the lane split (the five rows from
    :data:`W_LANE`), its order, the CPU experts, the lane positions of the prefetched experts the cache declined
    (:data:`W_DECLINED`), the token of each sorted pair (:data:`W_TOKENS`) and, from
    :data:`W_TURNS`, the staged experts' ids and pairs (in staging order: the staging turns') and those
    experts' pairs in that order, as flat positions and tokens (one gather and one scatter serve every turn);
    ``wf`` (float32, 2 x at least n) the sorted weights and the staged pairs' weights in staging order.
    Returns (index of an evicted expert that is not cached or -1, the number of evicted rows, grouping status,
    the number of experts m, partition status, the number of CPU experts c, of accelerator experts g, hits,
    ready, fetched, admission status: ``OK`` (the prefetched and fetched experts' rows are in the lane's row 2 and
    the table), else :data:`TOO_WIDE` / 1 (an expert already cached) / 2 (not enough free rows) /
    :data:`NOT_PREFETCHED`, nothing adopted or admitted: the caller's ``SlotPool`` calls refuse as they do), the
    number of prefetched experts adopted, of those declined and whether a prefetched one's copy is in flight, the
    first group's (pairs, lo, span, ready) or (-1, 0, 0, False), whether the first group is of staged experts,
    the number of the lane's first copies listed (see below) or -1, and whether the lane is settled ahead (below).

    The first group: when ``gi`` (``GroupWorkspace.gi``, with ``gw`` and ``goffs``: at least the pairs and
    the slot table's rows wide; empty to skip) is given and the fetched experts are admitted, the group of the
    ready and fetched experts (at least two; what the CPU device's accelerator lane computes first,
    :func:`_group_index_into` of them, their rows checked now: a prefetch still in flight leaves it unwritten)
    is written there: one compiled call per layer instead of two.
    When there are none of those but staged experts, and the ``stage_n`` free staging buffers (consecutive rows
    from ``stage_lo``: ``SlotPool.free_staging_rows``) hold them all, the staged experts take those rows in
    staging order (the lane's row 2) and their group is written instead (the CPU device's one staging turn, a lane
    settled ahead: below).

    The staging schedule's start (:func:`staging_schedule`: ``per_turn`` staged experts a turn, in ``halves``
    alternating sets of buffers), when the fetched experts are admitted (or there are none): the
    first turns' staged experts take the first staging buffers in staging order (the lane's row 2 and, unless the
    lane is settled ahead, the table: they hold them, as the copies into them are about to be issued), and the lane's
    first copies (the fetched experts and those, lane positions
    ascending) are listed in rows :data:`W_COPIES` .. + 2 (positions, slot rows, experts); their number is the
    last value returned (-1: not done, the caller's own code does it). With one-expert turns (and a lane not settled
    ahead) each of those buffers is then held by the expert of its last turn (``OffloadRuntime._single_prepare``'s
    holds).

    Settled ahead: on the CPU device (``gi`` given), with the schedule started here, no prefetched copy in flight and
    the staged experts in one turn or one at a time, the lane's device work runs in one pause of the stopwatch
    (``OffloadRuntime._settle_ahead``) and its staging buffers are released before it; nothing reads their holds
    in between, so they are not taken at all and none of them is held (the rows are given all the same)."""
    row_of, hold_layer, hold_expert = row_of_all[layer], state[0], state[1]
    wb = wi[W_FLAGS:W_FLAGS + 2]  # scratch (the workspace's: nothing is allocated in this call)
    none = wi[W_EVICTED, :0]  # (no given order, every token counted)
    codes = PLAN_CODES
    ev_rows = wi[W_EVICTED]
    n_ev = evicted.shape[0]
    bad = _evict_into_fn(row_of, evicted, hold_layer, hold_expert, ev_rows)
    if bad >= 0:
        return bad, 0, OK, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, False, -1, 0, 0, False, False, -1, False
    scratch = wi[W_SCRATCH]
    status, m = _group_routing_into_fn(flat, none, weights, none, k, wi[W_ORDER], wi[W_PTR], wi[W_EXPERTS], wf[0],
                                       wb[0], wi[W_PER], scratch)
    if status != OK:
        return -1, n_ev, status, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, False, -1, 0, 0, False, False, -1, False
    order, tokens, ptr = wi[W_ORDER], wi[W_TOKENS], wi[W_PTR]
    for j in range(flat.shape[0]):
        tokens[j] = order[j] // k
    lane, lorder = wi[W_LANE:W_LANE + 5], wi[W_LANE_ORDER]
    pstatus, c, g, hits, ready, fetched = _partition_into_fn(
        wi[W_EXPERTS, :m], wi[W_PER, :m], p_experts, p_counts, source, admitted, row_of, codes, False, wb, lane,
        lorder, wi[W_CPU], scratch)
    if pstatus == 0:
        q = 0
        for t in range(g - ready - fetched):  # the staged experts, in staging order, and their pairs in that order
            i = lorder[ready + fetched + t]
            s = lane[1, i]
            wi[W_TURNS, t] = lane[3, i]
            wi[W_TURNS + 1, t] = ptr[s + 1] - ptr[s]
            for j in range(ptr[s], ptr[s + 1]):
                wi[W_TURNS + 2, q] = order[j]
                wi[W_TURNS + 3, q] = tokens[j]
                wf[1, q] = wf[0, j]
                q += 1
    adm = OK
    n_adopt, n_declined, in_flight = 0, 0, False
    if pstatus == 0 and (fetched or ready > hits):
        # checked first, then written (all or nothing: a refusal leaves the table to the caller's SlotPool calls)
        prow = prefetch_row_all[layer]
        for t in range(ready):  # the prefetched ones: in their buffers (``SlotPool.pop_prefetched``)
            i = lorder[t]
            if lane[4, i] == PREFETCHED_KIND:
                e = lane[3, i]
                if e >= prow.shape[0] or prow[e] < 0:
                    adm = NOT_PREFETCHED
                elif admitted[lane[0, i]]:
                    n_adopt += 1
        width = row_of.shape[0]
        m_free = free.shape[0]
        for i in range(ready, ready + fetched):
            e = lane[3, lorder[i]]
            if e >= width:
                adm = TOO_WIDE
            elif row_of[e] >= 0 and adm == OK:
                adm = 1
        if adm == OK and n_adopt + fetched > m_free + n_ev:
            adm = 2
        if adm == OK:
            inflight = state[2]
            for t in range(ready):  # the admitted prefetched ones adopt their buffers (SlotPool.adopt), in lane order
                i = lorder[t]
                if lane[4, i] == PREFETCHED_KIND:
                    e = lane[3, i]
                    r = prow[e]
                    prow[e] = -1
                    lane[2, i] = r
                    if inflight[r] != 0:
                        in_flight = True
                    if admitted[lane[0, i]]:
                        row_of[e] = r
                    else:
                        wi[W_DECLINED, n_declined] = i
                        n_declined += 1
            for j in range(fetched):
                g_ = lorder[ready + j]
                f = n_adopt + j
                row = free[f] if f < m_free else ev_rows[f - m_free]
                e = lane[3, g_]
                row_of[e] = row
                hold_layer[row] = layer
                hold_expert[row] = e
                lane[2, g_] = row
    fg_n, fg_lo, fg_span, fg_ready = -1, 0, 0, False
    nf = ready + fetched
    n_copies = -1
    ns = g - nf  # the staged experts
    settled = False
    if pstatus == 0 and adm == OK and (ns == 0 or stage_n >= 1):
        per_turn, halves = _staging_schedule_fn(ns, stage_n)
        n_head = min(ns, per_turn * halves)  # the first turns' experts
        # the CPU device's lane settled ahead of its device work (OffloadRuntime._accelerator_lane's rule): its staging
        # buffers are never taken, so none is held (nothing reads a hold before the buffers are free again)
        settled = gi.shape[1] > 0 and not in_flight and (ns == 0 or per_turn == ns or per_turn == 1)
        for t in range(n_head):  # (staging order: the lane order)
            i = lorder[nf + t]
            lane[2, i] = stage_lo + t
            if not settled:
                hold_layer[stage_lo + t] = layer
                hold_expert[stage_lo + t] = lane[3, i]
        if per_turn == 1 and not settled:  # one-expert turns: each buffer holds its last turn's expert (the loop
            for h in range(n_head):  # copies the others)
                last = ns - 1 if halves == 1 else ((ns - 1) & ~1 if h == 0 else (ns - 2) | 1)
                hold_expert[stage_lo + h] = lane[3, lorder[nf + last]]
        a, b, end = ready, nf, nf + n_head  # the fetched ones and those, each ascending, merged
        for j in range(nf - ready + n_head):
            if b >= end or (a < nf and lorder[a] < lorder[b]):
                i = lorder[a]
                a += 1
            else:
                i = lorder[b]
                b += 1
            wi[W_COPIES, j] = i
            wi[W_COPIES + 1, j] = lane[2, i]
            wi[W_COPIES + 2, j] = lane[3, i]
        n_copies = nf - ready + n_head
    staged = pstatus == 0 and nf == 0 and 0 < g <= stage_n  # (then every accelerator expert is staged)
    first = pstatus == 0 and adm == OK and nf >= 2
    if (first or staged) and gi.shape[1] >= flat.shape[0]:
        seg = wi[W_FIRST]
        rows = wi[W_FIRST + 1]
        if staged:  # (their rows given above: the first staging buffers)
            nf = g
        for i in range(nf):
            seg[i] = lane[1, lorder[i]]
            rows[i] = lane[2, lorder[i]]
        fg_n, fg_lo, fg_span, fg_ready = _group_index_into_fn(
            ptr, order, wf[0], wi[W_EXPERTS], seg[:nf], rows[:nf], k, layer,
            state[:, :0] if staged and settled else state,  # (unheld staging buffers: given just above)
            gi[0:3], gw, gi[3:6], gi[6], goffs)
    return (-1, n_ev, status, m, pstatus, c, g, hits, ready, fetched, adm, n_adopt, n_declined, in_flight, fg_n, fg_lo,
            fg_span, fg_ready, staged, n_copies, settled)


#: what the kernels call (``_<name>_fn``): the compiled kernels once compiled (:func:`compiled`), else themselves
_rows_ready_fn, _evict_into_fn, _group_member_fn = _rows_ready, _evict_into, _group_member
_group_routing_into_fn, _partition_into_fn, _group_index_into_fn = _group_routing_into, _partition_into, _group_index_into
_staging_schedule_fn = staging_schedule

_KERNELS = {"group_routing": _group_routing, "group_routing_into": _group_routing_into, "group_index": _group_index,
            "group_index_into": _group_index_into, "matches": _matches, "partition": _partition,
            "partition_into": _partition_into, "rank_order": _rank_order, "rows_ready": _rows_ready, "evict": _evict,
            "evict_into": _evict_into, "admit": _admit, "swap": _swap, "route_partition": _route_partition,
            "group_member": _group_member,
            "staging_schedule": staging_schedule}
#: the kernels each one calls (compiled before it: numba binds a global function when it compiles a caller)
_CALLS = {"group_routing": ("group_routing_into",), "group_index": ("group_index_into",),
          "group_index_into": ("rows_ready", "group_member"), "partition": ("partition_into",),
          "evict": ("evict_into",),
          "route_partition": ("evict_into", "group_routing_into", "partition_into", "group_index_into",
                              "staging_schedule")}
_compiled: dict[str, object] = {}


def compiled(name: str):
    """The compiled kernel ``name`` (a key of ``_KERNELS``), or None without numba."""
    if name not in _compiled:
        for callee in _CALLS.get(name, ()):
            globals()[f"_{callee}_fn"] = compiled(callee) or _KERNELS[callee]
        _compiled[name] = _policy_kernels.jit(_KERNELS[name])
    return _compiled[name]


class Entries:
    """Kernel ``name`` called through its compiled entry points, one per combination of the dtypes of its
    ``loose`` arguments (positions of arrays whose type the caller does not fix: a trace's ids, a plan's
    arrays), without numba's dispatcher, which types every argument at every call (about a microsecond each
    with cold caches; ``benchmarks/kernel_calls.py`` measures what that saves once the caller has built the
    key: 2-5 us per route call of 17 arguments, nothing for a group's call of 14). An entry point checks
    nothing and reads its arguments as the types it was compiled for, so the loose arguments are compiled as
    read-only arrays of any layout (numba's ``A``: read by their strides, whatever they are; the caller passes
    their dtypes as ``key``) and every other argument must keep its type from call to call (the caller's own
    buffers). A new key is typed and compiled once; the last one is found by a comparison of its dtypes (no
    hashing: the key is built and compared while the caches are cold)."""

    __slots__ = ("name", "loose", "_by_key", "_last_key", "_last")

    def __init__(self, name: str, loose: tuple[int, ...]):
        self.name, self.loose = name, frozenset(loose)
        self._by_key: dict = {}
        self._last_key: tuple | None = None
        self._last = None

    def get(self, key: tuple, args: tuple):
        """The entry point for ``key`` (made from ``args``, an example call with that key), or None without numba."""
        if key == self._last_key:
            return self._last
        fn = self._by_key.get(key)
        if fn is None:
            kernel = compiled(self.name)
            if kernel is None:
                return None
            sig = tuple(kernel.typeof_pyval(a).copy(layout="A", readonly=True) if i in self.loose
                        else kernel.typeof_pyval(a) for i, a in enumerate(args))
            fn = self._by_key[key] = kernel.compile(sig)
        self._last_key, self._last = key, fn
        return fn


__all__ = ["Entries", "FETCHED", "NEGATIVE", "NOT_PERMUTATION", "NOT_PREFETCHED", "NOT_SORTED", "OK", "PREFETCHED_KIND",
           "READY", "STAGED", "TOO_WIDE", "compiled", "staging_schedule"]
