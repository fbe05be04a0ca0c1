"""Write tests/data/golden-tiny.parquet: a hand-designed trace for the golden statistics tests.

Deterministic: every row is listed below (nothing random). Run from anywhere:

    python tests/data/make_golden_tiny.py [OUT]

Model "tiny-moe": 3 blocks, all MoE (layers 0, 1, 2), 4 experts, top-2. One lookahead predictor
"next" (target_offset 1): rows at layers 0 and 1 carry predicted router logits of layers 1 and 2; rows
at layer 2 have none (null). Three sequences:

    seq 0: prefill pos 0, 1; decode pos 2, 3
    seq 1: prefill pos 0;    decode pos 1, 2
    seq 2: prefill pos 0 (a single-token sequence: no reuse pairs)

The expected statistics are derived by hand in tests/test_stats.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.trace import PredictorInfo, SequenceInfo, TraceWriter

TINY = ModelSpec(
    name="tiny-moe", family="test", num_layers=3, moe_layers=(0, 1, 2), num_experts=4, top_k=2,
    hidden_size=8, expert_intermediate_size=16,
    attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8), vocab_size=16,
    source="hand-written test model (tests/data/make_golden_tiny.py)",
)

NONE = None  # no lookahead prediction (layer 2 has no next MoE layer)

# (seq_id, pos, phase, {layer: (experts in rank order, predicted logits of the next layer or NONE)})
TOKENS = [
    (0, 0, "prefill", {0: ([0, 1], [0.0, 2.0, 1.0, 1.5]),
                       1: ([1, 3], [1.0, 0.0, 2.0, 0.0]),
                       2: ([2, 0], NONE)}),
    (0, 1, "prefill", {0: ([0, 2], [0.0, 2.0, 0.5, 1.0]),
                       1: ([1, 2], [1.0, 0.0, 2.0, 0.0]),
                       2: ([2, 0], NONE)}),
    (0, 2, "decode", {0: ([0, 1], [2.0, 1.0, 0.0, 0.5]),
                      1: ([1, 3], [1.0, 0.0, 2.0, 0.0]),
                      2: ([0, 2], NONE)}),
    (0, 3, "decode", {0: ([1, 0], [-1.0, 3.0, 0.0, 2.0]),
                      1: ([3, 1], [1.0, 0.0, 2.0, 0.0]),
                      2: ([2, 1], NONE)}),
    (1, 0, "prefill", {0: ([2, 3], [1.0, 0.5, 0.5, 0.0]),  # tie 1 vs 2 for the 2nd slot -> id 1
                       1: ([0, 2], [0.0, 0.0, 2.0, 1.0]),
                       2: ([2, 3], NONE)}),
    (1, 1, "decode", {0: ([3, 2], [0.0, 1.0, 2.0, 3.0]),
                      1: ([0, 2], [0.0, 1.0, 2.0, 0.0]),
                      2: ([2, 3], NONE)}),
    (1, 2, "decode", {0: ([3, 0], [0.1, 0.2, 0.3, 0.4]),
                      1: ([0, 2], [0.0, 0.0, 2.0, 0.0]),  # tie 0/1/3 for the 2nd slot -> id 0
                      2: ([2, 1], NONE)}),
    (2, 0, "prefill", {0: ([1, 2], [5.0, 0.0, 0.0, 4.0]),
                       1: ([0, 3], [3.0, 0.0, 1.0, 0.0]),
                       2: ([2, 0], NONE)}),
]

# gate weights: 0.75 for rank 0, 0.25 for rank 1 (statistics do not use them)
WEIGHTS = [0.75, 0.25]


def write(out: Path) -> Path:
    predictor = PredictorInfo("next", 1, "hand-written predicted logits of the next MoE layer")
    sequences = [
        SequenceInfo(0, "seq0", prompt_tokens=2, generated_tokens=2),
        SequenceInfo(1, "seq1", prompt_tokens=1, generated_tokens=2),
        SequenceInfo(2, "seq2", prompt_tokens=1, generated_tokens=0),
    ]
    provenance = {"source": "hand-written", "command": "python tests/data/make_golden_tiny.py"}
    with TraceWriter(out, TINY, provenance=provenance, predictors=[predictor], sequences=sequences) as w:
        for seq_id, pos, phase, layers in TOKENS:
            for layer, (experts, logits) in layers.items():
                pred = np.full((1, 4), np.nan, np.float32) if logits is None else np.array([logits], np.float32)
                w.write(seq_id=seq_id, phase=phase, pos=pos, layer=layer, experts=np.array([experts]),
                        weights=np.array([WEIGHTS], np.float32), lookahead={"next": pred})
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("golden-tiny.parquet")
    print(write(target))
