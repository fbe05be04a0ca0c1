"""``dali exec``: run offloading systems on real devices with torch (docs/executor.md).

dali_sim never imports torch: every command imports :mod:`dali_exec` inside its body.
"""

from __future__ import annotations

from pathlib import Path

import click

from dali_sim.cli.common import (GIB_TYPE, MAX_NEW_TOKENS, MODEL_DTYPE, REPLAY_DTYPE, SEED_TYPE, UserErrorGroup,
                                 check_outputs, checkpoint_files, command_line, require_exec)
from dali_sim.files import check_output, write_text_atomic
from dali_sim.cli.sim import (CPU_DEVICE_LANES, format_run, option_group, overrides, policy_options, profile_options,
                              profile_spec)
from dali_sim.hardware.profile import DEFAULT_HARDWARE



def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    return values


def _micro(**settings):
    """The calibration's :class:`MicroSettings`, a bad value as a one-line usage error."""
    from dali_exec.calibrate import MicroSettings

    try:
        return MicroSettings(**settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


#: what to replay and on what: shared by `run` and `validate` (read with :func:`replay_config`)
replay_options = option_group(
    click.option("--model-shape", help="Model shape preset to build (default: the trace's model); must match the trace."),
    click.option("--layers", type=int, help="Replay only the first N MoE layers."),
    click.option("--scale", default=1.0, show_default=True, type=float,
                 help="Multiply hidden, intermediate and head sizes by F (0 < F <= 1); the budget scales with them."),
    click.option("--sequences", type=int, help="Replay only the first N sequences of the trace."),
    click.option("--max-tokens", type=int, help="Replay only the first N tokens of each sequence."),
    click.option("--device", type=click.Choice(["cuda", "cpu"]),
                 help="Accelerator (default: cuda if present, else the CPU device)."),
    click.option("--dtype", type=REPLAY_DTYPE, default="bf16", show_default=True,
                 help="Weight storage of the replay (bfloat16, float16, float32 also accepted)."),
    click.option("--precision", help="Weight format of the full model for the memory plan (default: the model's)."),
)


def _emit(result, timeline: Path | None, csv_path: Path | None, as_json: bool, title: str) -> bool:
    """Write the optional timeline and per-layer CSV, then print the result: JSON (returns True, the
    caller is done) or the text summary of `dali sim run` (returns False, the caller adds its lines)."""

    from dali_sim.sim.timeline import write_timeline

    result.manifest["command"] = command_line()
    if timeline:
        write_timeline(timeline, result.intervals, title)
    if csv_path:
        write_text_atomic(csv_path, result.per_layer.to_csv())
    if as_json:
        click.echo(result.to_json())
        return True
    devices = result.manifest["executor"]["devices"]
    on_cpu = devices["accelerator"] == "cpu"  # the profile then only gives the policies' costs
    click.echo(format_run(result, executed_on=devices["accelerator_name"],
                          lanes=CPU_DEVICE_LANES if on_cpu else None))
    return False


def _profile_file(hardware: str) -> list[Path]:
    return [Path(hardware)] if Path(hardware).is_file() else []


def _exec_module():
    return require_exec("dali_exec.executor")


@click.group(name="exec", cls=UserErrorGroup)
def exec_group() -> None:
    """Run offloading systems on real devices (torch).

    \b
    run         replay a trace's routing with random weights of its model's shape
    generate    generate with a real transformers model, its MoE experts offloaded
    calibrate   measure a hardware profile for the simulator
    validate    run executor and simulator side by side and report the error
    """


#: dali_exec.executor.doorbell.DEFAULT_SPIN_US (this module imports no torch; a test keeps the two equal)
DEFAULT_SPIN_US = 1000.0
spin_option = click.option(
    "--spin-us", type=click.FloatRange(min=0, max=1e6), default=DEFAULT_SPIN_US, show_default=True,
    help="Microseconds the CPU lane's worker spins for its next job before it sleeps (0: it sleeps at once; a job "
         "that finds it spinning needs no wake-up, at the price of a busy core meanwhile).")


@exec_group.command("run")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Trace to replay (.parquet).")
@click.option("--system", required=True, help="System preset (see `dali sim systems`).")
@replay_options
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True,
              help="Hardware profile whose costs the policies use (a name or a measured profile for the replay model) "
                   "and whose GPU memory is the default budget.")
@click.option("--batch-size", default=1, show_default=True, type=int, help="Sequences per batch.")
@click.option("--prefill-chunk", default=0, show_default=True, type=int,
              help="Prompt positions per prefill step (0 = whole prompt in one step).")
@click.option("--gpu-memory", type=GIB_TYPE,
              help="GPU memory budget of the full-size model in GiB (default: the profile's).")
@policy_options
@profile_options
@click.option("--seed", default=0, show_default=True, type=SEED_TYPE,
              help="Seed of the policies and of the random weights.")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane (default: all cores, or half of them without CUDA).")
@click.option("--accel-threads", type=int, help="Threads of the accelerator lane when it is the CPU device (default: the rest).")
@spin_option
@click.option("--timeline", type=click.Path(path_type=Path), help="Write a Chrome/Perfetto trace JSON here.")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the per-layer table as CSV here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def run_cmd(trace_path, system, model_shape, layers, scale, sequences, max_tokens, device, dtype, precision, hardware,
            batch_size, prefill_chunk, seed, cpu_threads, accel_threads, spin_us, timeline, csv_path, as_json,
            **kw) -> None:
    """Replay a trace's routing on real devices with random weights of the model's shape."""
    profiling = profile_spec(kw)
    check_outputs({"timeline": timeline, "CSV table": csv_path},
                  [trace_path, kw["profile_trace"], *_profile_file(hardware)])
    ex = _exec_module()
    options = ex.ReplayOptions(model_shape=model_shape, layers=layers, scale=scale, sequences=sequences,
                               max_tokens=max_tokens, precision=precision, dtype=dtype)
    run_opts = ex.ExecOptions(device=device, cpu_threads=cpu_threads, accel_threads=accel_threads, spin_us=spin_us,
                              progress=True)
    result = ex.execute(trace_path, system, options, run_opts, hardware=hardware, batch_size=batch_size,
                        prefill_chunk=prefill_chunk, seed=seed, overrides=overrides(kw, [system])[system],
                        profiling=profiling)
    if _emit(result, timeline, csv_path, as_json, f"dali exec {system} on {trace_path}"):
        return
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
@click.option("--dtype", type=REPLAY_DTYPE, default="bf16", show_default=True,
              help="Weight storage, as `dali exec run --dtype` (bfloat16, float16, float32 also accepted).")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane.")
@click.option("--accel-threads", type=int, help="Threads of the accelerator lane when it is the CPU device.")
@spin_option
@click.option("--expert-tokens", default="1,2,4,8,16,32,64,128,256", show_default=True, help="Token counts of the expert tables.")
@click.option("--dense-tokens", default="1,4,16,64", show_default=True, help="Token counts of the dense tables.")
@click.option("--context-lens", default="1,256,1024", show_default=True, help="Cached tokens per query of the dense tables.")
@click.option("--prefill-sequences", default="1,4", show_default=True,
              help="Sequences of the dense tables in prefill layout (both prefill options '': no prefill tables).")
@click.option("--prefill-tokens", default="1,64,256", show_default=True,
              help="New tokens per sequence of the dense tables in prefill layout.")
@click.option("--repeats", default=5, show_default=True, type=int, help="Timed runs per point (the median is kept).")
@click.option("--warmup", default=2, show_default=True, type=int, help="Untimed runs before each point.")
@click.option("--rounds", default=3, show_default=True, type=int,
              help="Rounds of the tables (every table in turn); each point keeps its median over the rounds.")
@click.option("--lane-rounds", default=5, show_default=True, type=click.IntRange(min=0),
              help="Rounds of the replays that measure how the two compute lanes slow each other side by side (the "
                   "cpu+gpu contention, docs/hardware.md); 0: the contention loops measure that pair too.")
@click.option("--systems", help="Comma-separated system presets whose decision time per layer visit is measured (a "
                                 "replay of each; default: every preset that can run). A profile serves only these.")
@click.option("--name", help="Profile name (default: measured-MODEL-DEVICE).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Profile JSON to write.")
def calibrate_cmd(model_shape, scale, device, dtype, cpu_threads, accel_threads, spin_us, expert_tokens,
                  dense_tokens, context_lens, prefill_sequences, prefill_tokens, repeats, warmup, rounds, lane_rounds,
                  systems, name, output) -> None:
    """Measure expert, transfer and dense times and write a measured hardware profile (docs/hardware.md)."""
    check_outputs({"profile": output}, [])
    _exec_module()
    from dali_exec.calibrate import CalibrationConfig, calibrate_to
    from dali_exec.calibrate.host import HostSettings
    from dali_exec.calibrate.lanes import LaneSettings
    from dali_sim.policies.systems import system_names

    names = None
    if systems is not None:
        names = tuple(s.strip() for s in systems.split(",") if s.strip())
        unknown = [s for s in names if s not in system_names()]
        if not names or unknown:
            raise click.BadParameter(f"unknown system {unknown[0]!r} (see `dali sim systems`)" if unknown
                                     else "give at least one system", param_hint="--systems")

    cfg = CalibrationConfig(model_shape, scale=scale, dtype=dtype, device=device, cpu_threads=cpu_threads,
                            accel_threads=accel_threads, spin_us=spin_us,
                            expert_tokens=_ints(expert_tokens, "--expert-tokens"),
                            dense_tokens=_ints(dense_tokens, "--dense-tokens"),
                            context_lens=_ints(context_lens, "--context-lens"),
                            prefill_sequences=_ints(prefill_sequences, "--prefill-sequences"),
                            prefill_queries=_ints(prefill_tokens, "--prefill-tokens"),
                            settings=_micro(repeats=repeats, warmup=warmup, table_rounds=rounds), name=name,
                            lanes=LaneSettings(rounds=lane_rounds) if lane_rounds else None,
                            host=HostSettings(systems=names))
    path = calibrate_to(output, cfg, command=command_line(), progress=True)
    from dali_sim.hardware.profile import load_profile

    shape = load_profile(path).model
    click.echo(f"wrote {path}, measured for {shape.model} at {shape.precision}. Simulate with it on a trace of that "
               f"shape: `dali trace synth --model {shape.model} --precision {shape.precision} -o t.parquet` then "
               f"`dali sim run --trace t.parquet --hardware {path} --system ...`; or replay with "
               f"`dali exec run --hardware {path} --scale {scale:g} --dtype {dtype}`")


@exec_group.command("validate")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Trace to replay (.parquet).")
@click.option("--systems", required=True, help="Comma-separated system presets (see `dali sim systems`); the first is the speedups' baseline.")
@click.option("--profile", type=click.Path(path_type=Path),
              help="Measured profile of this machine for the replay's shape, dtype and threads (default: calibrate first).")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Folder for the report, timelines, plot (and the calibrated profile).")
@replay_options
@click.option("--batch-size", default=1, show_default=True, type=int, help="Sequences per batch.")
@click.option("--prefill-chunk", default=0, show_default=True, type=int, help="Prompt positions per prefill step (0 = whole prompt).")
@click.option("--gpu-memory", type=GIB_TYPE,
              help="GPU memory budget of the full-size model in GiB [default: 24, the default profile's GPU].")
@policy_options
@profile_options
@click.option("--seed", default=0, show_default=True, type=SEED_TYPE,
              help="Seed of the policies and of the random weights.")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane (default as `dali exec run`).")
@click.option("--accel-threads", type=int, help="Threads of the accelerator lane when it is the CPU device.")
@spin_option
@click.option("--repeats", default=3, show_default=True, type=int, help="Calibration: timed runs per point.")
@click.option("--rounds", default=3, show_default=True, type=int,
              help="Calibration: rounds of the tables; each point keeps its median over the rounds.")
@click.option("--no-warmup", is_flag=True, help="No untimed warm-up replay before each system.")
@click.option("--replays", default=1, show_default=True, type=click.IntRange(min=1),
              help="Measured replays per system, round by round over the systems; each system is compared by their "
                   "medians (its total, and each step's time).")
@click.option("--time-budget", type=float, help="Seconds: start no further system once the budget would likely be exceeded.")
@click.option("--no-timelines", is_flag=True, help="Do not write the Perfetto timelines.")
@click.option("--no-plot", is_flag=True, help="Do not draw validation.png.")
@click.option("--max-total-error", default=0.15, show_default=True, type=click.FloatRange(min=0),
              help="Fail when a system's |total time error| exceeds this (relative).")
@click.option("--max-step-p90", type=click.FloatRange(min=0),
              help="Fail when a system's per-step |error| 90th percentile exceeds this (default: not checked).")
@click.option("--order-margin", default=0.10, show_default=True, type=click.FloatRange(min=0),
              help="Fail when two systems whose measured times differ by more than this are ordered the other way "
                   "round by the simulator.")
@click.option("--max-drift", default=0.10, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Warn when the machine's speed (a cold grouped expert call per lane, timed before and after), its "
                   "lanes' overlap (both lanes' calls at once) or a system's replays moved by more than this (relative).")
@click.option("--no-drift-probe", is_flag=True, help="Do not time the speed probe before and after.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object instead of the markdown table.")
def validate_cmd(trace_path, systems, profile, out_dir, model_shape, layers, scale, sequences, max_tokens, device,
                 dtype, precision, batch_size, prefill_chunk, seed, cpu_threads, accel_threads, spin_us, repeats,
                 rounds, no_warmup,
                 replays, time_budget, no_timelines, no_plot, max_total_error, max_step_p90, order_margin, max_drift,
                 no_drift_probe, as_json, **kw) -> None:
    """Run the executor and the simulator on identical inputs and compare them (docs/validation.md)."""
    profiling = profile_spec(kw)
    check_output(out_dir, [trace_path, profile, kw["profile_trace"]], "report folder", folder=True)
    ex = _exec_module()
    from dali_exec.validate import ValidationConfig, validate
    from dali_exec.validate.compare import Thresholds
    from dali_exec.validate.report import JSON, MARKDOWN

    names = tuple(s.strip() for s in systems.split(",") if s.strip())
    cfg = ValidationConfig(
        systems=names, profile=str(profile) if profile else None,
        replay=ex.ReplayOptions(model_shape=model_shape, layers=layers, scale=scale, sequences=sequences,
                                max_tokens=max_tokens, precision=precision, dtype=dtype),
        run=ex.ExecOptions(device=device, cpu_threads=cpu_threads, accel_threads=accel_threads, spin_us=spin_us),
        batch_size=batch_size, prefill_chunk=prefill_chunk, seed=seed, overrides=overrides(kw, names),
        warmup=not no_warmup, replays=replays, calibration=_micro(repeats=repeats, warmup=1, table_rounds=rounds),
        time_budget_s=time_budget,
        timelines=not no_timelines, plot=not no_plot,
        thresholds=Thresholds(total=max_total_error, step_p90=max_step_p90, order_margin=order_margin),
        profiling=profiling, drift_probe=not no_drift_probe, max_drift=max_drift)
    report = validate(trace_path, cfg, out_dir, command=command_line(), log=lambda m: click.echo(m, err=True),
                      progress=True)
    click.echo((out_dir / (JSON if as_json else MARKDOWN)).read_text())
    for w in report.warnings:
        click.echo(f"WARNING {w}", err=True)
    problems = [f"{f['system']} did not run ({f['error']})" for f in report.failed]
    problems += report.verdict.get("failures", [])
    if problems:
        for p in problems:
            click.echo(f"FAIL {p}", err=True)
        raise click.ClickException(f"validation failed: {len(problems)} problem(s); see {out_dir / MARKDOWN}")
    click.echo("OK: every system within the thresholds", err=True)


@exec_group.command("generate")
@click.option("--model", "model_path", required=True, metavar="PATH_OR_NAME",
              help="A local transformers MoE checkpoint folder (or a name in the local HF cache); nothing is downloaded.")
@click.option("--system", required=True, help="System preset (see `dali sim systems`); bounds and oracle heuristics "
                                               "(lower-bound, oracle-heuristic; the optimal, belady and oracle "
                                               "policies) cannot run online and are refused.")
@click.option("--prompts", "prompts_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Prompts: .txt (one per line), .jsonl or .json (as `dali trace record`).")
@click.option("--batch-size", default=1, show_default=True, type=int, help="Prompts generated side by side (left-padded).")
@click.option("--max-new-tokens", default=MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=0),
              help="Tokens generated per prompt (greedy; fewer at EOS).")
@click.option("--prefill-chunk", default=0, show_default=True, type=int,
              help="Prompt columns per prefill forward pass (0 = the whole prompt at once).")
@click.option("--residual", "residual_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Residual vectors (`dali trace calibrate-residual`): needed by systems that prefetch with the "
                   "`residual` lookahead (dali, dali-plus).")
@click.option("--profile-trace", "--frequencies-from", "frequencies_from",
              type=click.Path(dir_okay=False, path_type=Path),
              help="A trace of this model (`dali trace record`) as the profiling input: per-expert frequencies for "
                   "cache_init=frequency (default: uniform). The prompts generated are never seen in advance, so "
                   "there is no split and no frequency-hindsight.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), help="Accelerator (default: cuda if present, else the CPU device).")
@click.option("--dtype", type=MODEL_DTYPE, default="fp32", show_default=True,
              help="Weights dtype of the model, as `dali trace record --dtype` (auto = the checkpoint's; bfloat16, "
                   "float16, float32 also accepted); experts are stored and copied in it.")
@click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True,
              help="Hardware profile whose costs the policies use and whose GPU memory is the default budget.")
@click.option("--gpu-memory", type=GIB_TYPE, help="GPU memory budget in GiB (default: the profile's).")
@policy_options
@click.option("--seed", default=0, show_default=True, type=SEED_TYPE, help="Seed of the policies.")
@click.option("--cpu-threads", type=int, help="Threads of the CPU lane (default: all cores but two with CUDA; "
                                              "the process's thread count on the CPU device).")
@click.option("--accel-threads", type=int, help="Threads of the main thread on the CPU device (default: unchanged).")
@spin_option
@click.option("--timeline", type=click.Path(path_type=Path), help="Write a Chrome/Perfetto trace JSON here.")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Write the per-layer table as CSV here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (result and generated tokens) instead of text.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def generate_cmd(model_path, system, prompts_file, batch_size, max_new_tokens, prefill_chunk, residual_file,
                 frequencies_from, device, dtype, hardware, seed, cpu_threads, accel_threads, spin_us, timeline,
                 csv_path, as_json, quiet, **kw) -> None:
    """Generate with a real transformers MoE model whose routed experts are offloaded by a system.

    The MoE blocks' experts are replaced by the offloading runtime; routing and the lookahead predictions
    (next-gate, residual, gate2/gate3) are computed as the model runs, and the same policies as `dali sim`
    decide placement, prefetching and caching. The generated tokens are the model's own greedy tokens
    (docs/executor.md, "Real models").

    \b
    dali exec generate --model models/dali-tiny-moe --prompts prompts/multidomain.txt --system gpu-lru --cache-experts 8
    dali exec generate --model M --prompts P --system dali --residual res.safetensors --batch-size 4
    """
    check_outputs({"timeline": timeline, "CSV table": csv_path},
                  [*checkpoint_files(model_path), prompts_file, residual_file,
                   frequencies_from, *_profile_file(hardware)])
    require_exec("dali_exec.generate")
    from dali_exec.generate import GenerateOptions, generate_from_path
    opts = GenerateOptions(batch_size=batch_size, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                           residual=residual_file, frequencies_from=frequencies_from, device=device,
                           cpu_threads=cpu_threads, accel_threads=accel_threads, spin_us=spin_us,
                           progress=not quiet and not as_json)
    result = generate_from_path(model_path, prompts_file, system, opts, dtype=dtype, hardware=hardware, seed=seed,
                                overrides=overrides(kw, [system])[system])
    if _emit(result, timeline, csv_path, as_json, f"dali exec generate {system} on {model_path}"):
        return
    s, e = result.summary, result.manifest["executor"]
    g, ov = s["generation"], s["overhead"]
    click.echo(f"executed on {e['devices']['accelerator_name']} ({e['devices']['dtype']}), dense part on "
               f"{e['dense_device']}, CPU lane {e['cpu_threads']} threads, {e['slot_bytes'] / 2**20:,.2f} MiB of "
               f"expert slots; frequencies: {result.config['online']['frequencies']}")
    click.echo(f"generated {g['new_tokens']:,} tokens for {g['prompts']} prompts in {g['wall_s']:.2f} s "
               f"({g['new_tokens_per_s']:,.1f} tok/s; setup {g['setup_s']:.2f} s); overhead per layer: decisions "
               f"{ov['decision_us_per_layer']:,.1f} us + bookkeeping {ov['bookkeeping_us_per_layer']:,.1f} us")
    for seq in result.generated:
        shown = seq.text if seq.text is not None else " ".join(map(str, seq.token_ids))
        click.echo(f"[{seq.seq_id}] {seq.name} ({seq.prompt_tokens} prompt tokens, {len(seq.token_ids)} new, "
                   f"{seq.stop}): {shown!r}")
    if timeline:
        click.echo(f"timeline: {timeline} (open in ui.perfetto.dev)")
