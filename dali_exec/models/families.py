"""Per-family adapters: module names, logit details, routing rules and shared experts.

Each routing rule is a short statement of the family's documented gating (checked against the
router's own forward by tests/test_adapters.py), not a copy of the modeling code.
"""

from __future__ import annotations

import torch
from torch import nn

from dali_exec.models.base import MoEAdapter, MoEBlock, RoutingRule


# ---- routing rules -------------------------------------------------------------------------------
def _softmax_topk(always_renormalize: bool):
    def select(router: nn.Module, logits: torch.Tensor):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, int(router.top_k), dim=-1)
        if always_renormalize or getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    return select


def _topk_softmax(router: nn.Module, logits: torch.Tensor):
    values, ids = torch.topk(logits.float(), int(router.top_k), dim=-1)
    return ids, torch.softmax(values, dim=-1)


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """(tokens, groups) scores -> (tokens, experts) bool mask of the experts in the best ``topk_group`` groups."""
    groups = group_scores.shape[-1]
    best = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(num_experts // groups, dim=-1)


def _deepseek_v2(router: nn.Module, logits: torch.Tensor):
    scores = torch.softmax(logits.float(), dim=-1)
    if router.topk_method == "group_limited_greedy":
        n, groups = router.num_experts, router.num_group
        group_scores = scores.view(-1, groups, n // groups).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(group_scores, router.topk_group, n), 0.0)
    elif router.topk_method != "greedy":
        raise ValueError(f"DeepSeek-V2 topk_method {router.topk_method!r} is not supported "
                         "(greedy, group_limited_greedy)")
    weights, ids = torch.topk(scores, int(router.top_k), dim=-1)
    return ids, weights * router.routed_scaling_factor


def _deepseek_v3(router: nn.Module, logits: torch.Tensor):
    scores = torch.sigmoid(logits.float())
    biased = scores + router.e_score_correction_bias.float()
    n, groups = router.num_experts, router.num_group
    group_scores = biased.view(-1, groups, n // groups).topk(2, dim=-1).values.sum(dim=-1)
    biased = biased.masked_fill(~_group_mask(group_scores, router.topk_group, n), float("-inf"))
    ids = torch.topk(biased, int(router.top_k), dim=-1).indices
    weights = scores.gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * router.routed_scaling_factor


def _softmax_note(router: nn.Module, always: bool) -> str:
    k = int(router.top_k)
    renorm = always or getattr(router, "norm_topk_prob", False)
    return (f"softmax over all {router.num_experts} router logits, top-{k}"
            + (", renormalised to sum to 1" if renorm else " (not renormalised)"))


def _deepseek_v2_note(router: nn.Module) -> str:
    how = "group-limited top" if router.topk_method == "group_limited_greedy" else "top"
    return (f"softmax over all {router.num_experts} router logits, {how}-{router.top_k} (not renormalised), "
            f"times routed_scaling_factor={router.routed_scaling_factor}")


def _deepseek_v3_note(router: nn.Module) -> str:
    norm = "renormalised to sum to 1" if router.norm_topk_prob else "not renormalised"
    return (f"sigmoid of the router logits of the top-{router.top_k} experts, chosen by sigmoid + "
            f"e_score_correction_bias within the best {router.topk_group} of {router.num_group} groups; {norm}, "
            f"times routed_scaling_factor={router.routed_scaling_factor}")


SOFTMAX_TOPK_RENORM = RoutingRule(lambda r: _softmax_note(r, True), _softmax_topk(True))
SOFTMAX_TOPK_OPTIONAL = RoutingRule(lambda r: _softmax_note(r, False), _softmax_topk(False))
TOPK_SOFTMAX = RoutingRule(
    lambda r: f"softmax over the top-{r.top_k} router logits (router bias included)", _topk_softmax)
DEEPSEEK_V2 = RoutingRule(_deepseek_v2_note, _deepseek_v2)
DEEPSEEK_V3 = RoutingRule(_deepseek_v3_note, _deepseek_v3)


# ---- families ------------------------------------------------------------------------------------
class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    rule = SOFTMAX_TOPK_RENORM


class QwenMoEAdapter(MoEAdapter):
    """Qwen3-MoE (no shared expert) and dense ``mlp_only_layers`` / ``decoder_sparse_step`` blocks."""

    model_types = ("qwen3_moe",)
    rule = SOFTMAX_TOPK_OPTIONAL


class Qwen2MoEAdapter(MoEAdapter):
    """Qwen2-MoE: one shared expert scaled by a sigmoid gate of its own."""

    model_types = ("qwen2_moe",)
    rule = SOFTMAX_TOPK_OPTIONAL
    shared_attr = "shared_expert"

    def shared_output(self, block: MoEBlock, x: torch.Tensor) -> torch.Tensor | None:
        return torch.sigmoid(block.block.shared_expert_gate(x)) * block.shared(x)


class OlmoeAdapter(MoEAdapter):
    """OLMoE and FlexOlmo (same block)."""

    model_types = ("olmoe", "flex_olmo")
    rule = SOFTMAX_TOPK_OPTIONAL


class DeepseekV2Adapter(MoEAdapter):
    """DeepSeek-V2 (and -Lite): dense first blocks (``first_k_dense_replace``), shared experts, float32 router."""

    model_types = ("deepseek_v2",)
    rule = DEEPSEEK_V2
    shared_attr = "shared_experts"
    logits_in_float32 = True


class DeepseekV3Adapter(DeepseekV2Adapter):
    """DeepSeek-V3 and GLM-4.5 (``glm4_moe``: the same router and MoE block, GQA attention)."""

    model_types = ("deepseek_v3", "glm4_moe")
    rule = DEEPSEEK_V3


class GptOssAdapter(MoEAdapter):
    model_types = ("gpt_oss",)
    router_attr = "router"
    rule = TOPK_SOFTMAX
    block_returns_tuple = True
    expert_layout = ("gate_up_proj (E, H, 2*I) with gate/up interleaved along the last axis (even = gate, "
                     "odd = up), gate_up_proj_bias (E, 2*I), down_proj (E, I, H), down_proj_bias (E, H); "
                     "y = (clamped-SwiGLU(x @ gate_up + b)) @ down + b")


FAMILIES: tuple[type[MoEAdapter], ...] = (
    MixtralAdapter, Qwen2MoEAdapter, QwenMoEAdapter, OlmoeAdapter, DeepseekV2Adapter, DeepseekV3Adapter, GptOssAdapter,
)
