"""The adapter API: where a transformers MoE model keeps its routers and experts, and what they return.

transformers 5 gives every supported family the same shape, which the base class relies on:

* ``model.model.layers[i].mlp`` is the block's MLP; it is an MoE block when it has a router module
  (``gate`` or ``router``) and a routed-experts module ``experts``;
* the router's ``forward(x)`` takes the gate input ``x`` (``(tokens, hidden)`` or ``(batch, seq,
  hidden)``) and returns ``(router_logits, top_k_weights, top_k_ids)``, the weights being the ones the
  block multiplies the expert outputs by;
* ``experts(x, top_k_ids, top_k_weights)`` runs the routed experts (whatever ``experts_implementation``
  the config selects) and returns the weighted sum.

A family adapter (:mod:`dali_exec.models.families`) names the modules, says how logits are formed
(bias, float32) and how they turn into top-k ids and weights (:class:`RoutingRule`), and how the
always-on shared experts contribute. The recorder hooks routers through it; the executor replaces
blocks with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Routing:
    """One router decision for a batch of tokens.

    ``logits``: (tokens, num_experts) what the router computes before any top-k (for DeepSeek-V3 the
    pre-sigmoid scores, without the selection bias). ``ids``: (tokens, top_k) int64 in **rank order**
    (largest weight first; ties keep the router's order). ``weights``: (tokens, top_k) float32, the
    factors the block applies to each expert's output (including any renormalisation or scaling).
    """

    logits: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor

    def select_rows(self, index: torch.Tensor) -> "Routing":
        """The rows ``index`` (e.g. the non-padding tokens of a batch)."""
        return Routing(self.logits.index_select(0, index), self.ids.index_select(0, index),
                       self.weights.index_select(0, index))


def rank_order(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by descending weight (stable: ties keep their order); float32 weights."""
    weights = weights.float()
    weights, order = weights.sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), weights


@dataclass(frozen=True)
class RoutingRule:
    """How a family's router turns logits into top-k ids and weights.

    ``select(router, logits) -> (ids, weights)`` reproduces the router's own top-k from its logits
    (the router module supplies parameters such as DeepSeek-V3's selection bias); ``describe(router)``
    says in words what the weights are (the trace's ``weights_note``). Tests check ``select`` against
    the router's forward on every family.
    """

    describe: Callable[[nn.Module], str]
    select: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MoEBlock:
    """The modules of one MoE block. ``layer`` is the block index (as in traces' ``layer`` column)."""

    layer: int
    block: nn.Module  # the module in the decoder layer's MLP slot
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None  # always-on shared expert(s), or None

    @property
    def num_experts(self) -> int:
        return int(self.router.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.router.top_k)

    @property
    def hidden_size(self) -> int:
        return int(self.router.weight.shape[-1])


class MoEAdapter:
    """Per-family knowledge about a transformers (v5) MoE causal LM; stateless, one instance per family.

    Subclasses set the class attributes; the methods work on any model of the family.
    """

    #: ``config.model_type`` values this adapter handles
    model_types: tuple[str, ...] = ()
    #: attribute of the MoE block holding the router
    router_attr: str = "gate"
    #: attribute of the MoE block holding the routed experts
    experts_attr: str = "experts"
    #: attribute of the MoE block holding the shared expert(s), or None
    shared_attr: str | None = None
    #: the block's forward returns a tuple whose first item is the hidden states (GPT-OSS)
    block_returns_tuple: bool = False
    #: router logits computed in float32 whatever the model dtype (DeepSeek)
    logits_in_float32: bool = False
    #: how logits become top-k ids and weights
    rule: RoutingRule
    #: layout of the expert parameters in ``experts`` (for the executor; see :meth:`expert_parameters`)
    expert_layout: str = ("gate_up_proj (E, 2*I, H) = [gate; up] rows, down_proj (E, H, I); "
                          "y = down @ (act(gate @ x) * (up @ x))")

    # ---- structure -------------------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder blocks of a ``*ForCausalLM`` (or of its base model)."""
        base = getattr(model, "model", model)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(model).__name__}: expected decoder blocks at .model.layers")
        return layers

    def is_moe(self, mlp: nn.Module) -> bool:
        return hasattr(mlp, self.router_attr) and hasattr(mlp, self.experts_attr)

    def blocks(self, model: nn.Module) -> list[MoEBlock]:
        """The MoE blocks in forward order; dense blocks (DeepSeek's first, Qwen's ``mlp_only_layers``) are skipped."""
        found = []
        for i, layer in enumerate(self.decoder_layers(model)):
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not self.is_moe(mlp):
                continue
            shared = getattr(mlp, self.shared_attr) if self.shared_attr else None
            found.append(MoEBlock(i, mlp, getattr(mlp, self.router_attr), getattr(mlp, self.experts_attr), shared))
        if not found:
            raise ValueError(f"{type(model).__name__}: no MoE blocks found (no .mlp.{self.router_attr})")
        return found

    # ---- routing ---------------------------------------------------------------------------------
    def router_logits(self, block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
        """Router logits for gate inputs ``x`` (..., hidden), as the router computes them (no top-k).

        Used for lookahead predictions: router of block l+1 applied to block l's gate input.
        """
        x = x.reshape(-1, block.hidden_size)
        weight, bias = block.router.weight, getattr(block.router, "bias", None)
        if self.logits_in_float32:
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        return nn.functional.linear(x, weight, bias)

    def parse_router_output(self, output: Any) -> Routing:
        """The router's forward output -> :class:`Routing` (rank order, float32 weights)."""
        logits, weights, ids = output[0], output[1], output[2]
        ids, weights = rank_order(ids, weights)
        return Routing(logits.reshape(-1, logits.shape[-1]), ids, weights)

    def route(self, block: MoEBlock, x: torch.Tensor) -> Routing:
        """Run the block's own router on gate inputs ``x``."""
        return self.parse_router_output(block.router(x.reshape(-1, block.hidden_size)))

    def weights_note(self, block: MoEBlock) -> str:
        """What the recorded weights are, for this model's settings."""
        return self.rule.describe(block.router)

    def select(self, block: MoEBlock, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (ids, weights) the router would choose from ``logits``, in rank order."""
        ids, weights = self.rule.select(block.router, logits)
        return rank_order(ids, weights)

    # ---- running parts of a block (what the executor composes) ---------------------------------
    def block_output(self, output: Any) -> torch.Tensor:
        """The hidden states a block's forward returns (GPT-OSS also returns router scores)."""
        return output[0] if self.block_returns_tuple else output

    def run_experts(self, block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the routed experts ``ids`` (tokens, k) for tokens ``x`` (tokens, hidden)."""
        return block.experts(x, ids, weights.to(x.dtype))

    def expert_forward(self, block: MoEBlock, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Unweighted output of routed expert ``expert`` for every token of ``x`` (tokens, hidden)."""
        if not 0 <= expert < block.num_experts:
            raise ValueError(f"expert must be in 0..{block.num_experts - 1}, got {expert}")
        ids = torch.full((x.shape[0], 1), expert, dtype=torch.long, device=x.device)
        ones = torch.ones((x.shape[0], 1), dtype=x.dtype, device=x.device)
        return block.experts(x, ids, ones)

    def shared_output(self, block: MoEBlock, x: torch.Tensor) -> torch.Tensor | None:
        """Output of the always-on shared expert(s) for ``x`` (tokens, hidden), or None."""
        return block.shared(x) if block.shared is not None else None

    def expert_parameters(self, block: MoEBlock, expert: int) -> dict[str, torch.Tensor]:
        """Views of expert ``expert``'s slices of the stacked expert parameters (see ``expert_layout``)."""
        return {name: p[expert] for name, p in block.experts.named_parameters(recurse=False)
                if p.dim() >= 1 and p.shape[0] == block.num_experts}
