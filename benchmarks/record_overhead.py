"""Recording overhead: ``record_trace`` against plain ``model.generate`` on the same prompts.

    python benchmarks/record_overhead.py                          # small random Qwen3-MoE, CPU, one thread
    python benchmarks/record_overhead.py --model models/dali-tiny-moe --batch-size 4
    python benchmarks/record_overhead.py --device cuda --dtype bfloat16 --json overhead.json

Every variant generates exactly ``--max-new-tokens`` tokens per prompt (EOS is switched off) from the
same random prompts, greedily. Times are the best of ``--repeats`` runs, variants interleaved (process
CPU time on the CPU, which other jobs on a shared machine disturb less than wall time; wall time on a
GPU); the ratio to ``generate`` is the overhead. ``loop`` is the recorder's own prefill/decode loop without
hooks, which separates the cost of the loop from that of the hooks and the writer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    # name: RecordOptions fields
    "record (ids+weights only)": dict(next_gate=False),
    "record (default: + next-gate)": dict(),
    "record + residual": dict(residual=True),
    "record + router logits": dict(router_logits=True),
    "record + hidden states": dict(hidden_states=True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Local transformers checkpoint folder (default: a small random Qwen3-MoE).")
    p.add_argument("--layers", type=int, default=8, help="Random model: blocks.")
    p.add_argument("--hidden", type=int, default=256, help="Random model: hidden size.")
    p.add_argument("--experts", type=int, default=32, help="Random model: routed experts per layer.")
    p.add_argument("--top-k", type=int, default=4, help="Random model: experts per token.")
    p.add_argument("--expert-size", type=int, default=256, help="Random model: expert intermediate size.")
    p.add_argument("--prompts", type=int, default=8, help="Number of prompts.")
    p.add_argument("--prompt-len", type=int, default=64, help="Tokens per prompt.")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="Write every measurement, the machine and the settings here.")
    return p.parse_args(argv)


def build_model(args):
    import torch

    from dali_exec.recorder.loading import DTYPES, load_model

    if args.model:
        model, _ = load_model(args.model, device=args.device, dtype=args.dtype, progress=False)
        return model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                            intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_size,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                            max_position_embeddings=4096, initializer_range=0.05)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from dali_exec.models import get_adapter
    from dali_exec.recorder import Prompt, RecordOptions, ResidualVectors, greedy_generate, record_trace
    from dali_exec.recorder.generation import left_pad

    model = build_model(args)
    model.generation_config.eos_token_id = None  # every prompt generates exactly max_new_tokens
    model.config.eos_token_id = None
    blocks = get_adapter(model).blocks(model)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(model.config.vocab_size)
    token_ids = [torch.randint(4, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    prompts = [Prompt(i, f"random-{i}", input_ids=tuple(ids)) for i, ids in enumerate(token_ids)]
    residuals = ResidualVectors({b.layer: torch.randn(b.hidden_size, generator=gen) * 0.1 for b in blocks[:-1]},
                                {"model_type": model.config.model_type}, "random")
    batches = [token_ids[i:i + args.batch_size] for i in range(0, len(token_ids), args.batch_size)]

    def run_generate():
        for batch in batches:
            ids, mask = left_pad(batch, 0, model.device)
            model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)

    def run_loop():
        for batch in batches:
            greedy_generate(model, batch, max_new_tokens=args.max_new_tokens)

    tmp = Path(tempfile.mkdtemp(prefix="dali-record-bench-"))

    def run_record(fields):
        fields = dict(fields)
        res = residuals if fields.pop("residual", False) else None
        options = RecordOptions(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, residuals=res,
                                **fields)
        return lambda: record_trace(model, prompts, tmp / "t.parquet", options=options)

    cases = {"generate": run_generate, "loop (no hooks)": run_loop}
    cases |= {name: run_record(fields) for name, fields in VARIANTS.items()}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for fn in cases.values():  # warm-up
        fn()
    wall = {name: float("inf") for name in cases}
    cpu = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    # On a CPU shared with other jobs, process CPU time is the steadier measure of the work done.
    times = cpu if model.device.type == "cpu" else wall
    measure = "process CPU time" if times is cpu else "wall time"

    tokens = args.prompts * (args.prompt_len + args.max_new_tokens)
    base = times["generate"]
    desc = args.model or (f"random Qwen3-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
                          f"top-{args.top_k}, expert size {args.expert_size}")
    print(f"model: {desc}")
    print(f"{args.prompts} prompts x ({args.prompt_len} prompt + {args.max_new_tokens} new tokens), batch "
          f"{args.batch_size}, {args.device} {args.dtype}, {args.threads} thread(s), "
          f"best of {args.repeats} ({measure})")
    loop = times["loop (no hooks)"]
    print(f"{'variant':34s} {'seconds':>8s} {'tokens/s':>9s} {'vs generate':>12s} {'vs loop':>9s}")
    for name, t in times.items():
        print(f"{name:34s} {t:8.3f} {tokens / t:9.0f} {100 * (t / base - 1):+11.1f}% {100 * (t / loop - 1):+8.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": vars(args), "model": desc, "measure": measure, "wall_seconds": wall,
            "cpu_seconds": cpu,
            "overhead_vs_generate": {k: v / base - 1 for k, v in times.items()},
            "overhead_vs_loop": {k: v / loop - 1 for k, v in times.items()},
            "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                        "processor": platform.processor(), "torch": torch.__version__},
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
