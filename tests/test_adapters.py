"""dali_exec.models: each family's adapter finds the right blocks and reproduces the model's own routing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dali_exec.models import get_adapter, rank_order, supported_model_types  # noqa: E402
from dali_exec.models.tiny import tiny_model, tiny_model_types  # noqa: E402
from dali_sim.models.hf_config import HF_READERS, spec_from_hf_config  # noqa: E402

torch.set_num_threads(1)

FAMILIES = tiny_model_types()
# block indices of the dense (non-MoE) blocks of each tiny config
DENSE = {"qwen2_moe": {0}, "qwen3_moe": {1}, "deepseek_v2": {0}, "deepseek_v3": {0}, "glm4_moe": {0}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param, seed=1)
    return request.param, model, get_adapter(model)


def _gate_inputs(n=64, hidden=32, seed=0):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 2


def test_every_supported_family_has_a_tiny_model():
    assert supported_model_types() == FAMILIES
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"} <= set(FAMILIES)
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"} <= set(HF_READERS)


def test_blocks_are_the_moe_blocks_of_the_spec(family):
    name, model, adapter = family
    blocks = adapter.blocks(model)
    layers = [b.layer for b in blocks]
    assert set(range(model.config.num_hidden_layers)) - set(layers) == DENSE.get(name, set())
    for b in blocks:
        assert b.block is model.model.layers[b.layer].mlp
        assert (b.top_k, b.num_experts) == (model.config.num_experts_per_tok, b.experts.gate_up_proj.shape[0])
    if name in HF_READERS:  # the trace's model spec agrees (glm4_moe, flex_olmo: no reader yet)
        spec = spec_from_hf_config(model.config.to_dict())
        assert tuple(layers) == spec.moe_layers
        assert (blocks[0].top_k, blocks[0].num_experts) == (spec.top_k, spec.num_experts)


def test_router_logits_equal_the_routers_own(family):
    _, model, adapter = family
    x = _gate_inputs()
    for b in adapter.blocks(model):
        assert torch.equal(adapter.router_logits(b, x), b.router(x)[0])


def test_select_reproduces_the_router_and_rank_order(family):
    _, model, adapter = family
    x = _gate_inputs(256)
    for b in adapter.blocks(model):
        routing = adapter.route(b, x)
        ids, weights = adapter.select(b, routing.logits)
        assert torch.equal(ids, routing.ids)
        torch.testing.assert_close(weights, routing.weights, rtol=1e-6, atol=1e-7)
        assert (routing.weights[:, :-1] >= routing.weights[:, 1:]).all()  # rank order
        raw_ids = b.router(x)[2]  # same experts as the router chose, whatever its order
        assert torch.equal(raw_ids.sort(dim=-1).values, routing.ids.sort(dim=-1).values)


def test_block_is_routed_experts_plus_shared(family):
    name, model, adapter = family
    x = _gate_inputs(16)
    with torch.no_grad():
        for b in adapter.blocks(model):
            y = adapter.block_output(b.block(x[None]))[0]
            routing = adapter.route(b, x)
            routed = adapter.run_experts(b, x, routing.ids, routing.weights)
            shared = adapter.shared_output(b, x)
            assert (shared is not None) == (name in ("qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"))
            torch.testing.assert_close(routed + (shared if shared is not None else 0), y)
            # one expert at a time, weighted by hand
            by_hand = torch.zeros_like(routed)
            for k in range(b.top_k):
                for e in routing.ids[:, k].unique().tolist():
                    rows = routing.ids[:, k] == e
                    by_hand[rows] += routing.weights[rows, k, None] * adapter.expert_forward(b, e, x[rows])
            torch.testing.assert_close(by_hand, routed, rtol=1e-5, atol=1e-6)


def test_expert_parameters_are_views_of_one_expert(family):
    _, model, adapter = family
    b = adapter.blocks(model)[0]
    params = adapter.expert_parameters(b, 3)
    assert "gate_up_proj" in params and "down_proj" in params
    for name, value in params.items():
        full = getattr(b.experts, name)
        assert value.shape == full.shape[1:]
        assert value.data_ptr() == full[3].data_ptr()
    with pytest.raises(ValueError, match=f"expert must be in 0..{b.num_experts - 1}"):
        adapter.expert_forward(b, b.num_experts, _gate_inputs(2))


def test_deepseek_v2_group_limited_routing():
    model = tiny_model("deepseek_v2", seed=2, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    adapter = get_adapter(model)
    x = _gate_inputs(256)
    for b in adapter.blocks(model):
        routing = adapter.route(b, x)
        ids, weights = adapter.select(b, routing.logits)
        assert torch.equal(ids, routing.ids)
        torch.testing.assert_close(weights, routing.weights)
        groups = routing.ids // 2  # 8 experts in 4 groups of 2: at most topk_group groups per token
        assert max(len(set(row)) for row in groups.tolist()) <= 2
        assert "group-limited" in adapter.weights_note(b)


def test_deepseek_v3_selection_uses_the_bias_but_weights_do_not():
    model = tiny_model("deepseek_v3", seed=3)
    adapter = get_adapter(model)
    b = adapter.blocks(model)[0]
    x = _gate_inputs(512)
    routing = adapter.route(b, x)
    sig = torch.sigmoid(routing.logits)
    chosen = sig.gather(1, routing.ids)
    norm = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(routing.weights, norm * b.router.routed_scaling_factor)
    # the bias changes some choices compared with plain top-k of the sigmoid within the chosen groups
    with torch.no_grad():
        saved = b.router.e_score_correction_bias.clone()
        b.router.e_score_correction_bias.zero_()
        unbiased = adapter.route(b, x)
        b.router.e_score_correction_bias.copy_(saved)
    assert not torch.equal(unbiased.ids, routing.ids)


def test_rank_order_is_stable_and_sorts_descending():
    ids = torch.tensor([[4, 1, 7], [2, 3, 5]])
    weights = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.4, 0.2]])
    sorted_ids, sorted_w = rank_order(ids, weights)
    assert sorted_ids.tolist() == [[1, 7, 4], [2, 3, 5]]
    assert sorted_w.dtype == torch.float32
    torch.testing.assert_close(sorted_w, torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]))


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"'llama' has no MoE adapter; supported: deepseek_v2, .*mixtral.*qwen3_moe"):
        get_adapter("llama")
    with pytest.raises(ValueError, match="no config.model_type"):
        get_adapter(object())


def test_weights_note_follows_the_config():
    assert "renormalised" in get_adapter("qwen3_moe").weights_note(
        get_adapter("qwen3_moe").blocks(tiny_model("qwen3_moe"))[0])
    olmoe = tiny_model("olmoe")  # norm_topk_prob defaults to False
    assert "not renormalised" in get_adapter(olmoe).weights_note(get_adapter(olmoe).blocks(olmoe)[0])
