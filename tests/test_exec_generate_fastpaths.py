"""The CPU shortcuts of ``dali exec generate`` compute exactly what the general paths compute.

On the CPU device: one expert is two ``torch.mm`` (the grouped product's per-group call), a group of
experts one ``F.grouped_mm`` per projection (transformers' own dispatch there) on strided operands, and
the lookahead's rank order comes from the compiled kernel. Each is compared bit for bit with the path it
replaces, on tiny models of every family (biases and transposed layouts: GPT-OSS), in fp32 and bf16.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dali_exec.generate.experts as experts_mod  # noqa: E402
from dali_exec.generate import pack_experts  # noqa: E402
from dali_exec.generate.session import OffloadSession  # noqa: E402
from dali_exec.models import get_adapter  # noqa: E402
from dali_exec.models.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "olmoe")


def _store(family: str, dtype: torch.dtype):
    model = tiny_model(family, seed=5).to(dtype)
    blocks = get_adapter(model).blocks(model)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for b in blocks:  # biases are zero at initialisation: make them count
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                if hasattr(b.experts, name):
                    t = getattr(b.experts, name)
                    t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return model, blocks, pack_experts([b.experts for b in blocks], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_expert_as_two_products_equals_the_grouped_call(family, dtype, monkeypatch):
    _, blocks, store = _store(family, dtype)
    lay = store.layout
    g = torch.Generator().manual_seed(1)
    monkeypatch.setattr(experts_mod, "_CPU_GROUPED_MM", None)  # the grouped reference: transformers' call
    for n in (1, 2, 3, 7, 16):
        x = torch.randn(n, lay.hidden, generator=g).to(dtype)
        for e in (0, blocks[0].num_experts - 1):
            flat = store.weights[0, e]
            offs = torch.tensor([n], dtype=torch.int32)
            want = lay.forward_grouped(flat.unsqueeze(0), x, offs, np.array([n]), torch.zeros(n, dtype=torch.long))
            assert torch.equal(lay.forward(flat, x), want), (family, dtype, n, e)
            # as a staging turn computes it: the buffer prepared once, the tokens a slice of the turns' one gather
            tokens = torch.cat([torch.randn(3, lay.hidden, generator=g).to(dtype), x]).split([3, n])[1]
            assert torch.equal(lay.forward_prepared(lay.prepare(flat), tokens), want), (family, dtype, n, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_call_on_strided_operands_equals_transformers_grouped_linear(family, dtype, monkeypatch):
    _, blocks, store = _store(family, dtype)
    lay = store.layout
    E = blocks[0].num_experts
    g = torch.Generator().manual_seed(2)
    counts = np.array([2, 0, 1, 3, 0, 0, 1, 1] * E)[:E]  # empty groups in the span too
    x = torch.randn(int(counts.sum()), lay.hidden, generator=g).to(dtype)
    for lo in (0, 1):  # a span starting at row 0 and one starting inside the table
        table, c = store.weights[0, lo:], counts[lo:]
        offs = torch.from_numpy(np.cumsum(c).astype(np.int32))
        xs = x[int(counts[:lo].sum()):]
        pair_rows = torch.from_numpy(np.repeat(np.arange(len(c)), c)) if lay.bias else None
        got = lay.forward_grouped(table, xs, offs, c, pair_rows)
        with monkeypatch.context() as m:
            m.setattr(experts_mod, "_CPU_GROUPED_MM", None)
            want = lay.forward_grouped(table, xs, offs, c, pair_rows)
        assert got.shape == (len(xs), lay.hidden) and torch.equal(got, want), (family, dtype, lo)


@pytest.mark.parametrize("family", FAMILIES)
def test_lookahead_rank_order_by_the_kernel_equals_the_adapters_select(family):
    model = tiny_model(family, seed=7)
    adapter = get_adapter(model)
    blocks = adapter.blocks(model)
    H = blocks[0].hidden_size
    g = torch.Generator().manual_seed(3)
    residual = torch.randn(H, generator=g)
    predictions = [tuple((name, blocks[o + off], residual if name == "residual" else None)
                         for name, off in (("next-gate", 1), ("residual", 1), ("gate2", 2)) if o + off < len(blocks))
                   for o in range(len(blocks))]
    fast = SimpleNamespace(adapter=adapter, _predictions=predictions, _plain_select=True)
    plain = SimpleNamespace(adapter=adapter, _predictions=predictions, _plain_select=False)
    with torch.no_grad():
        for ordinal in range(len(blocks)):
            x = torch.randn(9, H, generator=g)
            x[3] = x[2]  # equal rows: equal predictions
            got = OffloadSession._lookahead(fast, ordinal, x)
            want = OffloadSession._lookahead(plain, ordinal, x)
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == np.int64 and np.array_equal(got[name], want[name]), (family, ordinal, name)
