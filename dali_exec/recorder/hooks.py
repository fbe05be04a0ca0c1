"""Forward hooks on the routers of a model's MoE blocks.

:class:`GateInputHooks` registers one hook per router and hands each call's gate input (only the
recorded tokens) and router output to :meth:`GateInputHooks.on_router`. :class:`RoutingCapture`
keeps, per forward pass, the routing of every MoE layer plus the optional router logits, gate inputs
and lookahead predictions; :meth:`RoutingCapture.collect` returns them as NumPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from dali_exec.models import MoEAdapter, MoEBlock


class GateInputHooks:
    """Context manager: hooks on every MoE router; subclasses implement :meth:`on_router`.

    Set :attr:`index` (flattened token positions to keep) before each forward pass. Each router must
    run exactly once per forward pass, which :meth:`check_complete` verifies: a block whose forward
    was replaced (e.g. by a hub kernel) would otherwise silently go unrecorded.
    """

    def __init__(self, model, adapter: MoEAdapter, blocks: list[MoEBlock] | None = None):
        self.model, self.adapter = model, adapter
        self.blocks = blocks if blocks is not None else adapter.blocks(model)
        self.index: torch.Tensor | None = None
        self._calls = [0] * len(self.blocks)
        self._handles: list[Any] = []

    def __enter__(self):
        for ordinal, block in enumerate(self.blocks):
            self._handles.append(block.router.register_forward_hook(self._hook(ordinal)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, ordinal: int):
        def hook(module, inputs, output):
            x = inputs[0] if inputs else None
            if x is None:
                raise RuntimeError(f"block {self.blocks[ordinal].layer}: router called without a positional input")
            x = x.reshape(-1, x.shape[-1])
            if self.index is not None:
                x = x.index_select(0, self.index)
            self._calls[ordinal] += 1
            self.on_router(ordinal, x, output)

        return hook

    def on_router(self, ordinal: int, x: torch.Tensor, output: Any) -> None:
        raise NotImplementedError

    def start_forward(self, index: torch.Tensor | None) -> None:
        self.index = index
        self._calls = [0] * len(self.blocks)

    def check_complete(self) -> None:
        bad = [(b.layer, n) for b, n in zip(self.blocks, self._calls) if n != 1]
        if bad:
            raise RuntimeError(
                "routers must run exactly once per forward pass; (block, calls): "
                f"{bad}. Was an MoE block's forward replaced (hub kernels, a custom experts implementation)?")


@dataclass
class StepRouting:
    """One forward pass, MoE-layer-major: arrays of shape (num_moe_layers, tokens, ...)."""

    ids: np.ndarray  # int64 (L, N, k)
    weights: np.ndarray  # float32 (L, N, k)
    router_logits: np.ndarray | None  # float32 (L, N, E)
    hidden: np.ndarray | None  # float16 (L, N, H): gate inputs
    lookahead: dict[str, np.ndarray]  # name -> float32 (L, N, E); NaN where the target layer does not exist


class RoutingCapture(GateInputHooks):
    """Routing of every MoE layer for the recorded tokens of each forward pass.

    ``next_gate``: add router_{l+1}(x_l); ``gate_depth`` D >= 2: add router_{l+d}(x_l) as ``gate<d>`` for
    d = 2..D (HybriMoE's look-ahead); ``residuals`` (MoE block index -> vector): add router_{l+1}(x_l + r_l)
    as ``residual``. Values stay on the device until :meth:`collect`.
    """

    def __init__(self, model, adapter: MoEAdapter, *, router_logits: bool = False, hidden: bool = False,
                 next_gate: bool = True, residuals: Mapping[int, torch.Tensor] | None = None,
                 blocks: list[MoEBlock] | None = None, gate_depth: int = 1):
        super().__init__(model, adapter, blocks)
        self.want_logits, self.want_hidden, self.next_gate = router_logits, hidden, next_gate
        self.far_gates = {f"gate{d}": d for d in range(2, gate_depth + 1)}
        self.residuals: dict[int, torch.Tensor] = {}
        if residuals is not None:
            missing = [b.layer for b in self.blocks[:-1] if b.layer not in residuals]
            if missing:
                raise ValueError(f"residual vectors missing for MoE blocks {missing}")
            self.residuals = {b.layer: residuals[b.layer] for b in self.blocks[:-1]}
        self._reset()

    @property
    def predictor_names(self) -> list[str]:
        return ((["next-gate"] if self.next_gate else []) + (["residual"] if self.residuals else [])
                + list(self.far_gates))

    def _reset(self) -> None:
        n = len(self.blocks)
        self._ids: list[Any] = [None] * n
        self._weights: list[Any] = [None] * n
        self._logits: list[Any] = [None] * n
        self._hidden: list[Any] = [None] * n
        self._pred: dict[str, list[Any]] = {name: [None] * n for name in self.predictor_names}

    def start_forward(self, index: torch.Tensor | None) -> None:
        super().start_forward(index)
        self._reset()

    def on_router(self, ordinal: int, x: torch.Tensor, output: Any) -> None:
        routing = self.adapter.parse_router_output(output)
        if self.index is not None:
            routing = routing.select_rows(self.index)
        self._ids[ordinal], self._weights[ordinal] = routing.ids, routing.weights
        if self.want_logits:
            self._logits[ordinal] = routing.logits.float()
        if self.want_hidden:
            self._hidden[ordinal] = x.to(torch.float16)
        if ordinal + 1 < len(self.blocks):
            nxt = self.blocks[ordinal + 1]
            if self.next_gate:
                self._pred["next-gate"][ordinal] = self.adapter.router_logits(nxt, x).float()
            if self.residuals:
                r = self.residuals[self.blocks[ordinal].layer]
                shifted = (x.float() + r).to(x.dtype)
                self._pred["residual"][ordinal] = self.adapter.router_logits(nxt, shifted).float()
        for name, d in self.far_gates.items():
            if ordinal + d < len(self.blocks):
                self._pred[name][ordinal] = self.adapter.router_logits(self.blocks[ordinal + d], x).float()

    def collect(self) -> StepRouting:
        """Arrays of the last forward pass (one device-to-host copy per kind)."""
        self.check_complete()

        def stacked(parts):
            return torch.stack(parts).cpu().numpy()

        lookahead = {}
        n, experts = len(self._ids[-1]), self.blocks[-1].num_experts
        for name, parts in self._pred.items():
            have = [p for p in parts if p is not None]  # the first layers; the last ones have no target
            missing = np.full((len(parts) - len(have), n, experts), np.nan, dtype=np.float32)
            lookahead[name] = np.concatenate(([stacked(have)] if have else []) + [missing])
        return StepRouting(
            ids=stacked(self._ids),
            weights=stacked(self._weights),
            router_logits=stacked(self._logits) if self.want_logits else None,
            hidden=stacked(self._hidden) if self.want_hidden else None,
            lookahead=lookahead,
        )
