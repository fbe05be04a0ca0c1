"""`dali exec generate` speed against plain transformers `generate` on the same prompts.

    python benchmarks/generate_speed.py                           # shipped model, CPU, one thread
    python benchmarks/generate_speed.py --systems cpu-only,dali --repeats 5 --json gen.json
    python benchmarks/generate_speed.py --device cuda --dtype bfloat16     # wall time on a GPU

The model (default ``models/dali-tiny-moe``) is loaded once; per repeat, plain ``model.generate``
(greedy, left padding, batches of ``--batch-size``) and ``dali_exec.generate.generate`` under each system
run one after another on the first ``--prompts`` prompts of ``--prompts-file``, ``--max-new-tokens`` each.
Times are the best of ``--repeats`` runs after one warm-up of each: process CPU time on the CPU (every
thread of the process: the main thread, the copy lane and the CPU lane; steadier than the wall clock on a
machine shared with other jobs) and wall time on CUDA. ``x plain`` is the ratio of the best times to plain
``generate``'s; ``paired`` the median over the repeats of each repeat's own ratio (a system's run over the plain
run of the same repeat, which ran just before it): a machine whose speed drifts between repeats moves the first,
one slow plain run can move it by a tenth, and the second less.
Every system's generated tokens are compared with the plain run's (``same``). The default memory
settings are those of docs/executor.md's example (``--cache-experts 8`` for systems with a uniform cache);
``dali``/``dali-plus`` read the model's ``residual.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_CACHE_SETTING = {"cpu-only", "llamacpp", "moe-lightning"}  # their memory layout sets the cache


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "models" / "dali-tiny-moe"), help="local checkpoint folder")
    p.add_argument("--prompts-file", default=str(REPO / "prompts" / "multidomain.txt"))
    p.add_argument("--prompts", type=int, default=8, help="the first N prompts of the file")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--systems", default="cpu-only,gpu-lru,fiddler,ktransformers,llamacpp,dali,hybrimoe")
    p.add_argument("--cache-experts", type=int, default=8, help="memory.cache_experts of uniform-cache systems")
    p.add_argument("--residual", help="residual vectors (default: the model folder's residual.safetensors)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (both lanes use the same count)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write every measurement, the machine and the settings here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from dali_exec.generate import GenerateOptions, generate
    from dali_exec.recorder.generation import left_pad
    from dali_exec.recorder.loading import load_model
    from dali_exec.recorder.prompts import read_prompts, tokenize
    from dali_exec.recorder.record import special_ids

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, device=a.device, dtype=a.dtype, progress=False)
    prompts = read_prompts(a.prompts_file)[: a.prompts]
    ids = tokenize(prompts, tok, a.prompts_file)
    eos, pad = special_ids(model, tok)
    residual = a.residual or str(Path(a.model) / "residual.safetensors")
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def plain():
        out = []
        for s in range(0, len(ids), a.batch_size):
            x, mask = left_pad(ids[s:s + a.batch_size], pad, model.device)
            with torch.no_grad():
                y = model.generate(x, attention_mask=mask, max_new_tokens=a.max_new_tokens, do_sample=False,
                                   pad_token_id=pad)
            for row in y[:, x.shape[1]:].tolist():
                keep = []
                for t in row:
                    keep.append(t)
                    if t in eos:
                        break
                out.append(keep)
        return out

    def offloaded(system):
        over = None if system in NO_CACHE_SETTING else {"memory": {"cache_experts": str(a.cache_experts)}}
        opts = GenerateOptions(batch_size=a.batch_size, max_new_tokens=a.max_new_tokens, device=a.device,
                               residual=residual if system.startswith("dali") else None)
        r = generate(model, prompts, system, opts, tokenizer=tok, overrides=over)
        return [g.token_ids for g in r.generated], r

    cases = {"plain generate": plain} | {s: (lambda s=s: offloaded(s)) for s in a.systems.split(",") if s}
    reference = plain()
    same: dict[str, bool] = {}
    overhead: dict[str, dict] = {}
    for name, fn in cases.items():  # warm-up
        out = fn()
        if name != "plain generate":
            same[name] = out[0] == reference
            overhead[name] = out[1].summary["overhead"]
    wall = dict.fromkeys(cases, float("inf"))
    cpu = dict.fromkeys(cases, float("inf"))
    rounds: dict[str, list[float]] = {name: [] for name in cases}  # each repeat's time (wall on CUDA, else CPU)
    for r in range(a.repeats):
        if r:  # the best so far after each round: a run stopped by a time limit (scripts/gpu_check.sh) keeps it
            best = wall if cuda else cpu
            print(f"after round {r}: " + ", ".join(f"{n} {best[n]:.3f} s ({best[n] / best['plain generate']:.2f}x)"
                                                  for n in cases), flush=True)
        for name, fn in cases.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            sync()
            w, c = time.perf_counter() - t0, time.process_time() - c0
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
            rounds[name].append(w if cuda else c)
            if name != "plain generate":
                same[name] = same[name] and out[0] == reference
                overhead[name] = out[1].summary["overhead"]  # of the last timed run (the warm-up compiles)
    times, measure = (wall, "wall time") if cuda else (cpu, "process CPU time")
    base = times["plain generate"]
    paired = {name: [t / p for t, p in zip(rounds[name], rounds["plain generate"])] for name in cases}
    paired_median = {name: statistics.median(v) if v else float("nan") for name, v in paired.items()}
    load = os.getloadavg()
    print(f"model {a.model}; {len(prompts)} prompts, batch {a.batch_size}, {a.max_new_tokens} new tokens; "
          f"{a.device} {a.dtype}, {a.threads} thread(s); best of {a.repeats} ({measure}); load average "
          f"{', '.join(f'{x:.2f}' for x in load)}")
    print(f"{'system':16s} {'seconds':>8s} {'x plain':>8s} {'paired':>7s} {'wall s':>8s} {'same':>5s} "
          f"{'decision us':>12s} {'bookkeeping us':>15s} (per layer visit, thread CPU)")
    for name in cases:
        ov = overhead.get(name, {})
        print(f"{name:16s} {times[name]:8.3f} {times[name] / base:8.2f} {paired_median[name]:7.2f} {wall[name]:8.3f} "
              f"{('yes' if same[name] else 'NO') if name in same else '':>5s} "
              f"{ov.get('decision_cpu_us_per_layer', float('nan')):12.1f} "
              f"{ov.get('bookkeeping_cpu_us_per_layer', float('nan')):15.1f}")
    if a.json:
        a.json.write_text(json.dumps({
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "measure": measure,
            "seconds": times, "wall_seconds": wall, "cpu_seconds": cpu,
            "ratio_to_plain": {k: v / base for k, v in times.items()}, "paired_ratio_median": paired_median,
            "paired_ratios": paired, "round_seconds": rounds, "same_tokens": same, "overhead": overhead,
            "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                        "load_average": load, "torch": torch.__version__,
                        "device": torch.cuda.get_device_name() if cuda else "cpu"},
        }, indent=2))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
