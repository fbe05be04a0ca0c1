"""``dali exec generate`` on a CUDA device (``python -m pytest -m gpu tests/test_exec_generate_gpu.py``).

The model's dense part runs on the GPU, experts from cache slots, prefetch and staging buffers after real
host-to-device copies from pinned memory, CPU experts on the CPU lane. CPU kernels are not the GPU's, so
logits are compared within a tolerance; the tokens must be the plain model's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from dali_exec.generate import GenerateOptions, generate  # noqa: E402
from dali_exec.models.tiny import char_tokenizer, tiny_model  # noqa: E402
from dali_exec.recorder import greedy_generate  # noqa: E402
from dali_exec.recorder.record import special_ids  # noqa: E402
from test_exec_generate import overrides_for, whole_layers_budget  # noqa: E402

PROMPTS = ["Hello world, this is", "abc", "The quick brown fox jumps", "0123456789"]
GPU_ONLY = ("gpu-lru", "mixtral-offloading", "moe-lightning")  # every expert computed on the GPU
WITH_CPU = ("cpu-only", "fiddler", "ktransformers")


def _plain(model, ids, new):
    eos, pad = special_ids(model, None)
    out = []
    for s in range(0, len(ids), 2):
        out += greedy_generate(model, ids[s:s + 2], max_new_tokens=new, eos_ids=eos, pad_id=pad).generated
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_cuda_equals_plain_generation(family, dtype):
    tok = char_tokenizer()
    model = tiny_model(family, seed=1).to("cuda", dtype)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    plain = _plain(model, ids, 8)
    systems = GPU_ONLY + (WITH_CPU if dtype == torch.float32 else ())  # bf16 CPU kernels round differently
    # the CPU tests' memory settings: a 2-expert cache, or one whole MoE layer on the GPU (moe-lightning:
    # the last layer resident, the other streamed; without a budget the tiny model's experts all fit)
    budget = whole_layers_budget(model, [len(i) for i in ids], 2, 8,
                                 precision="fp32" if dtype == torch.float32 else "bf16")
    for system in systems:
        over = overrides_for(system, budget)
        r = generate(model, PROMPTS, system, GenerateOptions(batch_size=2, max_new_tokens=8, device="cuda"),
                     tokenizer=tok, overrides=over)
        assert [g.token_ids for g in r.generated] == plain, system
        assert r.summary["executor"]["device"].startswith("cuda")
        assert r.manifest["executor"]["host_weights_pinned"]
        assert next(model.parameters()).device.type == "cuda"  # put back where it was
        s = r.summary
        if system in GPU_ONLY:
            assert s["cpu_experts"] == 0 and (s["on_demand"] + s["prefetch_used"]) > 0
        else:
            assert s["cpu_experts"] > 0
