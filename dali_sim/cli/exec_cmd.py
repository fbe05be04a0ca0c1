"""``dali exec``: run offloading systems on real devices with torch (docs/executor.md).

dali_sim never imports torch: every command imports :mod:`dali_exec` inside its body.
"""

from __future__ import annotations

from pathlib import Path

import click

from dali_sim.cli.common import UserErrorGroup, command_line
from dali_sim.cli.sim import _overrides, format_run
from dali_sim.sim.simulate import DEFAULT_HARDWARE

DTYPES = ("bf16", "fp16", "fp32")


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    return values


def _exec_module():
    try:
        import dali_exec.executor as ex
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    return ex


@click.group(name="exec", cls=UserErrorGroup)
def exec_group() -> None:
    """Run offloading systems on real devices (torch): trace replay and calibration."""


@exec_group.command("run")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Trace to replay (.parquet).")
@click.option("--system", required=True, help="System preset (see `dali sim systems`).")
@click.option("--model-shape", help="Model shape preset to build (default: the trace's model); must match the trace.")
@click.option("--layers", type=int, help="Replay only the first N MoE layers.")
@click.option("--scale", default=1.0, show_default=True, type=float,
              help="Multiply hidden, intermediate and head sizes by F (0 < F <= 1); the budget scales with them.")
@click.option("--sequences", type=int, help="Replay only the first N sequences of the trace.")
@click.option("--max-tokens", type=int, help="Replay only the first N tokens of each sequence.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), help="Accelerator (default: cuda if present, else the CPU device).")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True, help="Weight storage of the replay.")
@click.option("--precision", help="Weight format of the full model for the memory plan (default: the model's).")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True,
              help="Hardware profile whose costs the policies use (a name or a measured profile for the replay model) "
                   "and whose GPU memory is the default budget.")
@click.option("--batch-size", default=1, show_default=True, type=int, help="Sequences per batch.")
@click.option("--prefill-chunk", default=0, show_default=True, type=int,
              help="Prompt positions per prefill step (0 = whole prompt in one step).")
@click.option("--gpu-memory", type=float, help="GPU memory budget of the full-size model in GiB (default: the profile's).")
@click.option("--cache-ratio", type=float, help="Cache slots per layer as a fraction of its experts.")
@click.option("--cache-experts", type=int, help="Cache slots per layer.")
@click.option("--cache-init", type=click.Choice(["empty", "random", "frequency"]), help="Initial cache contents.")
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a system parameter (repeatable).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the policies and of the random weights.")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane (default: all cores, or half of them without CUDA).")
@click.option("--accel-threads", type=int, help="Threads of the accelerator lane when it is the CPU device (default: the rest).")
@click.option("--timeline", type=click.Path(path_type=Path), help="Write a Chrome/Perfetto trace JSON here.")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the per-layer table as CSV here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def run_cmd(trace_path, system, model_shape, layers, scale, sequences, max_tokens, device, dtype, precision, hardware,
            batch_size, prefill_chunk, seed, cpu_threads, accel_threads, timeline, csv_path, as_json, **kw) -> None:
    """Replay a trace's routing on real devices with random weights of the model's shape."""
    if kw["cache_ratio"] is not None and kw["cache_experts"] is not None:
        raise click.UsageError("give --cache-ratio or --cache-experts, not both")
    ex = _exec_module()
    from dali_sim.sim.timeline import write_timeline

    options = ex.ReplayOptions(model_shape=model_shape, layers=layers, scale=scale, sequences=sequences,
                               max_tokens=max_tokens, precision=precision, dtype=dtype)
    run_opts = ex.ExecOptions(device=device, cpu_threads=cpu_threads, accel_threads=accel_threads, progress=True)
    result = ex.execute(trace_path, system, options, run_opts, hardware=hardware, batch_size=batch_size,
                        prefill_chunk=prefill_chunk, seed=seed, overrides=_overrides(kw))
    result.manifest["command"] = command_line()
    if timeline:
        write_timeline(timeline, result.intervals, f"dali exec {system} on {trace_path}")
    if csv_path:
        result.per_layer.to_csv(csv_path)
    if as_json:
        click.echo(result.to_json())
        return
    click.echo(format_run(result))
    ov, e = result.summary["overhead"], result.manifest["executor"]
    rep = e["replay"]
    click.echo(f"executed on {e['devices']['accelerator_name']} ({rep['dtype']}), CPU lane {e['cpu_threads']} threads: "
               f"{result.summary['model']} ({rep['layers']} MoE layers, scale {rep['scale']:g} of {rep['full_model']}), "
               f"{e['slot_bytes'] / 2**20:,.1f} MiB of expert slots")
    click.echo(f"overhead per layer: decisions {ov['decision_us_per_layer']:,.1f} us + bookkeeping "
               f"{ov['bookkeeping_us_per_layer']:,.1f} us = {100 * ov['fraction_of_layer_time']:.1f}% of "
               f"{ov['layer_time_us']:,.1f} us")
    if timeline:
        click.echo(f"timeline: {timeline} (open in ui.perfetto.dev)")


@exec_group.command("calibrate")
@click.option("--model-shape", required=True, help="Model shape preset (see `dali model list`).")
@click.option("--scale", default=1.0, show_default=True, type=float, help="Calibrate the shape scaled as `dali exec run --scale`.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), help="Accelerator (default: cuda if present, else the CPU device).")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True, help="Weight storage.")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane.")
@click.option("--accel-threads", type=int, help="Threads of the accelerator lane when it is the CPU device.")
@click.option("--expert-tokens", default="1,2,4,8,16,32,64,128,256", show_default=True, help="Token counts of the expert tables.")
@click.option("--dense-tokens", default="1,4,16,64", show_default=True, help="Token counts of the dense tables.")
@click.option("--context-lens", default="1,256,1024", show_default=True, help="Cached tokens per query of the dense tables.")
@click.option("--repeats", default=5, show_default=True, type=int, help="Timed runs per point (the median is kept).")
@click.option("--warmup", default=2, show_default=True, type=int, help="Untimed runs before each point.")
@click.option("--name", help="Profile name (default: measured-MODEL-DEVICE).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Profile JSON to write.")
def calibrate_cmd(model_shape, scale, device, dtype, cpu_threads, accel_threads, expert_tokens, dense_tokens,
                  context_lens, repeats, warmup, name, output) -> None:
    """Measure expert, transfer and dense times and write a measured hardware profile (docs/hardware.md)."""
    _exec_module()
    from dali_exec.calibrate import CalibrationConfig, MicroSettings, calibrate_to

    cfg = CalibrationConfig(model_shape, scale=scale, dtype=dtype, device=device, cpu_threads=cpu_threads,
                            accel_threads=accel_threads, expert_tokens=_ints(expert_tokens, "--expert-tokens"),
                            dense_tokens=_ints(dense_tokens, "--dense-tokens"),
                            context_lens=_ints(context_lens, "--context-lens"),
                            settings=MicroSettings(repeats=repeats, warmup=warmup), name=name)
    path = calibrate_to(output, cfg, command=command_line(), progress=True)
    click.echo(f"wrote {path}: use it with `dali sim run --hardware {path}` (a trace of this shape) "
               f"or `dali exec run --hardware {path} --scale {scale:g}`")
