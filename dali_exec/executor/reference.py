"""The reference an executed layer must equal: every expert's weights used directly, on one device."""

from __future__ import annotations

import numpy as np
import torch

from dali_exec.executor.store import HostExpertStore


def reference_moe(store: HostExpertStore, layer: int, x: torch.Tensor, ids: np.ndarray,
                  weights: np.ndarray | None) -> torch.Tensor:
    """``out[t] = sum_r weights[t, r] * expert_{ids[t, r]}(x[t])`` for MoE layer ordinal ``layer``, on
    ``x``'s device: no slots, plans, copies or lanes (weights straight from the host store). Without
    gate weights each of the top-k counts ``1/k``, as in the replay."""
    ids = np.asarray(ids)
    T, k = ids.shape
    if weights is None:
        weights = np.full((T, k), 1.0 / k, np.float32)
    w = torch.as_tensor(np.asarray(weights, np.float32)).to(device=x.device, dtype=x.dtype)
    out = torch.zeros((T, k, x.shape[1]), dtype=x.dtype, device=x.device)
    for e in np.unique(ids).tolist():
        t, r = np.nonzero(ids == e)
        t_idx, r_idx = torch.as_tensor(t, device=x.device), torch.as_tensor(r, device=x.device)
        y = store.layout.forward(store.host(layer, e).to(x.device), x[t_idx])
        out[t_idx, r_idx] = y * w[t_idx, r_idx].unsqueeze(1)
    return out.sum(dim=1)
