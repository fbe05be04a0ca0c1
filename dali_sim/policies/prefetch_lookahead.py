"""Lookahead prefetching: the next layer's experts with the largest *predicted* token count.

One implementation, registered under several names that differ only in their default config:

* ``lookahead``: the generic form, any column (``prefetch.predictor``, default ``residual``), every
  predicted expert by default (``k=0``);

* ``dali-residual``: DALI's Residual-Based Prefetching (arXiv 2602.03495). Layer l+1's gate applied to
  (layer l's gate input + a per-layer residual vector calibrated on text) predicts each token's top-k
  at layer l+1; the prefetcher takes the k experts with the largest predicted token count. Reads the
  trace's ``lookahead:residual`` column (``dali trace record`` records it with a calibrated residual,
  ``dali trace synth --lookahead residual=ACC`` makes a synthetic one).
* ``next-gate``: the speculative prefetch of mixtral-offloading and AdapMoE: layer l+1's gate applied
  to layer l's gate input as is (column ``lookahead:next-gate``); every predicted expert by default.
  mixtral-offloading describes it in its tech report (arXiv 2312.17238) but its released code
  (``dvmazur/mixtral-offloading``) lists it as future work; AdapMoE's code (``PKU-SEC-Lab/AdapMoE``
  ``src/custom_layers.py`` ``SparseMoeWrapper.forward``, ``src/linear_cache.py`` ``LinearCache.check``)
  prefetches, in batch-1 decode only, the first of the next layer's predicted top-2 that is not cached,
  one expert at most: ``decode_only=true`` with ``memory.prefetch_slots=1`` (the runtime skips resident
  experts and fills the free buffers in the order given, best predicted rank first).

The predicted count of an expert at layer l+1 is the number of the step's tokens whose predicted
top-k at l+1 holds it (built by the workload builder from the column's logits). Experts predicted for
no token are never prefetched; ties in the count go to the lower id. The runtime skips experts
already resident or prefetched and drops what does not fit ``memory.prefetch_slots``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import (
    PREFETCHERS,
    LayerView,
    PolicyConfig,
    PrefetchPolicy,
    registered,
)
from dali_sim.trace.schema import PREFILL

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # the trace format's predictor names


@dataclass(frozen=True)
class LookaheadConfig(PolicyConfig):
    predictor: str = field(default="residual", metadata={
        "help": "lookahead column of the trace to read (lookahead:<predictor>): residual, next-gate, ..."})
    k: int = field(default=0, metadata={
        "help": "prefetch the k experts of the next layer with the largest predicted token count; "
                "0 = every expert predicted for at least one token"})

    def __post_init__(self) -> None:
        if not isinstance(self.predictor, str) or not _NAME.match(self.predictor):
            raise ValueError(f"prefetch.predictor must be a lookahead column name (letters, digits, '-', '_', '.'), "
                             f"got {self.predictor!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"prefetch.k must be an integer >= 0 (0 = every predicted expert), got {self.k!r}")


@functools.lru_cache(maxsize=8)
def _no_rank(n: int) -> np.ndarray:
    """(n,) zeros: the rank key of :func:`top_predicted` without ranks (read-only: shared)."""
    z = np.zeros(n, np.int64)
    z.flags.writeable = False
    return z


def top_predicted(counts: np.ndarray, k: int, rank: np.ndarray | None = None) -> np.ndarray:
    """Experts by descending predicted count (ties: best predicted rank when ``rank`` is given, then
    lower id), those with count 0 left out, at most ``k`` (0 = all)."""
    counts = np.asarray(counts)
    kernel = kernels.fused("top_predicted")
    if kernel is not None and counts.ndim == 1 and counts.dtype == np.float64 and (
            rank is None or np.shape(rank) == counts.shape):  # the same order in one compiled call
        return kernel(counts, _no_rank(counts.shape[0]) if rank is None else np.asarray(rank), int(k))
    ids = np.flatnonzero(counts > 0)  # (sorted after the filter: the same order as filtering the sort)
    c = counts[ids]
    order = ids[np.lexsort((ids, np.asarray(rank)[ids], -c)) if rank is not None else np.lexsort((ids, -c))]
    return order[:k] if k > 0 else order


@registered(PREFETCHERS)
class LookaheadPrefetch(PrefetchPolicy[LookaheadConfig]):
    """Top-k of the next MoE layer by predicted token count from any lookahead column (the shared
    implementation; ``dali-residual`` and ``next-gate`` only change the defaults)."""

    name = "lookahead"
    description = ("the next layer's experts with the largest predicted token count from any lookahead column "
                   "(prefetch.predictor); every predicted expert by default")
    Config = LookaheadConfig

    def required_predictors(self) -> tuple[str, ...]:
        return (self.config.predictor,)

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        target = view.layer + 1
        if target >= view.num_layers:
            return []
        keeps_all = type(self).keep is LookaheadPrefetch.keep
        sparse = kernels.fused("top_pairs_sparse") if keeps_all and view.lookahead_segment is not None else None
        if sparse is not None:  # the same requests from the predicted experts alone, in one compiled call
            return sparse(*view.lookahead_segment(self.config.predictor, target), int(self.config.k), target)
        counts = view.lookahead(self.config.predictor, target)
        rank = view.lookahead_rank(self.config.predictor, target) if view.lookahead_rank else None
        pairs = kernels.fused("top_pairs") if keeps_all else None
        if pairs is not None and counts.dtype == np.float64 and counts.ndim == 1 and rank is not None \
                and rank.dtype == np.int64 and rank.shape == counts.shape:
            return pairs(counts, rank, int(self.config.k), target)  # (m, 2) requests in one compiled call
        chosen = top_predicted(counts, self.config.k, rank).tolist()
        if keeps_all:
            return [(target, e) for e in chosen]
        return [(target, e) for e in chosen if self.keep(view, int(counts[e]))]

    def top_k_form(self) -> tuple[str, int] | None:
        cls = type(self)
        plain = cls.keep is LookaheadPrefetch.keep and cls.prefetch is LookaheadPrefetch.prefetch
        return (self.config.predictor, int(self.config.k)) if plain else None

    def keep(self, view: LayerView, predicted_tokens: int) -> bool:
        """Whether to copy a chosen expert with this predicted workload (here: always)."""
        return True


@dataclass(frozen=True)
class DaliResidualConfig(LookaheadConfig):
    predictor: str = field(default="residual", metadata={
        "help": "lookahead column with the residual-corrected next-gate prediction (lookahead:<predictor>)"})
    k: int = field(default=1, metadata={
        "help": "prefetch the k experts of the next layer with the largest predicted token count "
                "(paper: 1 for Mixtral, 4 for DeepSeek and Qwen); 0 = every predicted expert"})


@registered(PREFETCHERS)
class DaliResidualPrefetch(LookaheadPrefetch):
    name = "dali-residual"
    description = ("DALI's residual-based prefetching: the k experts of the next layer with the largest token count "
                   "predicted by its gate on (gate input + calibrated residual); column lookahead:residual")
    Config = DaliResidualConfig


@dataclass(frozen=True)
class NextGateConfig(LookaheadConfig):
    predictor: str = field(default="next-gate", metadata={
        "help": "lookahead column with the next layer's gate applied to this layer's gate input"})
    decode_only: bool = field(default=False, metadata={
        "help": "prefetch in decode steps only (AdapMoE's and HybriMoE's code prefetch in batch-1 decode only)"})


@registered(PREFETCHERS)
class NextGatePrefetch(LookaheadPrefetch):
    name = "next-gate"
    description = ("speculative next-gate prefetching (mixtral-offloading, AdapMoE): the next layer's gate on this "
                   "layer's gate input; every predicted expert by default; column lookahead:next-gate")
    Config = NextGateConfig

    def keep(self, view: LayerView, predicted_tokens: int) -> bool:
        # a plain LookaheadConfig (no decode_only field) prefetches in every phase
        return not (getattr(self.config, "decode_only", False) and view.phase == PREFILL)
