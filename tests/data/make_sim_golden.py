"""Write tests/data/sim-golden.parquet: the hand-listed trace of the simulator's golden-number tests.

Deterministic: every row is listed below (nothing random). Run from the repository root:

    python tests/data/make_sim_golden.py [OUT]

Model "golden-moe": 2 blocks, both MoE (layers 0, 1), 5 experts, top-2, a tiny shape (hidden 8,
expert intermediate 16: one expert = 384 bf16 parameters = 768 bytes). Two sequences:

    seq 0: prefill pos 0, 1, 2;  decode pos 3, 4, 5
    seq 1: prefill pos 0, 1;     decode pos 2, 3

At batch size 1 the workload has 7 steps (seq 0: prefill step 0, decode steps 1-3; seq 1: prefill
step 4, decode steps 5, 6). Touch order per (step, layer) (descending workload, best rank, id), the
workloads in brackets where a step has more than one token:

    step            0                   1      2      3      4                5      6
    layer 0   0,1,3,2 [2,2,1,1]        4,0    4,2    3,1    4,2,3 [2,1,1]    0,2    2,3
    layer 1   2,3,4   [3,2,1]          0,1    2,0    4,3    1,0,4 [2,1,1]    3,1    4,3

(17 activated experts in layer 0, 16 in layer 1, 33 in all; 20 expert-token pairs per layer.) Total
workload per expert, ids 0..4: layer 0 [4, 3, 5, 4, 4], layer 1 [3, 4, 4, 5, 4]. The golden numbers and their
derivations are in tests/test_sim_golden.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dali_sim.models.spec import AttentionSpec, ModelSpec
from dali_sim.trace import SequenceInfo, TraceWriter

GOLDEN = ModelSpec(
    name="golden-moe", family="test", num_layers=2, moe_layers=(0, 1), num_experts=5, top_k=2,
    hidden_size=8, expert_intermediate_size=16,
    attention=AttentionSpec(kind="gqa", num_heads=1, num_kv_heads=1, head_dim=8), vocab_size=16,
    source="hand-written test model (tests/data/make_sim_golden.py)",
)

# (seq_id, pos, phase, experts of layer 0 in rank order, experts of layer 1 in rank order)
TOKENS = [
    (0, 0, "prefill", [0, 1], [2, 3]),
    (0, 1, "prefill", [1, 2], [2, 4]),
    (0, 2, "prefill", [3, 0], [3, 2]),
    (0, 3, "decode", [4, 0], [0, 1]),
    (0, 4, "decode", [4, 2], [2, 0]),
    (0, 5, "decode", [3, 1], [4, 3]),
    (1, 0, "prefill", [2, 4], [1, 0]),
    (1, 1, "prefill", [4, 3], [1, 4]),
    (1, 2, "decode", [0, 2], [3, 1]),
    (1, 3, "decode", [2, 3], [4, 3]),
]

# gate weights: 0.75 for rank 0, 0.25 for rank 1 (the simulator does not use them)
WEIGHTS = [0.75, 0.25]


def write(out: Path) -> Path:
    sequences = [
        SequenceInfo(0, "seq0", prompt_tokens=3, generated_tokens=3),
        SequenceInfo(1, "seq1", prompt_tokens=2, generated_tokens=2),
    ]
    provenance = {"source": "hand-written", "command": "python tests/data/make_sim_golden.py"}
    with TraceWriter(out, GOLDEN, provenance=provenance, sequences=sequences) as w:
        for seq_id, pos, phase, l0, l1 in TOKENS:
            for layer, experts in ((0, l0), (1, l1)):
                w.write(seq_id=seq_id, phase=phase, pos=pos, layer=layer, experts=np.array([experts]),
                        weights=np.array([WEIGHTS], np.float32))
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("sim-golden.parquet")
    print(write(target))
