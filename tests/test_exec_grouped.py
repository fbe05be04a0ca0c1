"""Grouped expert computation (dali_exec/executor/grouped.py): a group computes what each of its experts
computes alone, whatever the group, the table rows or their order; its indices follow the routing; the
timeline gets one interval per expert whose spans add up to the group's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dali_exec.executor.ffn import ExpertLayout  # noqa: E402
from dali_exec.executor.grouped import GroupIndex, grouped_mm  # noqa: E402
from dali_exec.executor.routing import LayerRouting  # noqa: E402
from dali_exec.executor.timing import Timer  # noqa: E402

from conftest import tiny_model  # noqa: E402

RNG = np.random.default_rng(0)


def _routing(T=9, k=2, E=6, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])
    return LayerRouting.group(ids, rng.random((T, k)).astype(np.float32))


def test_group_index_takes_each_experts_segment_sorted_by_table_row():
    r = _routing()
    seg = np.array([3, 0, 2])  # indices into r.experts
    rows = np.array([7, 1, 4])  # their table rows
    gi = GroupIndex.build(r, seg, rows)
    assert gi.rows.tolist() == [1, 4, 7] and gi.experts.tolist() == r.experts[[0, 2, 3]].tolist()
    want = np.concatenate([r.positions[r.segment(int(e))] for e in gi.experts])
    assert np.array_equal(gi.pairs, want)
    assert np.array_equal(gi.weights, np.concatenate([r.weights[r.segment(int(e))] for e in gi.experts]))
    assert gi.lo == 1 and len(gi.table_counts) == 7 and gi.table_counts[[0, 3, 6]].tolist() == gi.counts.tolist()
    assert gi.offs[-1] == len(gi.pairs) and gi.row_of_pairs().tolist() == np.repeat([0, 3, 6], gi.counts).tolist()
    one = GroupIndex.build(r, np.array([1]), np.array([5]))
    assert np.array_equal(one.pairs, r.positions[r.segment(int(r.experts[1]))]) and one.lo == 5
    whole = GroupIndex.whole(r)
    assert np.array_equal(whole.pairs, r.positions) and whole.rows.tolist() == r.experts.tolist()


@pytest.mark.parametrize("rows_per_group", [1, 3])
def test_grouped_mm_equals_one_product_per_row(rows_per_group):
    R, K, N = 10, 16, 8
    w = torch.randn(R, K, N, generator=torch.Generator().manual_seed(1))
    counts = np.zeros(R, np.int64)
    counts[[0, 4, 9]] = rows_per_group
    x = torch.randn(int(counts.sum()), K, generator=torch.Generator().manual_seed(2))
    out = grouped_mm(x, w, torch.from_numpy(np.cumsum(counts).astype(np.int32)), counts)
    a = 0
    for g in np.flatnonzero(counts):
        b = a + int(counts[g])
        torch.testing.assert_close(out[a:b], x[a:b] @ w[g], rtol=1e-5, atol=1e-5)
        a = b


@pytest.mark.parametrize("family,bias", [("mixtral", False), ("gpt_oss", True)])
def test_layout_forward_grouped_equals_forward_per_expert(family, bias):
    import dataclasses

    model = dataclasses.replace(tiny_model(), family=family, expert_bias=bias)
    lay = ExpertLayout.of(model)
    table = torch.randn(6, lay.numel + 3, generator=torch.Generator().manual_seed(3))  # padded rows
    r = _routing(E=5)
    x = torch.randn(r.num_tokens, model.hidden_size, generator=torch.Generator().manual_seed(4))
    seg = np.arange(len(r.experts))
    rows = np.array([5, 0, 3, 1, 4])[: len(seg)]
    gi = GroupIndex.build(r, seg, rows)
    tok = torch.from_numpy(gi.pairs // r.top_k)
    y = lay.forward_grouped(gi.span(table), x.index_select(0, tok), torch.from_numpy(gi.offs), gi.table_counts,
                            torch.from_numpy(gi.row_of_pairs()) if bias else None)
    a = 0
    for row, n in zip(gi.rows.tolist(), gi.counts.tolist()):
        xs = x.index_select(0, tok[a:a + n])
        one = lay.forward(table[row, :lay.numel], xs)
        torch.testing.assert_close(y[a:a + n], one, rtol=1e-5, atol=1e-5)
        assert torch.equal(lay.forward_prepared(lay.prepare(table[row, :lay.numel]), xs), one)  # (a staging turn's)
        a += n


def test_group_interval_is_divided_among_its_experts_by_rows():
    timer = Timer()
    t0 = timer.t0
    timer.add_group("gpu", 3, 1, np.array([5, 2]), np.array([1, 3]), t0 + 1.0, t0 + 2.0)
    ivs = timer.intervals()
    assert [iv.name for iv in ivs] == ["L1 E5", "L1 E2"]
    assert ivs[0].start == pytest.approx(1.0) and ivs[0].end == pytest.approx(1.25) and ivs[1].end == pytest.approx(2.0)
    assert ivs[1].args == {"step": 3, "tokens": 3, "group": 2}
