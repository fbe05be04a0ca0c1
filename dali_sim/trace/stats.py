"""Statistics of a routing trace: expert popularity, temporal reuse, cross-layer predictability and
lookahead (prediction) accuracy.

Every function takes a :class:`~dali_sim.trace.Trace` (or a path, read and validated) and returns a
pandas DataFrame; :func:`summary` gathers them into one JSON-ready dict and :func:`format_text` renders
that dict for people. The exact definitions are in ``docs/statistics.md``; the short version:

* layers are named by their block index (``trace.meta.layers``), rows of a frame are ordered by it;
* an expert's *count* at a layer is the number of rows (tokens) whose top-k contains it (all ranks);
* *reuse* of a row is ``|E(t) ∩ E(t-1)| / k`` where t-1 is position ``pos - 1`` of the same sequence at
  the same layer; rows without such a predecessor are excluded (a layer with none gets NaN);
* *cross-layer* statistics pair the rows of one token at consecutive MoE layers; the co-occurrence
  predictor is fitted and scored on the same rows (in-sample: optimistic for that predictor);
* *lookahead* recall of a row is ``|top_k(predicted logits) ∩ E(target row)| / k``; rows without a
  prediction or without a target row are excluded.

Ties are always broken towards the lower expert id. Row order in the file does not matter: rows are
keyed by (seq_id, pos, MoE-layer ordinal) and sorted once. Nothing loops over tokens in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dali_sim.trace.reader import Trace, read_trace
from dali_sim.trace.schema import PHASES, TraceError
from dali_sim.jsonsafe import json_safe

__all__ = [
    "crosslayer", "expert_counts", "format_text", "lookahead_accuracy", "popularity", "reuse", "summary",
    "token_counts",
]

#: cells (rows x experts) of one working block in the chunked (n, E) computations
_CHUNK_CELLS = 1 << 22

POPULARITY_COLUMNS = ["tokens", "entropy_bits", "entropy_norm", "gini", "top1_share", "topk_share",
                      "max_over_mean", "experts_50pct", "experts_90pct", "unused"]
REUSE_COLUMNS = ["overall", "prefill", "decode", "pairs", "pairs_prefill", "pairs_decode", "indep_baseline"]
CROSSLAYER_COLUMNS = ["next_layer", "tokens", "cooc_recall", "popular_recall", "top1_mi_bits", "top1_nmi",
                      "top1_cond_acc"]
LOOKAHEAD_COLUMNS = ["source_layer", "target_offset", "rows", "recall", "recall_prefill", "recall_decode",
                     "top1_acc", "unpredicted"]


# ---- preparation: one sort per trace ----------------------------------------------------------
@dataclass
class _Prepared:
    """Rows sorted by (seq_id, pos, MoE-layer ordinal), with an int64 key that encodes that triple."""

    trace: Trace
    order: np.ndarray | None  # file row of each sorted row; None when the file is already sorted
    key: np.ndarray  # (seq * P + pos) * L + li, strictly the sort key
    pos: np.ndarray
    li: np.ndarray  # MoE-layer ordinal 0..L-1
    phase: np.ndarray  # 0 prefill, 1 decode
    experts: np.ndarray  # (n, k) int64
    layers: tuple[int, ...]
    num_experts: int
    top_k: int

    @property
    def L(self) -> int:
        return len(self.layers)

    @property
    def n(self) -> int:
        return len(self.key)

    def take(self, values: np.ndarray) -> np.ndarray:
        return values if self.order is None else values[self.order]

    def find(self, query: np.ndarray, valid: np.ndarray, shift: int = 0) -> np.ndarray:
        """Sorted row index holding key ``query[i]`` where ``valid[i]``; -1 where absent or not valid.

        ``shift``: where the row usually is relative to i (in a complete trace: -L for the previous
        token, +d for d layers later); tried first, binary search only for the rest."""
        out = np.full(query.shape, -1, dtype=np.int64)
        if self.n == 0:
            return out
        if shift:
            cand = np.arange(self.n, dtype=np.int64) + shift
            ok = valid & (cand >= 0) & (cand < self.n)
            ok[ok] = self.key[cand[ok]] == query[ok]
            out[ok] = cand[ok]
            valid = valid & ~ok
        where = np.flatnonzero(valid)
        q = query[where]
        idx = np.searchsorted(self.key, q)
        hit = idx < self.n
        hit[hit] = self.key[idx[hit]] == q[hit]
        out[where[hit]] = idx[hit]
        return out


def _as_trace(trace: Trace | str | Path) -> Trace:
    if isinstance(trace, Trace):
        return trace
    if isinstance(trace, (str, Path)):
        return read_trace(trace)
    raise TypeError(f"expected a Trace or a path, got {type(trace).__name__}")


def _prepare(trace: Trace | str | Path | _Prepared) -> _Prepared:
    if isinstance(trace, _Prepared):
        return trace
    trace = _as_trace(trace)
    where = str(trace.path or "trace")
    layers = tuple(int(x) for x in trace.meta.layers)
    L, E, k = len(layers), int(trace.num_experts), int(trace.top_k)
    seq = trace.seq_id.astype(np.int64)
    pos = trace.pos.astype(np.int64)
    layer = trace.layer.astype(np.int64)
    li = np.searchsorted(np.asarray(layers, dtype=np.int64), layer)
    phase = trace.phase.astype(np.int8)
    experts = trace.experts.astype(np.int64)
    n = len(seq)
    if n:
        # cheap guards for traces read with validate=False (the reader checks all of this by default)
        bad = (li >= L) | (np.asarray(layers, dtype=np.int64)[np.minimum(li, L - 1)] != layer)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceError(f"{where}: row {i}: layer {int(layer[i])} is not an MoE layer {list(layers)}")
        if seq.min() < 0 or pos.min() < 0:
            raise TraceError(f"{where}: negative seq_id or pos")
        if ((phase < 0) | (phase >= len(PHASES))).any():
            raise TraceError(f"{where}: phase is not prefill or decode")
        if experts.min() < 0 or experts.max() >= E:
            raise TraceError(f"{where}: expert id out of range 0..{E - 1}")
        P = int(pos.max()) + 1
        if (int(seq.max()) + 1) * P * L >= 2**62:  # sparse ids: use the dense rank of seq_id instead
            seq = np.unique(seq, return_inverse=True)[1].astype(np.int64)
            if (int(seq.max()) + 1) * P * L >= 2**62:
                raise ValueError(f"{where}: too many (sequence, position) pairs to key in 64 bits")
        key = (seq * P + pos) * L + li
    else:
        key = np.zeros(0, dtype=np.int64)
    order = None
    if n > 1 and bool((key[1:] < key[:-1]).any()):
        order = np.argsort(key, kind="stable")
        key, pos, li, phase, experts = key[order], pos[order], li[order], phase[order], experts[order]
    return _Prepared(trace, order, key, pos, li, phase, experts, layers, E, k)


# ---- small vectorised helpers -------------------------------------------------------------------
def _phase_code(phase: str | None) -> int | None:
    if phase is None:
        return None
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES} or None, got {phase!r}")
    return PHASES.index(phase)


def _topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """(n, E) bool mask of the k highest scores of each row; ties go to the lower expert id."""
    n, E = scores.shape
    if k >= E:
        return np.ones((n, E), dtype=bool)
    kth = np.partition(scores, E - k, axis=1)[:, E - k]  # the k-th largest value of each row
    gt = scores > kth[:, None]
    eq = scores == kth[:, None]
    need = k - gt.sum(axis=1)
    mask = gt | eq
    tied = np.flatnonzero(eq.sum(axis=1) > need)  # more candidates at the k-th value than free slots
    if tied.size:
        eq_t = eq[tied]
        mask[tied] = gt[tied] | (eq_t & (np.cumsum(eq_t, axis=1) <= need[tied, None]))
    return mask


def _id_mask(ids: np.ndarray, E: int) -> np.ndarray:
    """(n, k) expert ids -> (n, E) membership mask."""
    m = np.zeros((ids.shape[0], E), dtype=bool)
    m[np.arange(ids.shape[0])[:, None], ids] = True
    return m


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a_i ∩ b_i| per row for (n, k) id arrays without repeated ids within a row."""
    out = np.zeros(a.shape[0], dtype=np.int64)
    for j in range(a.shape[1]):
        out += (a[:, j:j + 1] == b).any(axis=1)
    return out


def _chunks(n: int, width: int):
    step = max(1024, _CHUNK_CELLS // max(1, width))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Shannon entropy (bits) of each row of a count matrix; NaN for an all-zero row."""
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = c / total
        terms = np.where(c > 0, p * np.log2(np.where(c > 0, p, 1.0)), 0.0)
    h = -terms.sum(axis=-1)
    h = np.where(total[..., 0] > 0, h, np.nan)
    return np.abs(h)  # turns -0.0 into 0.0


def _ratio(num, den) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _layer_index(p: _Prepared, name: str = "layer") -> pd.Index:
    return pd.Index(list(p.layers), name=name)


# ---- public API ---------------------------------------------------------------------------------
def token_counts(trace: Trace | str | Path) -> dict[str, int]:
    """Distinct (seq_id, pos) tokens per phase, plus ``total``; a token's phase is that of its rows."""
    p = _prepare(trace)
    if p.n == 0:
        return {**{ph: 0 for ph in PHASES}, "total": 0}
    token = p.key // p.L
    first = np.concatenate(([True], token[1:] != token[:-1]))
    per_phase = np.bincount(p.phase[first], minlength=len(PHASES))
    return {**{ph: int(per_phase[i]) for i, ph in enumerate(PHASES)}, "total": int(first.sum())}


def _counts_by_phase(p: _Prepared) -> np.ndarray:
    """(phases, L, E) expert counts."""
    L, E = p.L, p.num_experts
    flat = ((p.phase.astype(np.int64)[:, None] * L + p.li[:, None]) * E + p.experts).reshape(-1)
    return np.bincount(flat, minlength=len(PHASES) * L * E).reshape(len(PHASES), L, E)


def expert_counts(trace: Trace | str | Path, phase: str | None = None) -> pd.DataFrame:
    """Layer x expert table: rows whose top-k contains the expert (every rank counts once).

    ``phase`` = ``"prefill"`` / ``"decode"`` restricts to rows of that phase. Each layer's counts sum to
    top_k x its rows.
    """
    p = _prepare(trace)
    code = _phase_code(phase)
    by_phase = _counts_by_phase(p)
    counts = by_phase.sum(axis=0) if code is None else by_phase[code]
    return pd.DataFrame(counts.astype(np.int64), index=_layer_index(p),
                        columns=pd.RangeIndex(p.num_experts, name="expert"))


def popularity_from_counts(counts: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The :func:`popularity` columns for a (layers, experts) count matrix from any source."""
    L, E = counts.shape
    total = counts.sum(axis=1)  # = k x rows
    tokens = total // k
    h = _entropy_bits(counts)
    asc = np.sort(counts, axis=1)
    desc = asc[:, ::-1]
    coef = 2 * np.arange(1, E + 1) - E - 1
    gini = _ratio((coef * asc).sum(axis=1), E * total)
    cum = np.cumsum(desc, axis=1)

    def experts_for(pct: int) -> np.ndarray:
        # the fewest most-popular experts whose counts reach pct % of the activations (exact integers)
        # (0 for a layer without rows)
        m = np.argmax(cum * 100 >= pct * total[:, None], axis=1) + 1
        return np.where(total > 0, m, 0).astype(np.int64)

    return {
        "tokens": tokens.astype(np.int64),
        "entropy_bits": h,
        "entropy_norm": h / math.log2(E) if E > 1 else np.full(L, np.nan),
        "gini": gini,
        "top1_share": _ratio(desc[:, 0], total),
        "topk_share": _ratio(desc[:, :k].sum(axis=1), total),
        "max_over_mean": _ratio(desc[:, 0] * E, total),
        "experts_50pct": experts_for(50),
        "experts_90pct": experts_for(90),
        "unused": np.where(total > 0, (counts == 0).sum(axis=1), E).astype(np.int64),
    }


def popularity(trace: Trace | str | Path, phase: str | None = None) -> pd.DataFrame:
    """Per layer: how unevenly the tokens spread over the experts (see docs/statistics.md).

    Columns: tokens (rows at the layer), entropy_bits (Shannon entropy of the activation shares
    c_e / sum c), entropy_norm (/ log2 E), gini (of the count vector), top1_share and topk_share
    (activation share of the 1 and the k most used experts), max_over_mean (max count / mean count),
    experts_50pct / experts_90pct (fewest experts covering 50 % / 90 % of activations), unused.
    """
    p = _prepare(trace)
    counts = expert_counts(p, phase).to_numpy()
    return pd.DataFrame(popularity_from_counts(counts, p.top_k), index=_layer_index(p))[POPULARITY_COLUMNS]


def reuse(trace: Trace | str | Path, lag: int = 1) -> pd.DataFrame:
    """Per layer temporal reuse: mean of |E(t) ∩ E(t-lag)| / k over rows whose predecessor (same sequence,
    pos - lag, same layer) is in the trace; split by the phase of row t. ``pairs*`` count those rows.
    ``lag`` (default 1, what :func:`summary` reports) is the distance in positions.
    ``indep_baseline`` = sum_e f_e^2 / k with f_e = count_e / rows: the expected reuse if consecutive
    tokens were independent draws with the layer's (in-sample) expert frequencies (it does not depend
    on ``lag``)."""
    if isinstance(lag, bool) or not isinstance(lag, (int, np.integer)) or lag < 1:
        raise ValueError(f"lag must be an integer >= 1, got {lag!r}")
    p = _prepare(trace)
    L, k = p.L, p.top_k
    prev = p.find(p.key - L * int(lag), p.pos >= lag, shift=-L * int(lag))
    has = prev >= 0
    ov = _overlap(p.experts[has], p.experts[prev[has]])
    li, ph = p.li[has], p.phase[has]
    n_pl = np.bincount(ph.astype(np.int64) * L + li, minlength=len(PHASES) * L).reshape(len(PHASES), L)
    s_pl = np.bincount(ph.astype(np.int64) * L + li, weights=ov, minlength=len(PHASES) * L).reshape(len(PHASES), L)
    counts = _counts_by_phase(p).sum(axis=0).astype(np.float64)
    rows = counts.sum(axis=1) / k
    f = counts / np.where(rows > 0, rows, 1.0)[:, None]
    indep = np.where(rows > 0, (f ** 2).sum(axis=1) / k, np.nan)
    data = {
        "overall": _ratio(s_pl.sum(axis=0), k * n_pl.sum(axis=0)),
        "prefill": _ratio(s_pl[0], k * n_pl[0]),
        "decode": _ratio(s_pl[1], k * n_pl[1]),
        "pairs": n_pl.sum(axis=0).astype(np.int64),
        "pairs_prefill": n_pl[0].astype(np.int64),
        "pairs_decode": n_pl[1].astype(np.int64),
        "indep_baseline": indep,
    }
    return pd.DataFrame(data, index=_layer_index(p))[REUSE_COLUMNS]


def _pooled_reuse(frame: pd.DataFrame) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for col, pairs in (("overall", "pairs"), ("prefill", "pairs_prefill"), ("decode", "pairs_decode")):
        n = int(frame[pairs].sum())
        s = float((frame[col].fillna(0.0) * frame[pairs]).sum())
        out[col] = s / n if n else math.nan
        out[pairs] = n
    return out


def _mutual_information(x: np.ndarray, y: np.ndarray, E: int) -> tuple[float, float, float]:
    """(I(X;Y) bits, H(X), H(Y)) of the plug-in (empirical) joint distribution."""
    joint = np.bincount(x * E + y, minlength=E * E).astype(np.float64)
    hx = float(_entropy_bits(np.bincount(x, minlength=E)))
    hy = float(_entropy_bits(np.bincount(y, minlength=E)))
    hxy = float(_entropy_bits(joint))
    return max(0.0, hx + hy - hxy), hx, hy


def crosslayer(trace: Trace | str | Path) -> pd.DataFrame:
    """Per consecutive MoE layer pair (layer, next_layer), over the tokens that have both rows:

    * cooc_recall: mean |top_k(s(t)) ∩ E_next(t)| / k, s_b(t) = sum over a in E_layer(t) of C[a, b],
      C[a, b] = tokens with a in E_layer and b in E_next. Fitted on the scored rows (in-sample), so an
      optimistic figure for this predictor, not a bound over all predictors.
    * popular_recall: the same with the k most frequent next-layer experts predicted for every token.
    * top1_mi_bits / top1_nmi: mutual information of the rank-0 ids (plug-in estimate, biased upwards
      on few tokens), normalised by the arithmetic mean of the two entropies (sklearn's default).
    * top1_cond_acc: in-sample accuracy of predicting the next rank-0 id as the most frequent one
      given this layer's rank-0 id.
    """
    p = _prepare(trace)
    L, E, k = p.L, p.num_experts, p.top_k
    nxt = p.find(p.key + 1, p.li < L - 1, shift=1)
    rows: list[dict[str, Any]] = []
    src_all = np.flatnonzero(nxt >= 0)
    by_layer = src_all[np.argsort(p.li[src_all], kind="stable")]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(p.li[src_all], minlength=L))))
    for i in range(L - 1):
        src = by_layer[bounds[i]:bounds[i + 1]]
        T = len(src)
        row: dict[str, Any] = {"layer": p.layers[i], "next_layer": p.layers[i + 1], "tokens": T}
        if T == 0:
            rows.append({**row, **{c: math.nan for c in CROSSLAYER_COLUMNS[2:]}})
            continue
        X, Y = p.experts[src], p.experts[nxt[src]]
        C = np.zeros(E * E, dtype=np.int64)
        for j in range(k):  # C[a, b] += 1 for every (a in X[t], b in Y[t])
            C += np.bincount((X[:, j:j + 1] * E + Y).reshape(-1), minlength=E * E)
        C = C.reshape(E, E).astype(np.float64)  # integers < 2**53: exact in float64
        hits = 0
        for sl in _chunks(T, E):
            # (chunk, E): the sum of the C rows of X[t], as a BLAS product (10x faster than a gather)
            scores = _id_mask(X[sl], E).astype(np.float64) @ C
            hits += int((_topk_mask(scores, k) & _id_mask(Y[sl], E)).sum())
        next_counts = np.bincount(Y.reshape(-1), minlength=E)
        popular = _topk_mask(next_counts[None, :], k)[0]
        mi, hx, hy = _mutual_information(X[:, 0], Y[:, 0], E)
        joint = np.bincount(X[:, 0] * E + Y[:, 0], minlength=E * E).reshape(E, E)
        row.update(
            cooc_recall=hits / (k * T),
            popular_recall=float(next_counts[popular].sum()) / (k * T),
            top1_mi_bits=mi,
            top1_nmi=mi / ((hx + hy) / 2) if hx + hy > 0 else math.nan,
            top1_cond_acc=float(joint.max(axis=1).sum()) / T,
        )
        rows.append(row)
    frame = pd.DataFrame(rows, columns=["layer", *CROSSLAYER_COLUMNS])
    frame["layer"] = frame["layer"].astype(np.int64)
    frame["next_layer"] = frame["next_layer"].astype(np.int64)
    frame["tokens"] = frame["tokens"].astype(np.int64)
    return frame.set_index("layer")


def _lookahead(p: _Prepared) -> tuple[pd.DataFrame, dict[str, dict[str, Any]]]:
    L, E, k = p.L, p.num_experts, p.top_k
    frames = []
    pooled: dict[str, dict[str, Any]] = {}
    for name, info in p.trace.meta.predictors.items():
        d = int(info.target_offset)
        logits = p.take(p.trace.lookahead(name))
        present = ~np.isnan(logits).all(axis=1) if p.n else np.zeros(0, dtype=bool)
        in_range = (p.li + d >= 0) & (p.li + d < L)
        tgt = p.find(p.key + d, in_range, shift=d)
        has_target = tgt >= 0
        use = np.flatnonzero(present & has_target)
        unpredicted = np.bincount(p.li[has_target & ~present] + d, minlength=L)
        hits = np.zeros(len(use), dtype=np.int64)
        top1 = np.zeros(len(use), dtype=bool)
        for sl in _chunks(len(use), E):
            rows = use[sl]
            x = logits[rows]
            true = p.experts[tgt[rows]]
            hits[sl] = (_topk_mask(x, k) & _id_mask(true, E)).sum(axis=1)
            top1[sl] = np.argmax(x, axis=1) == true[:, 0]
        t_layer = p.li[use] + d
        ph = p.phase[use].astype(np.int64)
        n_pl = np.bincount(ph * L + t_layer, minlength=len(PHASES) * L).reshape(len(PHASES), L)
        s_pl = np.bincount(ph * L + t_layer, weights=hits, minlength=len(PHASES) * L).reshape(len(PHASES), L)
        t1 = np.bincount(t_layer, weights=top1, minlength=L)
        n_l, s_l = n_pl.sum(axis=0), s_pl.sum(axis=0)
        targets = [j for j in range(L) if 0 <= j - d < L]
        frames.append(pd.DataFrame({
            "predictor": name,
            "layer": np.array([p.layers[j] for j in targets], dtype=np.int64),
            "source_layer": np.array([p.layers[j - d] for j in targets], dtype=np.int64),
            "target_offset": d,
            "rows": n_l[targets].astype(np.int64),
            "recall": _ratio(s_l, k * n_l)[targets],
            "recall_prefill": _ratio(s_pl[0], k * n_pl[0])[targets],
            "recall_decode": _ratio(s_pl[1], k * n_pl[1])[targets],
            "top1_acc": _ratio(t1, n_l)[targets],
            "unpredicted": unpredicted[targets].astype(np.int64),
        }))
        n_all = len(use)
        pooled[name] = {
            "target_offset": d,
            "description": info.description,
            "rows": n_all,
            "recall": float(hits.sum()) / (k * n_all) if n_all else math.nan,
            "recall_prefill": float(s_pl[0].sum()) / (k * n_pl[0].sum()) if n_pl[0].sum() else math.nan,
            "recall_decode": float(s_pl[1].sum()) / (k * n_pl[1].sum()) if n_pl[1].sum() else math.nan,
            "top1_acc": float(top1.sum()) / n_all if n_all else math.nan,
            "unpredicted": int(unpredicted.sum()),
        }
    if frames:
        frame = pd.concat(frames, ignore_index=True)
    else:
        frame = pd.DataFrame({"predictor": pd.Series(dtype=object), "layer": pd.Series(dtype=np.int64),
                              **{c: pd.Series(dtype=np.float64) for c in LOOKAHEAD_COLUMNS}})
    return frame.set_index(["predictor", "layer"])[LOOKAHEAD_COLUMNS], pooled


def lookahead_accuracy(trace: Trace | str | Path) -> pd.DataFrame:
    """Per (predictor, target layer): top-k recall of the lookahead columns.

    A row at MoE layer l carries predicted router logits of layer l + target_offset of the same token;
    its recall is |top_k(logits) ∩ E(target row)| / k (ties to the lower id; with both sets of size k,
    recall = precision). Rows with a null prediction but an existing target count as ``unpredicted``
    and are excluded, as are rows whose target row is absent. ``layer`` is the target (predicted)
    layer, ``source_layer`` the layer whose row holds the prediction. ``top1_acc``: the predicted argmax
    equals the target's rank-0 expert. An empty frame when the trace has no lookahead columns.
    """
    return _lookahead(_prepare(trace))[0]


# ---- summary and rendering ----------------------------------------------------------------------
def _columns(frame: pd.DataFrame) -> dict[str, list]:
    return {c: frame[c].tolist() for c in frame.columns}


def summary(trace: Trace | str | Path) -> dict[str, Any]:
    """All statistics as one JSON-ready dict (NaN -> None). Lists under ``expert_counts``,
    ``popularity``, ``reuse`` and ``lookahead[...]["per_layer"]`` are aligned with ``layers``;
    ``crosslayer`` lists run over the ``num_layers - 1`` consecutive pairs."""
    p = _prepare(trace)
    t = p.trace
    counts = expert_counts(p)
    pop = popularity(p)
    reu = reuse(p)
    cross = crosslayer(p)
    look, pooled = _lookahead(p)
    lookahead: dict[str, Any] = {}
    for name, info in pooled.items():
        sub = look[look.index.get_level_values("predictor") == name].droplevel("predictor")
        sub = sub.reindex(pd.Index(list(p.layers), name="layer"))
        sub = sub.drop(columns=["target_offset"])
        per_layer = _columns(sub)
        per_layer["rows"] = [0 if (isinstance(v, float) and math.isnan(v)) else int(v) for v in per_layer["rows"]]
        per_layer["unpredicted"] = [0 if (isinstance(v, float) and math.isnan(v)) else int(v)
                                    for v in per_layer["unpredicted"]]
        per_layer["source_layer"] = [None if (isinstance(v, float) and math.isnan(v)) else int(v)
                                     for v in per_layer["source_layer"]]
        lookahead[name] = {**info, "per_layer": per_layer}
    out = {
        "trace": str(t.path) if t.path is not None else None,
        "status": t.meta.status,
        "model": t.meta.model.name,
        "num_layers": p.L,
        "layers": list(p.layers),
        "num_experts": p.num_experts,
        "top_k": p.top_k,
        "rows": p.n,
        "sequences": int(np.unique(t.seq_id).size),
        "tokens": token_counts(p),
        "expert_counts": counts.to_numpy().tolist(),
        "popularity": _columns(pop),
        "reuse": {**_columns(reu), "pooled": _pooled_reuse(reu), "random_baseline": p.top_k / p.num_experts},
        "crosslayer": {"layer": cross.index.tolist(), **_columns(cross)},
        "lookahead": lookahead,
    }
    return json_safe(out)


def _fmt(v: Any, width: int = 6, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    if isinstance(v, float):
        return f"{v:>{width}.{digits}f}"
    return f"{v:>{width}}"


def format_text(s: dict[str, Any]) -> str:
    """A short human-readable rendering of :func:`summary`'s dict."""
    tok = s["tokens"]
    lines = [
        f"trace       {s['trace'] or '<memory>'} ({s['status']})",
        f"model       {s['model']}: {s['num_layers']} MoE layers, {s['num_experts']} experts, top-{s['top_k']}",
        f"rows        {s['rows']:,}   sequences {s['sequences']:,}   tokens {tok['total']:,} "
        f"(prefill {tok['prefill']:,}, decode {tok['decode']:,})",
        "",
        "per layer: popularity (entropy normalised by log2 E; Gini of the counts; share of the top expert),",
        "           reuse = |E(t) ∩ E(t-1)| / k (overall / prefill / decode; indep = independent-draw reference)",
        f"{'layer':>5} {'tokens':>8} {'H/logE':>6} {'gini':>6} {'top1':>6} "
        f"{'reuse':>6} {'pre':>6} {'dec':>6} {'indep':>6}",
    ]
    pop, reu = s["popularity"], s["reuse"]
    for i, layer in enumerate(s["layers"]):
        lines.append(
            f"{layer:>5} {pop['tokens'][i]:>8} {_fmt(pop['entropy_norm'][i])} {_fmt(pop['gini'][i])} "
            f"{_fmt(pop['top1_share'][i])} {_fmt(reu['overall'][i])} {_fmt(reu['prefill'][i])} "
            f"{_fmt(reu['decode'][i])} {_fmt(reu['indep_baseline'][i])}"
        )
    pooled = reu["pooled"]
    lines.append(f"{'all':>5} {'':>8} {'':>6} {'':>6} {'':>6} {_fmt(pooled['overall'])} "
                 f"{_fmt(pooled['prefill'])} {_fmt(pooled['decode'])}   (random top-k: {reu['random_baseline']:.3f})")
    cross = s["crosslayer"]
    if cross["layer"]:
        lines += [
            "",
            "cross-layer (consecutive MoE layers; co-occurrence recall is in-sample, an optimistic figure):",
            f"{'pair':>9} {'tokens':>8} {'cooc':>6} {'popul':>6} {'NMI1':>6} {'acc1':>6}",
        ]
        for i, layer in enumerate(cross["layer"]):
            pair = f"{layer}->{cross['next_layer'][i]}"
            lines.append(f"{pair:>9} {cross['tokens'][i]:>8} {_fmt(cross['cooc_recall'][i])} "
                         f"{_fmt(cross['popular_recall'][i])} {_fmt(cross['top1_nmi'][i])} "
                         f"{_fmt(cross['top1_cond_acc'][i])}")
    if s["lookahead"]:
        lines += ["", "lookahead predictors (top-k recall of the predicted layer; per target layer):"]
        for name, d in s["lookahead"].items():
            lines.append(
                f"  {name} (+{d['target_offset']}): recall {_fmt(d['recall'], 0)} "
                f"(prefill {_fmt(d['recall_prefill'], 0)}, decode {_fmt(d['recall_decode'], 0)}), "
                f"top-1 {_fmt(d['top1_acc'], 0)}, {d['rows']:,} rows"
                + (f", {d['unpredicted']:,} unpredicted" if d["unpredicted"] else "")
            )
            pl = d["per_layer"]
            cells = [f"{layer}:{_fmt(pl['recall'][i], 0)}" for i, layer in enumerate(s["layers"])
                     if pl["rows"][i]]
            for start in range(0, len(cells), 8):
                lines.append("    " + "  ".join(cells[start:start + 8]))
    else:
        lines += ["", "lookahead predictors: none in this trace"]
    if s["num_experts"] <= 16:
        lines += ["", "expert counts (layer: count per expert id):"]
        for layer, row in zip(s["layers"], s["expert_counts"]):
            lines.append(f"{layer:>5}: " + " ".join(f"{c:>6}" for c in row))
    else:
        lines += ["", "per-expert counts: see --json (expert_counts)"]
    return "\n".join(lines)
