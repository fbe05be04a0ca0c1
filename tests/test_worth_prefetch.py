"""worth-prefetch (ours): DALI's choice of experts, issued only when the GPU after the copy wins."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dali_sim.policies.base import PREFETCHERS
from dali_sim.policies.prefetch_gated import WorthPrefetchConfig, worth_copying
from conftest import WHOLE


class RoundCosts:
    """GPU 1 s per token, CPU 3 s per token, a copy 2 s (as tests/conftest.round_number_profile)."""

    def expert_time(self, device, n):
        return (1.0 if device == "gpu" else 3.0) * n

    def expert_transfer_time(self):
        return 2.0


def view(counts, ranks=None):
    counts = np.asarray(counts)
    return SimpleNamespace(
        layer=0, num_layers=2, costs=RoundCosts(),
        lookahead=lambda name, target: counts,
        lookahead_rank=(lambda name, target: np.asarray(ranks)) if ranks is not None else None)


def test_worth_copying_by_hand():
    c = RoundCosts()
    # no overlap: GPU n + 2 < CPU 3n  <=>  n > 1
    assert not worth_copying(c, 1, 0.0) and worth_copying(c, 2, 0.0)
    # half hidden: n + 1 < 3n  <=>  n > 0.5
    assert worth_copying(c, 1, 0.5)
    # fully hidden: n < 3n for any n >= 1
    assert worth_copying(c, 1, 1.0)


def test_only_worthwhile_predictions_are_prefetched():
    p = PREFETCHERS.get("worth-prefetch")(WorthPrefetchConfig(k=0, overlap=0.0))
    # predicted counts: e0 1 token, e1 2 tokens, e2 none, e3 3 tokens -> by count: 3, 1, 0; e0 not worth it
    assert p.prefetch(view([1, 2, 0, 3])) == [(1, 3), (1, 1)]
    # k limits DALI's candidates first, then the rule filters: k=1 -> only e3
    p1 = PREFETCHERS.get("worth-prefetch")(WorthPrefetchConfig(k=1, overlap=0.0))
    assert p1.prefetch(view([1, 2, 0, 3])) == [(1, 3)]
    # equal counts: the predictor's rank decides the order (e2 ranked first)
    p2 = PREFETCHERS.get("worth-prefetch")(WorthPrefetchConfig(k=1, overlap=0.5))
    assert p2.prefetch(view([1, 0, 1, 0], ranks=[1, 2, 0, 2])) == [(1, 2)]
    assert p2.prefetch(SimpleNamespace(layer=1, num_layers=2)) == []  # nothing after the last layer


def test_config_checks():
    with pytest.raises(ValueError, match=r"prefetch.overlap must lie in \[0, 1\]"):
        WorthPrefetchConfig(overlap=1.5)


def test_dali_plus_beats_dali_where_prefetch_does_not_pay(tmp_path):
    """Mixtral decode on the paper's testbed: one expert copy (~14 ms) costs more than its CPU time at
    one token (~2.9 ms), so dali's prefetches make the GPU wait; dali-plus skips them."""
    from dali_sim.sim import simulate
    from dali_sim.trace.synth import SynthConfig, synthesize

    path = tmp_path / "mix.parquet"
    synthesize(SynthConfig(model="mixtral-8x7b", sequences=2, prompt_len=8, gen_len=24, seed=3,
                           lookahead=("residual=0.9",)), path)
    dali = simulate(path, "dali", profiling=WHOLE).summary
    plus = simulate(path, "dali-plus", profiling=WHOLE).summary
    assert plus["prefetch_issued"] < dali["prefetch_issued"]
    assert plus["decode_s"] < dali["decode_s"]
