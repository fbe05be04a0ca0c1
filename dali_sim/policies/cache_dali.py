"""DALI's Workload-Aware Cache Replacement (arXiv 2602.03495): per-layer windowed workload scores.

Per MoE layer, the policy sums each expert's workload (tokens routed to it) over a window of ``w``
consecutive visits of the layer (one visit per step). At the end of the window (after the layer's
touches in its ``w``-th step) it swaps the ``u`` highest-scoring non-resident experts in for the ``u``
lowest-scoring resident ones, pairing the best outsider with the worst resident, the second best with
the second worst, and so on; a pair is swapped only if the outsider's score is strictly higher than
the resident's. Then the window starts afresh (tumbling windows, not sliding).

Readings where the paper is silent (also in docs/policies.md):

* ties: among outsiders the lower id comes in first; among residents the lower id goes out first;
* equal scores never swap (a swap costs a PCIe copy and gains nothing on the window's evidence), so
  an outsider needs a positive score to come in;
* between window ends a full cache never changes: ``victim`` declines every fetched expert, which is
  then used from a staging buffer. A *free* slot takes a fetched expert (``accepts``), which costs no
  extra copy; this only matters when the cache starts with free slots (``memory.cache_init=empty``).
  With the paper's start, ``memory.cache_init=random`` (seeded by the run's seed), every slot is
  full from the first step and contents change only at window ends;
* windows count visits of the layer from the first step of the run; they are not reset at batch,
  sequence or phase boundaries, and a prefill step (many tokens) weighs as its token count;
* an unfinished window at the end of the run never swaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dali_sim.policies import kernels
from dali_sim.policies.base import CACHES, CachePolicy, LayerView, PolicyConfig, SetupContext, registered


@dataclass(frozen=True)
class DaliWindowConfig(PolicyConfig):
    w: int = field(default=4, metadata={
        "help": "window length in steps (visits of the layer); the workloads of the window are summed "
                "and swaps happen at its end (paper: 4)"})
    u: int = field(default=1, metadata={
        "help": "at most this many swaps per layer at each window end (paper: 1 for Mixtral, 8 for "
                "DeepSeek and Qwen); 0 = never swap (a fixed set)"})

    def __post_init__(self) -> None:
        if isinstance(self.w, bool) or not isinstance(self.w, int) or self.w < 1:
            raise ValueError(f"cache.w must be an integer >= 1 (steps per window), got {self.w!r}")
        if isinstance(self.u, bool) or not isinstance(self.u, int) or self.u < 0:
            raise ValueError(f"cache.u must be an integer >= 0 (swaps per window), got {self.u!r}")


def _window_swaps(score, resident, u):
    """:func:`window_swaps` in one loop (compiled by numba): the i-th best outsider and the i-th worst resident
    are picked by selection (u is small), as ``[in_0, out_0, in_1, out_1, ...]``."""
    E = score.shape[0]
    taken = np.zeros(E, np.bool_)
    out = np.empty(2 * max(u, 0), np.int64)
    m = 0
    for _ in range(u):
        best = -1
        worst = -1
        for x in range(E):  # ascending ids: strict comparisons keep the lower id on ties
            if taken[x]:
                continue
            if resident[x]:
                if worst < 0 or score[x] < score[worst]:
                    worst = x
            elif best < 0 or score[x] > score[best]:
                best = x
        if best < 0 or worst < 0 or not score[best] > score[worst]:
            break
        taken[best] = True
        taken[worst] = True
        out[2 * m] = best
        out[2 * m + 1] = worst
        m += 1
    return out[:2 * m]


def _observe(state, layer, experts, counts):
    """:meth:`DaliWindow.observe` in one loop (compiled by numba): the visit's workloads added to the layer's
    window sums (``experts`` are distinct), one more visit counted (``state``: ``DaliWindow.state``)."""
    row = state[layer]
    for i in range(experts.shape[0]):
        row[experts[i]] += counts[i]
    row[state.shape[1] - 1] += 1


_COMPILED: list = []
_COMPILED_OBSERVE: list = []


def _compiled_observe():
    """The compiled :func:`_observe` (None without numba)."""
    if not _COMPILED_OBSERVE:
        _COMPILED_OBSERVE.append(kernels.jit(_observe))
    return _COMPILED_OBSERVE[0]


def _compiled_swaps():
    """The compiled :func:`_window_swaps` (None without numba)."""
    if not _COMPILED:
        _COMPILED.append(kernels.jit(_window_swaps))
    return _COMPILED[0]


def window_swaps(score: np.ndarray, resident: np.ndarray, u: int) -> list[tuple[int, int]]:
    """The swaps at a window end: ``(expert_in, expert_out)`` pairs, at most ``u``.

    Outsiders by descending score (ties: lower id first) are paired with residents by ascending
    score (ties: lower id first); pairs are taken while the outsider's score is strictly higher.
    """
    kernel = _compiled_swaps()
    if kernel is not None and score.dtype == np.int64 and resident.dtype == np.bool_:
        flat = kernel(score, resident, int(u)).tolist()
        return list(zip(flat[0::2], flat[1::2]))
    ids = np.arange(score.shape[0])
    outsiders = ids[~resident]
    insiders = ids[resident]
    if u <= 0 or outsiders.size == 0 or insiders.size == 0:
        return []
    best_out = outsiders[np.lexsort((outsiders, -score[outsiders]))]
    worst_in = insiders[np.lexsort((insiders, score[insiders]))]
    swaps: list[tuple[int, int]] = []
    for e_in, e_out in zip(best_out[:u].tolist(), worst_in[:u].tolist()):
        # later pairs only have lower incoming and higher outgoing scores: stop at the first failure
        if not score[e_in] > score[e_out]:
            break
        swaps.append((e_in, e_out))
    return swaps


@registered(CACHES)
class DaliWindow(CachePolicy[DaliWindowConfig]):
    name = "dali-window"
    description = ("DALI's workload-aware replacement: per layer, sum workloads over a window of w steps; at the "
                   "window end swap up to u top-scoring outsiders in for the lowest-scoring residents "
                   "(strictly higher scores only); a full cache changes only then")
    Config = DaliWindowConfig

    def setup(self, ctx: SetupContext) -> None:
        E = ctx.num_experts
        # one (L, E + 1) array (the controller's compiled plan takes it as one argument): per layer the current
        # window's sums and, in the last column, its visits in the window
        self.state = np.zeros((ctx.num_layers, E + 1), dtype=np.int64)
        self.score = self.state[:, :E]
        self.visits = self.state[:, E]
        self._no_key = np.zeros(E, np.int64)

    def observe(self, view: LayerView) -> None:
        kernel = _compiled_observe()
        if kernel is not None:  # the same sums in one compiled call (a fancy-indexed add costs several NumPy calls)
            kernel(self.state, view.layer, view.experts, view.counts)
            return
        self.score[view.layer, view.experts] += view.counts
        self.visits[view.layer] += 1

    def accepts(self, layer: int, expert: int, view: LayerView) -> bool:
        return True  # a free slot (only when the cache starts with free slots): keep the fetched copy

    def victim(self, layer: int, expert: int, view: LayerView, evictable: np.ndarray) -> int | None:
        return None  # a full cache changes only at window ends: the fetched expert is staged

    def victim_order(self, layer: int, view: LayerView, evictable: np.ndarray) -> np.ndarray:
        return evictable[:0]

    keyed_per_layer = True

    def keyed_form(self, layer: int, view: LayerView):
        return True, False, self._no_key, self._no_key, None  # free slots take fetched experts; no evictions

    def window_form(self) -> tuple[np.ndarray, int, int] | None:
        own = type(self) is DaliWindow  # (a subclass may observe or swap otherwise)
        return (self.state, int(self.config.w), int(self.config.u)) if own else None

    def window_end(self, layer: int) -> bool:
        """Whether the layer's current visit closes its window (call after ``observe``)."""
        return int(self.visits[layer]) >= self.config.w

    def rebalance(self, view: LayerView, resident: np.ndarray) -> list[tuple[int, int]]:
        layer = view.layer
        if self.visits[layer] < self.config.w:  # (window_end, without a call at every visit)
            return []
        swaps = window_swaps(self.score[layer], np.asarray(resident, dtype=bool), self.config.u)
        self.score[layer] = 0
        self.visits[layer] = 0
        return swaps
