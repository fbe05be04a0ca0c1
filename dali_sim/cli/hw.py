"""``dali hw``: list and show hardware profiles, and tabulate the costs they give for a model."""

from __future__ import annotations

import json

import click

from dali_sim.hardware.profile import HardwareProfile, ProfileError, load_profile, profile_names
from dali_sim.models import resolve_model
from dali_sim.registry import UnknownNameError

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
CROSSOVER_SEARCH_TOKENS = 8192  # display range of the CLI, not a cost
_USER_ERRORS = (ProfileError, UnknownNameError, ValueError, OSError)


def _load(name_or_path: str):
    try:
        return load_profile(name_or_path)
    except _USER_ERRORS as e:
        raise click.ClickException(str(e)) from None


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--tokens") from None
    if not tokens or min(tokens) < 0:
        raise click.BadParameter(f"expected non-negative integers, got {text!r}", param_hint="--tokens")
    return tokens


@click.group(name="hw")
def hw() -> None:
    """Hardware profiles and the cost model."""


@hw.command(name="list")
def list_cmd() -> None:
    """List the shipped hardware profiles."""
    for name in profile_names():
        p = load_profile(name)
        click.echo(f"{name:24s} {p.kind:9s} {p.description}")


@hw.command(name="show")
@click.argument("profile")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def show_cmd(profile: str, as_json: bool) -> None:
    """Show a profile (shipped NAME or a .toml/.json PATH) with the source of every number."""
    p = _load(profile)
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    click.echo(f"{p.name} ({p.kind}): {p.description}")
    if p.path:
        click.echo(f"file: {p.path}")
    if isinstance(p, HardwareProfile):
        for part in ("gpu", "cpu", "link"):
            spec = getattr(p, part)
            click.echo(f"{part}: {spec.name}")
            for f in spec.__dataclass_fields__:
                if f == "name":
                    continue
                value = getattr(spec, f)
                if value is None:
                    continue
                shown = ", ".join(f"{k}={v:g}" for k, v in value.items()) if isinstance(value, dict) else f"{value:g}"
                click.echo(f"  {f:20s} {shown}")
                src = p.sources.get(f"{part}.{f}")
                if src:
                    click.echo(f"  {'':20s} source: {src}")
    else:
        click.echo(f"gpu: {p.gpu.name} ({p.gpu.memory_gib:g} GiB)")
        click.echo(f"cpu: {p.cpu.name} ({p.cpu.memory_gib:g} GiB)")
        click.echo(f"link: {p.link_name}")
        click.echo(f"measured for: {p.model.model} at {p.model.precision} (expert_bytes={p.model.expert_bytes})")
        for k, v in p.to_dict()["tables"].items():
            rows = next((a for a in ("context_lens", "queries") if a in v), None)  # a two-dimensional table's rows
            axis = next(a for a in v if a not in ("seconds", rows))
            extra = f" x {len(v[rows])} {'context lengths' if rows == 'context_lens' else 'new tokens per sequence'}" if rows else ""
            click.echo(f"  table {k}: {len(v[axis])} {axis} points{extra}")
        if p.contention is not None:
            click.echo("contention (slowdown of each lane while the others run):")
            for key, factors in p.contention.items():
                click.echo(f"  {key:12s} " + ", ".join(f"{lane} x{f:.2f}" for lane, f in factors.items()))
        if p.host is not None:
            h = p.host
            click.echo(f"executor host time: {1e6 * h.layer_s:.0f} us per layer visit + {1e6 * h.gpu_expert_s:.0f} us per "
                       f"GPU expert + {1e6 * h.cpu_expert_s:.0f} us per CPU expert + {1e6 * h.copy_s:.0f} us per copy; "
                       "decisions per layer visit: " + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in h.decision_s.items()))
        if p.lanes is not None:
            click.echo("a grouped call's fixed part: " + ", ".join(f"{d} lane {1e6 * v:.0f} us" for d, v in p.lanes.items()))
        if p.lane_wake is not None:
            wake = {"cpu": "a CPU-lane call after its worker slept", "gpu": "the accelerator's call beside that wake-up",
                    "host": "the host's hand-over to a sleeping thread"}
            click.echo("sleeping threads: " + ", ".join(f"{what} +{1e6 * p.lane_wake[d]:.0f} us" for d, what in wake.items()
                                                      if d in p.lane_wake))
        click.echo(f"provenance: {json.dumps(dict(p.provenance))}")


@hw.command(name="cost")
@click.argument("profile")
@click.option("--model", "model_name", required=True,
              help="Model: a preset (see `dali model list`; scaled ones too, e.g. mixtral-8x7b-x0.125), a config.json "
                   "or a model folder, as `dali model show` takes.")
@click.option("--precision", default=None, help="Weight precision (default: the preset's).")
@click.option("--tokens", default=DEFAULT_TOKENS, show_default=True, help="Comma-separated token counts.")
@click.option("--context-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="Cached tokens each query attends to, for the dense time (decode layout).")
@click.option("--implementation", default="bare", show_default=True,
              help="Implementation whose per-call costs to include (docs/hardware.md, 'Implementations'); bare = the "
                   "roofline alone.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def cost_cmd(profile: str, model_name: str, precision: str | None, tokens: str, context_len: int, implementation: str,
             as_json: bool) -> None:
    """Expert time on GPU and CPU per token count, one expert's transfer, dense time, crossover."""
    from dali_sim.hardware.cost import CostModel

    counts = _parse_tokens(tokens)
    limit = max(CROSSOVER_SEARCH_TOKENS, max(counts))
    p = _load(profile)
    try:
        model = resolve_model(model_name, precision)
        cm = CostModel(p, model, implementation=implementation, lookup_tokens=limit)
        crossover = cm.crossover_tokens(max_tokens=limit)
        crossover_overlap = cm.crossover_tokens(overlap=True, max_tokens=limit)
        rows = [
            {
                "tokens": n,
                "gpu_s": cm.expert_time("gpu", n),
                "cpu_s": cm.expert_time("cpu", n),
                "gpu_uncached_s": cm.uncached_gpu_time(n),
                "dense_gpu_s": cm.dense_time("gpu", n, context_len),
                "dense_cpu_s": cm.dense_time("cpu", n, context_len),
            }
            for n in counts
        ]
    except _USER_ERRORS as e:
        raise click.ClickException(str(e)) from None
    result = {
        "profile": p.name,
        "kind": p.kind,
        "model": model.name,
        "precision": model.precision_label,
        "implementation": cm.impl.name,
        "expert_bytes": model.expert_bytes,
        "expert_transfer_s": cm.expert_transfer_time(),
        "context_len": context_len,
        "crossover_tokens": crossover,
        "crossover_tokens_overlap": crossover_overlap,
        "rows": rows,
    }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{p.name} ({p.kind}), {model.name} at {model.precision_label}, implementation {cm.impl.name}: one expert = "
               f"{model.expert_bytes / 1e6:.1f} MB, transfer {cm.expert_transfer_time() * 1e3:.3f} ms")
    click.echo(f"dense part of one MoE layer at context_len={context_len}")
    header = ("tokens", "gpu_ms", "cpu_ms", "gpu+h2d_ms", "dense_gpu_ms", "dense_cpu_ms")
    click.echo("".join(f"{h:>14s}" for h in header))
    for r in rows:
        values = (r["gpu_s"], r["cpu_s"], r["gpu_uncached_s"], r["dense_gpu_s"], r["dense_cpu_s"])
        click.echo(f"{r['tokens']:>14d}" + "".join(f"{v * 1e3:>14.3f}" for v in values))

    def said(n: int | None) -> str:
        return f"from {n} tokens" if n is not None else f"never (up to {limit} tokens)"

    click.echo(f"crossover: an uncached expert is faster on the GPU (transfer + compute) {said(crossover)}; "
               f"with transfer overlapped (max) {said(crossover_overlap)}")
