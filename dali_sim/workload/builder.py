"""Workload builder: a trace's sequences -> batches -> steps -> per (step, MoE layer) expert workloads.

Sequences (in ``seq_id`` order) are grouped into batches of ``batch_size``. A batch runs its prefill
(one step, or one step per ``prefill_chunk`` prompt positions) and then decode steps while any of its
sequences still has a token; batches run one after another. The *workload* of an expert at a
(step, layer) is the number of the step's tokens routed to it.

Activated experts of each (step, layer) are stored sparsely in **touch order**: descending workload,
then best (lowest) rank among the step's tokens, then lower id. Cache policies see them in this order.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dali_sim.models.spec import ModelSpec
from dali_sim.policies import kernels
from dali_sim.trace.lookahead import predicted_top_k  # noqa: F401  (re-exported: dali_sim.workload.online)
from dali_sim.trace.reader import Trace
from dali_sim.trace.schema import DECODE, PREFILL


@dataclass(frozen=True)
class WorkloadConfig:
    batch_size: int = 1
    prefill_chunk: int = 0  # prompt positions per prefill step; 0 = the whole prompt in one step

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")


@dataclass
class SparseCounts:
    """Per (step, layer) a list of (expert, count, best rank); segment ``i = step * L + layer``."""

    ptr: np.ndarray  # (S*L + 1,) int64
    expert: np.ndarray  # (nnz,) int16, touch order within each segment
    count: np.ndarray  # (nnz,) int32
    rank: np.ndarray  # (nnz,) int8

    def segment(self, i: int) -> slice:
        return slice(int(self.ptr[i]), int(self.ptr[i + 1]))


def _concat_counts(parts: list[SparseCounts]) -> SparseCounts:
    """Sparse counts of consecutive blocks of segments as one; one field at a time, dropping the blocks'
    copies as it goes, so the peak is the result plus its largest field."""
    sizes = np.concatenate([np.diff(p.ptr) for p in parts])
    ptr = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    fields = {}
    for name in ("expert", "count", "rank"):
        fields[name] = np.concatenate([getattr(p, name) for p in parts])
        for p in parts:
            setattr(p, name, None)
    return SparseCounts(ptr, fields["expert"], fields["count"], fields["rank"])


def _freeze(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


def _sparse_counts(step: np.ndarray, layer: np.ndarray, ids: np.ndarray, ranks: np.ndarray,
                   num_steps: int, num_layers: int, num_experts: int) -> SparseCounts:
    """Group (step, layer, expert) occurrences; order each segment by (-count, best rank, id): in one compiled
    pass (:func:`_segment_counts`), else (no numba, or an id outside the experts) by sorting."""
    seg = step.astype(np.int64) * num_layers + layer
    kernel = _compiled_segment_counts()
    if kernel is not None:
        n, S = len(seg), num_steps * num_layers
        ptr, expert, count, rank = np.empty(S + 1, np.int64), np.empty(n, np.int16), np.empty(n, np.int32), \
            np.empty(n, np.int8)
        m = kernel(seg, ids, ranks, S, num_experts, ptr, expert, count, rank)
        if m >= 0:
            return SparseCounts(ptr, expert[:m].copy(), count[:m].copy(), rank[:m].copy())
    return _sparse_counts_sorted(seg, ids, ranks, num_steps, num_layers, num_experts)


def _sparse_counts_sorted(seg: np.ndarray, ids: np.ndarray, ranks: np.ndarray, num_steps: int, num_layers: int,
                          num_experts: int) -> SparseCounts:
    """:func:`_sparse_counts` of the segments ``seg`` by sorting (the NumPy path)."""
    # one sort of (segment, expert, rank) keys: each (segment, expert) run starts with its best rank
    base = int(ranks.max()) + 1 if ranks.size else 1
    key_sorted = np.sort((seg * num_experts + ids) * base + ranks)
    full = key_sorted // base
    starts = np.flatnonzero(np.concatenate(([True], full[1:] != full[:-1]))) if full.size else np.array([], int)
    uniq = full[starts]
    counts = np.diff(np.append(starts, full.size)).astype(np.int32)
    best = (key_sorted[starts] % base).astype(np.int8)
    useg, expert = np.divmod(uniq, num_experts)
    touch = np.lexsort((expert, best, -counts, useg))
    useg, expert, counts, best = useg[touch], expert[touch], counts[touch], best[touch]
    ptr = np.searchsorted(useg, np.arange(num_steps * num_layers + 1), side="left").astype(np.int64)
    return SparseCounts(ptr, expert.astype(np.int16), counts, best.astype(np.int8))


def _segment_counts(seg, ids, ranks, num_segments, num_experts, ptr, expert, count, rank):
    """:func:`_sparse_counts` in one pass (compiled by numba): the occurrences bucketed by segment (a counting
    sort), each segment's experts counted with their best rank as they come, then ordered by an insertion sort on
    (-count, best rank, id) (the same total order as the NumPy lexsort). Writes ``ptr`` (num_segments + 1) and
    the first nnz entries of ``expert``, ``count`` and ``rank``; returns nnz, or -1 (nothing usable written) when
    a segment or an id lies outside its range."""
    n = seg.shape[0]
    start = np.zeros(num_segments + 1, np.int64)
    for i in range(n):
        s = seg[i]
        if s < 0 or s >= num_segments or ids[i] < 0 or ids[i] >= num_experts:
            return -1
        start[s + 1] += 1
    for s in range(num_segments):
        start[s + 1] += start[s]
    order = np.empty(n, np.int64)
    fill = start[:num_segments].copy()
    for i in range(n):
        s = seg[i]
        order[fill[s]] = i
        fill[s] += 1
    cnt = np.zeros(num_experts, np.int64)
    best = np.zeros(num_experts, np.int64)
    m = 0
    for s in range(num_segments):
        ptr[s] = m
        a = m
        for j in range(start[s], start[s + 1]):
            i = order[j]
            e = ids[i]
            r = ranks[i]
            if cnt[e] == 0:
                best[e] = r
                expert[m] = e
                m += 1
            elif r < best[e]:
                best[e] = r
            cnt[e] += 1
        for x in range(a, m):
            e = expert[x]
            i = x
            while i > a:
                o = expert[i - 1]
                if cnt[o] > cnt[e] or (cnt[o] == cnt[e] and (best[o] < best[e] or (best[o] == best[e] and o < e))):
                    break
                expert[i] = o
                i -= 1
            expert[i] = e
        for x in range(a, m):
            e = expert[x]
            count[x] = cnt[e]
            rank[x] = best[e]
            cnt[e] = 0
    ptr[num_segments] = m
    return m


@functools.cache
def _compiled_segment_counts():
    """The compiled :func:`_segment_counts` (made on first use), or None without numba."""
    return kernels.jit(_segment_counts)


#: rows of the trace grouped into per (step, layer) counts at once (whole steps; at least one step)
BUILD_ROWS = 1 << 18


class Workload:
    """Steps of a trace under a batching configuration (see module docstring).

    Per step: ``phase`` (0 prefill / 1 decode), ``batch``, ``tokens``, ``context`` (mean number of
    earlier tokens, plus itself, that each query attends to) and ``kv_tokens`` (KV-cache entries read
    in the step, summed over its sequences). ``sequences`` is a DataFrame with one row per sequence:
    its batch, prompt and decode token counts and first/last step of each phase.

    The per (step, layer) counts are built a block of steps at a time (:data:`BUILD_ROWS` rows), from
    the trace's routing and, for each of ``predictors``, its packed predicted top-k
    (:meth:`Trace.predicted_top_k`), so building needs memory for one block beside the result. The
    arrays are read-only: one workload can serve several runs (:meth:`with_predictors`).
    """

    def __init__(self, trace: Trace, config: WorkloadConfig = WorkloadConfig(),
                 predictors: tuple[str, ...] = ()):
        if len(trace) == 0:
            raise ValueError(f"{trace.path or 'trace'}: the trace has no rows; nothing to simulate")
        self.config = config
        self.model: ModelSpec = trace.model
        self.trace_path = trace.path
        self.num_layers = len(trace.layers)
        self.num_experts = trace.num_experts
        self.top_k = trace.top_k
        L = self.num_layers
        self._trace = trace
        self._row_order = trace.row_order  # rows sorted by (seq_id, pos, layer): token i's rows are i*L..i*L+L-1
        first_rows = self._file_rows(np.arange(0, len(trace), L))
        tok_seq = trace.seq_id[first_rows].astype(np.int64)
        tok_pos = trace.pos[first_rows].astype(np.int64)
        tok_phase = trace.phase[first_rows]
        step_of_token, self.sequences = self._schedule(tok_seq, tok_pos, tok_phase, config)
        self.num_steps = int(step_of_token.max()) + 1
        self._token_step = step_of_token
        # per-token routing for runtimes that execute the steps (dali_exec): tokens in (seq_id, pos) order
        self._token_seq, self._token_pos = tok_seq, tok_pos
        self._step_token_order = np.argsort(step_of_token, kind="stable")
        self._step_token_ptr = np.searchsorted(step_of_token[self._step_token_order], np.arange(self.num_steps + 1))
        self._step_arrays(step_of_token, tok_seq, tok_pos, tok_phase)
        self.predictor_offsets: dict[str, int] = {}
        for name in predictors:
            trace.predicted_top_k(name)  # raises the uniform "no such column" message
            self.predictor_offsets[name] = trace.meta.predictors[name].target_offset
        self.actual, self.predicted, self._frequencies = self._build_counts(trace, tuple(predictors))
        for arr in (self.actual, *self.predicted.values()):
            _freeze(arr.ptr, arr.expert, arr.count, arr.rank)
        _freeze(self.step_tokens, self.step_phase, self.step_context, self.step_kv, self.step_batch,
                self.step_logit_tokens, self._frequencies)

    def _file_rows(self, sorted_rows: np.ndarray) -> np.ndarray:
        """File row indices of rows given by their index in (seq_id, pos, layer) order."""
        return sorted_rows if self._row_order is None else self._row_order[sorted_rows]

    def _step_blocks(self):
        """(first step, end step) of consecutive blocks of whole steps of about :data:`BUILD_ROWS` rows."""
        rows_before = self._step_token_ptr * self.num_layers
        s0 = 0
        while s0 < self.num_steps:
            s1 = int(np.searchsorted(rows_before, rows_before[s0] + BUILD_ROWS, side="right")) - 1
            s1 = min(max(s1, s0 + 1), self.num_steps)
            yield s0, s1
            s0 = s1

    def _build_counts(self, trace: Trace, predictors: tuple[str, ...]):
        """(actual, predicted, frequencies): the sparse counts of every (step, layer), block by block."""
        L, E, k = self.num_layers, self.num_experts, self.top_k
        ranks = np.arange(k, dtype=np.int8)
        parts: dict[str | None, list[SparseCounts]] = {None: [], **{name: [] for name in predictors}}
        freq = np.zeros(L * E, np.int64)
        tops = {name: trace.predicted_top_k(name) for name in predictors}
        for s0, s1 in self._step_blocks():
            tokens = self._step_token_order[self._step_token_ptr[s0]:self._step_token_ptr[s1]]
            rows = self._file_rows((tokens[:, None] * L + np.arange(L)).reshape(-1))
            step = np.repeat(self._token_step[tokens] - s0, L)
            layer = trace.layer_index[rows]
            m = len(rows)
            act = _sparse_counts(np.repeat(step, k), np.repeat(layer, k), trace.experts[rows].reshape(-1),
                                 np.tile(ranks, m), s1 - s0, L, E)
            parts[None].append(act)
            seg_layer = np.repeat(np.arange((s1 - s0) * L) % L, np.diff(act.ptr))
            freq += np.bincount(seg_layer * E + act.expert, weights=act.count, minlength=L * E).astype(np.int64)
            for name, top in tops.items():
                target = layer + self.predictor_offsets[name]
                pred = top[rows]
                has = (pred[:, 0] >= 0) & (target < L)
                parts[name].append(_sparse_counts(np.repeat(step[has], k), np.repeat(target[has], k),
                                                  pred[has].reshape(-1), np.tile(ranks, int(has.sum())),
                                                  s1 - s0, L, E))
        actual = _concat_counts(parts.pop(None))
        return actual, {name: _concat_counts(p) for name, p in parts.items()}, freq.reshape(L, E)

    def with_predictors(self, names) -> "Workload":
        """This workload with only the lookahead predictors ``names`` (which it must have loaded): what a
        run whose policies read those would have built itself. Shares every array (they are read-only)."""
        missing = [n for n in names if n not in self.predicted]
        if missing:
            raise ValueError(f"predictor(s) {missing} were not loaded into this workload "
                             f"(loaded: {', '.join(self.predicted) or 'none'})")
        view = copy.copy(self)
        view.predicted = {n: self.predicted[n] for n in names}
        view.predictor_offsets = {n: self.predictor_offsets[n] for n in names}
        return view

    @functools.cached_property
    def _sorted(self) -> Trace:
        """The trace with its rows in (seq_id, pos, layer) order (made on first use)."""
        return self._trace.sorted()

    # ---- scheduling ---------------------------------------------------------------------------
    @staticmethod
    def _schedule(seq, pos, phase, cfg: WorkloadConfig):
        """Step index of every token (tokens sorted by seq, pos) and the per-sequence table."""
        seq_ids, first_tok, n_tok = np.unique(seq, return_index=True, return_counts=True)
        batch_of_seq = np.arange(len(seq_ids)) // cfg.batch_size
        seq_index = np.repeat(np.arange(len(seq_ids)), n_tok)
        # index of each token within its phase of its sequence (tokens are sorted by pos)
        is_pre = phase == PREFILL
        pre_count = np.bincount(seq_index, weights=is_pre, minlength=len(seq_ids)).astype(np.int64)
        dec_count = n_tok - pre_count
        within = np.arange(len(seq)) - first_tok[seq_index]
        dec_within = within - pre_count[seq_index]  # valid for decode tokens (prefill precedes decode)
        chunk = cfg.prefill_chunk
        pre_steps_of_seq = np.where(pre_count > 0, -(-pre_count // chunk) if chunk else 1, 0)
        num_batches = int(batch_of_seq.max()) + 1
        pre_steps = np.zeros(num_batches, np.int64)
        dec_steps = np.zeros(num_batches, np.int64)
        np.maximum.at(pre_steps, batch_of_seq, pre_steps_of_seq)
        np.maximum.at(dec_steps, batch_of_seq, dec_count)
        batch_start = np.concatenate(([0], np.cumsum(pre_steps + dec_steps)[:-1]))
        b = batch_of_seq[seq_index]
        pre_step = batch_start[b] + (within // chunk if chunk else 0)
        dec_step = batch_start[b] + pre_steps[b] + dec_within
        step = np.where(is_pre, pre_step, dec_step)
        sb = batch_of_seq
        sequences = pd.DataFrame({
            "seq_id": seq_ids,
            "batch": sb,
            "prompt_tokens_traced": pre_count,
            "decode_tokens": dec_count,
            "first_prefill_step": np.where(pre_count > 0, batch_start[sb], -1),
            "last_prefill_step": np.where(pre_count > 0, batch_start[sb] + pre_steps_of_seq - 1, -1),
            "first_decode_step": np.where(dec_count > 0, batch_start[sb] + pre_steps[sb], -1),
            "last_decode_step": np.where(dec_count > 0, batch_start[sb] + pre_steps[sb] + dec_count - 1, -1),
        })
        return step, sequences

    def _step_arrays(self, step, seq, pos, phase) -> None:
        S = self.num_steps
        self.step_tokens = np.bincount(step, minlength=S).astype(np.int64)
        if (self.step_tokens == 0).any():  # cannot happen by construction; guards the invariants
            raise AssertionError("empty step in the schedule")
        self.step_phase = np.zeros(S, np.int8)
        self.step_phase[step] = phase
        mixed = np.bincount(step, weights=phase, minlength=S)
        if not np.all((mixed == 0) | (mixed == self.step_tokens)):
            raise AssertionError("a step mixes prefill and decode tokens")
        self.step_context = np.bincount(step, weights=pos + 1, minlength=S) / self.step_tokens
        # KV entries read: per (step, sequence) the longest context among its tokens
        key = step * (seq.max() + 1) + seq
        order = np.argsort(key, kind="stable")
        ks = key[order]
        starts = np.flatnonzero(np.concatenate(([True], ks[1:] != ks[:-1])))
        per_seq_kv = np.maximum.reduceat(pos[order] + 1, starts)
        self.step_kv = np.bincount(step[order][starts], weights=per_seq_kv, minlength=S).astype(np.int64)
        self.step_batch = np.zeros(S, np.int64)
        self.step_batch[step] = self.sequences["batch"].to_numpy()[np.searchsorted(self.sequences["seq_id"], seq)]
        # tokens whose logits the step computes: every decode token; in prefill only each prompt's last token
        last_pre = self.sequences["last_prefill_step"].to_numpy()
        self.step_logit_tokens = np.where(self.step_phase == DECODE, self.step_tokens,
                                          np.bincount(last_pre[last_pre >= 0], minlength=S)[:S]).astype(np.int64)

    # ---- access -------------------------------------------------------------------------------
    def activated(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(expert ids in touch order, workloads, best ranks) of MoE layer ordinal ``layer`` at ``step``."""
        s = self.actual.segment(step * self.num_layers + layer)
        return self.actual.expert[s], self.actual.count[s], self.actual.rank[s]

    def step_token_ids(self, step: int) -> np.ndarray:
        """Indices of the step's tokens among the trace's tokens sorted by (seq_id, pos), in that order."""
        return self._step_token_order[self._step_token_ptr[step]:self._step_token_ptr[step + 1]]

    def step_positions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(seq_id, pos) of each of the step's tokens, in :meth:`step_token_ids` order."""
        tokens = self.step_token_ids(step)
        return self._token_seq[tokens], self._token_pos[tokens]

    def routing(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Per token of the step (in :meth:`step_token_ids` order) at MoE layer ordinal ``layer``: (T, top_k)
        expert ids in rank order and (T, top_k) gate weights (None if the trace has none)."""
        rows = self._file_rows(self.step_token_ids(step) * self.num_layers + layer)
        weights = self._trace.weights
        return self._trace.experts[rows], (weights[rows] if weights is not None else None)

    def predicted_counts(self, name: str, step: int, layer: int) -> np.ndarray:
        """(E,) number of the step's tokens whose predicted top-k for MoE layer ``layer`` holds each
        expert, as predicted ``offset`` layers earlier; all zeros where nothing predicts that layer."""
        if name not in self.predicted:
            raise KeyError(f"predictor {name!r} was not loaded into this workload")
        sc = self.predicted[name]
        s = sc.segment(step * self.num_layers + layer)
        out = np.zeros(self.num_experts, np.float64)
        out[sc.expert[s]] = sc.count[s]
        return out

    def predicted_ranks(self, name: str, step: int, layer: int) -> np.ndarray:
        """(E,) best rank (0 = highest predicted logit) each expert had in the predicted top-k of the
        step's tokens for MoE layer ``layer``; ``top_k`` where it was not predicted."""
        sc = self.predicted[name]
        s = sc.segment(step * self.num_layers + layer)
        out = np.full(self.num_experts, self.top_k, np.int64)
        out[sc.expert[s]] = sc.rank[s]
        return out

    def frequencies(self) -> np.ndarray:
        """(L, E) total workload of each expert over the whole trace (for frequency-based policies)."""
        return self._frequencies.copy()

    @property
    def max_batch_context(self) -> int:
        """Largest KV-cache length of any step (for memory accounting)."""
        return int(self.step_kv.max())

    def describe(self) -> dict:
        return {
            "steps": self.num_steps,
            "prefill_steps": int((self.step_phase == PREFILL).sum()),
            "decode_steps": int((self.step_phase == DECODE).sum()),
            "batches": int(self.sequences["batch"].max()) + 1,
            "sequences": len(self.sequences),
            "tokens": int(self.step_tokens.sum()),
        }
