"""Real-model mode of the executor (``dali exec generate``): a transformers MoE model generates greedily
while its routed experts are offloaded by a system's policies (docs/executor.md, "Real models").

>>> result = generate(model, ["Hello"], "dali", GenerateOptions(residual="res.safetensors"), tokenizer=tok)
>>> result.generated[0].token_ids, result.summary["decode_tokens_per_s"]
"""

from dali_exec.generate.experts import HFExpertLayout, pack_experts
from dali_exec.generate.run import GenerateOptions, GenerateResult, GeneratedSequence, generate, generate_from_path
from dali_exec.generate.session import OffloadedExperts, OffloadSession

__all__ = ["GenerateOptions", "GenerateResult", "GeneratedSequence", "HFExpertLayout", "OffloadSession",
           "OffloadedExperts", "generate", "generate_from_path", "pack_experts"]
