"""Workload builder: a trace's sequences -> batches -> steps -> per (step, MoE layer) expert workloads.

Sequences (in ``seq_id`` order) are grouped into batches of ``batch_size``. A batch runs its prefill
(one step, or one step per ``prefill_chunk`` prompt positions) and then decode steps while any of its
sequences still has a token; batches run one after another. The *workload* of an expert at a
(step, layer) is the number of the step's tokens routed to it.

Activated experts of each (step, layer) are stored sparsely in **touch order**: descending workload,
then best (lowest) rank among the step's tokens, then lower id. Cache policies see them in this order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dali_sim.models.spec import ModelSpec
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


def _sparse_counts(step: np.ndarray, layer: np.ndarray, ids: np.ndarray, ranks: np.ndarray,
                   num_steps: int, num_layers: int, num_experts: int) -> SparseCounts:
    """Group (step, layer, expert) occurrences; order each segment by (-count, best rank, id)."""
    seg = step.astype(np.int64) * num_layers + layer
    key = seg * num_experts + ids
    order = np.argsort(key, kind="stable")
    key_sorted = key[order]
    starts = np.flatnonzero(np.concatenate(([True], key_sorted[1:] != key_sorted[:-1]))) if key.size else np.array([], int)
    uniq = key_sorted[starts]
    counts = np.diff(np.append(starts, key.size)).astype(np.int32)
    best = np.minimum.reduceat(ranks[order], starts) if key.size else np.array([], np.int8)
    useg, expert = np.divmod(uniq, num_experts)
    touch = np.lexsort((expert, best, -counts, useg))
    useg, expert, counts, best = useg[touch], expert[touch], counts[touch], best[touch]
    ptr = np.searchsorted(useg, np.arange(num_steps * num_layers + 1), side="left").astype(np.int64)
    return SparseCounts(ptr, expert.astype(np.int16), counts, best.astype(np.int8))


def predicted_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """(tokens, k) expert ids a lookahead column's logits predict, in rank order: the k highest logits
    (NaN = never), highest first, ties to the lower id."""
    pred = np.nan_to_num(np.asarray(logits), nan=-np.inf)
    top = np.argpartition(-pred, k - 1, axis=1)[:, :k]
    top = np.sort(top, axis=1)
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(pred, top, 1), axis=1, kind="stable"), 1)


class Workload:
    """Steps of a trace under a batching configuration (see module docstring).

    Per step: ``phase`` (0 prefill / 1 decode), ``batch``, ``tokens``, ``context`` (mean number of
    earlier tokens, plus itself, that each query attends to) and ``kv_tokens`` (KV-cache entries read
    in the step, summed over its sequences). ``sequences`` is a DataFrame with one row per sequence:
    its batch, prompt and decode token counts and first/last step of each phase.
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
        t = trace.sorted()
        L = self.num_layers
        tok_seq = t.seq_id[::L].astype(np.int64)
        tok_pos = t.pos[::L].astype(np.int64)
        tok_phase = t.phase[::L]
        step_of_token, self.sequences = self._schedule(tok_seq, tok_pos, tok_phase, config)
        self.num_steps = int(step_of_token.max()) + 1
        self._token_step = step_of_token
        # per-token routing for runtimes that execute the steps (dali_exec): tokens in (seq_id, pos) order
        self._sorted = t
        self._token_seq, self._token_pos = tok_seq, tok_pos
        self._step_token_order = np.argsort(step_of_token, kind="stable")
        self._step_token_ptr = np.searchsorted(step_of_token[self._step_token_order], np.arange(self.num_steps + 1))
        self._step_arrays(step_of_token, tok_seq, tok_pos, tok_phase)

        k = self.top_k
        row_step = np.repeat(step_of_token, L)
        layer_idx = t.layer_index.astype(np.int64)
        self.actual = _sparse_counts(np.repeat(row_step, k), np.repeat(layer_idx, k), t.experts.reshape(-1),
                                     np.tile(np.arange(k, dtype=np.int8), len(t)), self.num_steps, L, self.num_experts)
        self.predicted: dict[str, SparseCounts] = {}
        self.predictor_offsets: dict[str, int] = {}
        for name in predictors:
            logits = t.lookahead(name)  # raises the uniform "no such column" message
            offset = t.meta.predictors[name].target_offset
            has = ~np.isnan(logits).all(axis=1) & (layer_idx + offset < L)
            top = predicted_top_k(logits[has], k)
            # the row at layer l predicts layer l + offset: index the prediction by its target layer
            self.predicted[name] = _sparse_counts(
                np.repeat(row_step[has], k), np.repeat(layer_idx[has] + offset, k), top.reshape(-1),
                np.tile(np.arange(k, dtype=np.int8), len(top)), self.num_steps, L, self.num_experts)
            self.predictor_offsets[name] = offset

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
        rows = self.step_token_ids(step) * self.num_layers + layer
        weights = self._sorted.weights
        return self._sorted.experts[rows], (weights[rows] if weights is not None else None)

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
        seg = np.repeat(np.arange(self.num_steps * self.num_layers), np.diff(self.actual.ptr))
        out = np.zeros((self.num_layers, self.num_experts), np.int64)
        np.add.at(out, (seg % self.num_layers, self.actual.expert.astype(np.int64)), self.actual.count)
        return out

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
