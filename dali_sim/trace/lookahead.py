"""Lookahead columns packed to what the simulator reads of them: each row's predicted top-k experts.

A lookahead column holds ``num_experts`` float32 logits per row (512 B a row for a 128-expert model);
the workload builder only uses the ``top_k`` experts they rank highest. :func:`pack_top_k` keeps just
those (int16, ``top_k`` per row, -1 for a row without a prediction), block by block, so a reader never
holds a whole column of logits (docs/trace-format.md, "Reading what a run needs").
"""

from __future__ import annotations

import numpy as np

#: rows whose logits are ranked at once (bounds the temporary copies of :func:`pack_top_k`)
PACK_ROWS = 1 << 16
NO_PREDICTION = -1


def predicted_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """(tokens, k) expert ids a lookahead column's logits predict, in rank order: the k highest logits
    (NaN = never), highest first, ties to the lower id."""
    pred = np.nan_to_num(np.asarray(logits), nan=-np.inf)
    top = np.argpartition(-pred, k - 1, axis=1)[:, :k]
    top = np.sort(top, axis=1)
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(pred, top, 1), axis=1, kind="stable"), 1)


def pack_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) int16 predicted top-k of every row of ``logits`` (:func:`predicted_top_k`); rows that are
    entirely NaN (no prediction: the target layer does not exist) are all :data:`NO_PREDICTION`."""
    out = np.full((len(logits), k), NO_PREDICTION, dtype=np.int16)
    for a in range(0, len(logits), PACK_ROWS):
        block = logits[a:a + PACK_ROWS]
        has = ~np.isnan(block).all(axis=1)
        if has.any():
            out[a:a + PACK_ROWS][has] = predicted_top_k(block[has], k)
    return out


__all__ = ["NO_PREDICTION", "pack_top_k", "predicted_top_k"]
