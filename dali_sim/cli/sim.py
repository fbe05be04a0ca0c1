"""``dali sim``: replay traces against offloading systems on a hardware profile."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import click

from dali_sim.cli.common import GIB_TYPE, SEED_TYPE, UserErrorGroup, check_outputs, echo_json
from dali_sim.cli.sim_compare import label_lines
from dali_sim.hardware.profile import DEFAULT_HARDWARE

if TYPE_CHECKING:
    from dali_sim.sim.simulate import SimResult

# heavy modules (pandas, pyarrow, the policies) are imported inside the commands: `dali --help` stays fast


@click.group(cls=UserErrorGroup)
def sim() -> None:
    """Simulate offloading systems on a trace: SimPy model of GPU, CPU and PCIe (docs/simulator.md)."""


def option_group(*options):
    """One decorator applying several click options, in the order given."""
    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


#: the system's memory and policy knobs, shared by `dali sim` and `dali exec` (read with :func:`overrides`)
policy_options = option_group(
    click.option("--cache-ratio", type=float, help="Cache slots per layer as a fraction of its experts."),
    click.option("--cache-experts", type=int, help="Cache slots per layer."),
    click.option("--cache-init", type=click.Choice(["empty", "random", "frequency", "frequency-hindsight",
                                                    "lowest-ids", "highest-ids"]),
                 help="Initial cache contents (default: the system's); frequency reads the profiling input, "
                      "frequency-hindsight the evaluated data itself."),
    click.option("--set", "sets", multiple=True, metavar="[SYSTEM:]SECTION.KEY=VALUE",
                 help="Override a system parameter, e.g. --set cache.policy=lfu (every system) or "
                      "--set dali:prefetch.k=2 (that system only); repeatable."),
)


#: the profiling input of frequency choices, shared by `dali sim` and `dali exec` (read with :func:`profile_spec`)
profile_options = option_group(
    click.option("--profile-trace", type=click.Path(path_type=Path),
                 help="A trace of the same model whose frequencies frequency-based choices use (cache_init=frequency); "
                      "the whole --trace is then evaluated."),
    click.option("--profile-share", type=click.FloatRange(0, 1, max_open=True),
                 help="Without --profile-trace: the first share of the trace's sequences profile, the rest are "
                      "evaluated by every system [default: 0.25; 0 = no split, frequency choices see the evaluated "
                      "data (hindsight)]."),
)


def profile_spec(kw):
    """The :class:`~dali_sim.workload.profiling.ProfileSpec` of the --profile-* options."""
    from dali_sim.workload.profiling import ProfileSpec

    try:
        return ProfileSpec(share=kw.get("profile_share"), trace=kw.get("profile_trace"))
    except ValueError as exc:
        raise click.UsageError(f"--profile-trace / --profile-share: {exc}") from None


def common_options(f):
    """Options shared by `run` and `compare`."""
    options = [
        click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path),
                     help="Trace to replay (.parquet)."),
        click.option("--hardware", default=DEFAULT_HARDWARE, show_default=True,
                     help="Hardware profile: a name from `dali sim profiles` or a profile file."),
        click.option("--batch-size", default=1, show_default=True, type=int, help="Sequences per batch."),
        click.option("--prefill-chunk", default=0, show_default=True, type=int,
                     help="Prompt positions per prefill step (0 = whole prompt in one step)."),
        policy_options,
        click.option("--gpu-memory", type=GIB_TYPE, help="GPU memory budget in GiB (default: the profile's GPU)."),
        click.option("--precision", help="Weight format of the experts, e.g. bf16, q8_0, q4_0, mxfp4."),
        click.option("--seed", default=0, show_default=True, type=SEED_TYPE, help="Seed for random choices."),
        click.option("--no-timing", is_flag=True,
                     help="Fast replay: cache hits and transfer counts only, no SimPy, no times."),
        profile_options,
        click.option("--future", type=click.Path(path_type=Path),
                     help="Next-use file for policies that read it (belady, optimal); default: the one `dali trace "
                          "enrich` wrote beside the trace."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text."),
    ]
    return option_group(*options)(f)


def overrides(kw, systems: Sequence[str]) -> dict[str, dict[str, dict[str, str]]]:
    """Per system of ``systems``: its ``--set`` items (plain ones and its ``SYSTEM:`` ones) plus the memory
    flags (:data:`policy_options`, ``--gpu-memory``), as system overrides."""
    from dali_sim.policies.systems import merge_overrides, system_overrides

    if kw["cache_ratio"] is not None and kw["cache_experts"] is not None:
        raise click.UsageError("give --cache-ratio or --cache-experts, not both")
    memory = {key: str(kw[flag]) for flag, key in (("cache_ratio", "cache_ratio"), ("cache_experts", "cache_experts"),
                                                    ("cache_init", "cache_init"), ("gpu_memory", "gpu_memory_gib"))
              if kw.get(flag) is not None}
    return {name: merge_overrides(over, {"memory": memory})
            for name, over in system_overrides(kw["sets"], list(systems)).items()}


def run_inputs(kw) -> list[Path]:
    """The files a `dali sim` run reads (an output must be none of them)."""
    hardware = Path(kw["hardware"])
    return [kw["trace_path"], kw["future"], kw.get("profile_trace"), hardware if hardware.is_file() else None]


def _run(profiled, system: str, kw, over, timeline: bool = False, workload=None) -> SimResult:
    """One system on the evaluated trace of ``profiled`` (a ``ProfiledTrace``: every system of a command
    shares it, so all are evaluated on identical sequences); ``workload``: one built from it to share."""
    from dali_sim.sim.simulate import simulate

    return simulate(profiled.evaluated, system, hardware=kw["hardware"], batch_size=kw["batch_size"],
                    prefill_chunk=kw["prefill_chunk"], seed=kw["seed"], overrides=over,
                    precision=kw["precision"], timing=not kw["no_timing"], timeline=timeline, progress=True,
                    future=kw["future"], profiling=profiled, workload=workload)


def _profiled(kw, systems: Sequence[str], over):
    """The command's trace, read with only the columns some of ``systems`` reads, with its profiling input
    applied (once for all of them)."""
    from dali_sim.policies.systems import resolve_system
    from dali_sim.sim.simulate import trace_needs
    from dali_sim.trace.reader import read_meta, read_trace
    from dali_sim.workload.profiling import apply_profile

    model = read_meta(kw["trace_path"]).model
    needs = trace_needs([resolve_system(name, over[name], model) for name in systems])
    return apply_profile(read_trace(kw["trace_path"], needs=needs), profile_spec(kw)), needs


def _fmt(v, unit: str = "", digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}{unit}" if isinstance(v, float) else f"{v:,}{unit}"


def format_time_bound(r: SimResult) -> str:
    s, mem, lb = r.summary, r.manifest["memory"], r.summary["lower_bound"]
    return "\n".join([
        f"system {s['system']} on {s['hardware']}: {s['model']} ({r.config['precision']}), batch {s['batch_size']}, "
        f"{s['steps']} steps ({s['prefill_steps']} prefill, {s['decode_steps']} decode), {s['tokens']:,} tokens",
        "GPU memory: " + ", ".join(f"{k} {v:.2f}" for k, v in mem["breakdown_gib"].items())
        + f" of {mem['budget_gib']:.2f} GiB ({lb['expert_slots']} expert buffers, any layout)",
        *profiling_lines(r),
        *label_lines(s),
        f"time: prefill {_fmt(s['prefill_s'], ' s')}, decode {_fmt(s['decode_s'], ' s')} (makespan "
        f"{_fmt(s['makespan_s'], ' s')}; with every transfer free: {_fmt(lb['compute_s'], ' s')})",
        f"per sequence: prefill {_fmt(s['prefill_tokens_per_s'], ' tok/s', 2)}, decode "
        f"{_fmt(s['decode_tokens_per_s'], ' tok/s', 2)}, TTFT {_fmt(s['ttft_s'], ' s')}, "
        f"TPOT {_fmt(s['tpot_s'] * 1e3 if s['tpot_s'] == s['tpot_s'] else float('nan'), ' ms', 1)} (bounds)",
    ] + [f"note: {n}" for n in mem["notes"]])


def profiling_lines(r: SimResult) -> list[str]:
    """Where the run's frequency choices looked (docs/simulator.md, "Profiling input")."""
    from dali_sim.workload.profiling import describe_profiling

    record = r.manifest.get("profiling")
    return [describe_profiling(record)] if record else []


#: what the lanes are called when the accelerator is the CPU device (`dali exec --device cpu`)
CPU_DEVICE_LANES = {"gpu": "ACCEL (CPU device)", "cpu": "CPU lane", "pcie": "COPIES"}


def format_run(r: SimResult, executed_on: str | None = None, lanes: dict[str, str] | None = None) -> str:
    """The text summary of a run. ``executed_on``: the device an executor ran on (the profile then only
    gives the policies' costs); ``lanes``: names of the busy lanes (default GPU, CPU, PCIE)."""
    if "time" in r.summary["bounds"]:
        return format_time_bound(r)
    s, mem = r.summary, r.manifest["memory"]
    caps = mem["cache_slots_per_layer"]
    caps_txt = f"{caps[0]} slots/layer" if len(set(caps)) == 1 else f"slots per layer {caps}"
    where = f"on {s['hardware']}" if executed_on is None else \
        f"executed on {executed_on} (policies' costs from {s['hardware']})"
    accel = "GPU" if lanes is None else lanes["gpu"]
    lines = [
        f"system {s['system']} {where}: {s['model']} ({r.config['precision']}), batch {s['batch_size']}, "
        f"{s['steps']} steps ({s['prefill_steps']} prefill, {s['decode_steps']} decode), {s['tokens']:,} tokens",
        f"{accel} memory: " + ", ".join(f"{k} {v:.2f}" for k, v in mem["breakdown_gib"].items())
        + f" of {mem['budget_gib']:.2f} GiB ({caps_txt})",
        f"cache: hit rate {_fmt(100 * s['hit_rate'], '%', 1)}, on {accel} {_fmt(100 * s['gpu_fraction'], '%', 1)} of "
        f"{s['activated']:,} activated experts; {s['on_demand']:,} on-demand copies, {s['prefetch_issued']:,} "
        f"prefetches ({_fmt(s['prefetch_precision'])} precision), {s['bytes_h2d'] / 2**30:,.2f} GiB host-to-{accel}",
    ]
    lines += profiling_lines(r)
    lines += [f"note: {n}" for n in mem["notes"]]
    lines += label_lines(s)
    if "makespan_s" in s:
        lines += [
            f"time: prefill {_fmt(s['prefill_s'], ' s')}, decode {_fmt(s['decode_s'], ' s')} "
            f"(makespan {_fmt(s['makespan_s'], ' s')}, {s['events']:,} events)",
            f"per sequence: prefill {_fmt(s['prefill_tokens_per_s'], ' tok/s', 2)}, decode "
            f"{_fmt(s['decode_tokens_per_s'], ' tok/s', 2)}, TTFT {_fmt(s['ttft_s'], ' s')}, "
            f"TPOT {_fmt(s['tpot_s'] * 1e3 if s['tpot_s'] == s['tpot_s'] else float('nan'), ' ms', 1)}",
            "busy: " + ", ".join(f"{(lanes or {}).get(k, k.upper())} {_fmt(100 * v, '%', 1)}"
                                 for k, v in s["busy"].items()),
        ]
    else:
        lines.append("time: not simulated (--no-timing)")
    return "\n".join(lines)


@sim.command("run")
@common_options
@click.option("--system", required=True, help="System preset (see `dali sim systems`).")
@click.option("--timeline", type=click.Path(path_type=Path), help="Write a Chrome/Perfetto trace JSON here.")
def run_cmd(system: str, timeline: Path | None, **kw) -> None:
    """Simulate one system on a trace and print its metrics (docs/metrics.md)."""
    if timeline and kw["no_timing"]:
        raise click.UsageError("--timeline needs timing; drop --no-timing")
    check_outputs({"timeline": timeline}, run_inputs(kw))
    over = overrides(kw, [system])[system]
    profile_spec(kw)  # a bad combination fails before the trace is read
    from dali_sim.sim.timeline import write_timeline

    profiled, _ = _profiled(kw, [system], {system: over})
    result = _run(profiled, system, kw, over, timeline=timeline is not None)
    if timeline:
        write_timeline(timeline, result.intervals, f"{system} on {kw['trace_path']}")
    if kw["as_json"]:
        click.echo(result.to_json())
    else:
        click.echo(format_run(result))
        if timeline:
            click.echo(f"timeline: {timeline} (open in ui.perfetto.dev)")


@sim.command("compare")
@common_options
@click.option("--systems", required=True, help="Comma-separated system presets.")
@click.option("--baseline", help="System the speedups are relative to (default: the first).")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Also write the table as CSV.")
def compare_cmd(systems: str, baseline: str | None, csv_path: Path | None, **kw) -> None:
    """Run several systems on identical inputs: a header with the setting, one row per system with speedups
    over a baseline, a legend, and the winner (the most tokens per second per sequence; bounds excluded)."""
    names = [s.strip() for s in systems.split(",") if s.strip()]
    if not names:
        raise click.UsageError("--systems is empty")
    baseline = baseline or names[0]
    if baseline not in names:
        names.append(baseline)
    from dali_sim.cli.sim_compare import compare_table, format_compare, winner
    from dali_sim.files import write_text_atomic
    from dali_sim.policies.systems import resolve_system
    from dali_sim.workload.builder import Workload, WorkloadConfig

    over = overrides(kw, names)
    for name in names:
        resolve_system(name, over[name])  # fail fast on a bad name or parameter
    profile_spec(kw)
    check_outputs({"CSV table": csv_path}, run_inputs(kw))
    profiled, needs = _profiled(kw, names, over)
    workload = Workload(profiled.evaluated, WorkloadConfig(kw["batch_size"], kw["prefill_chunk"]),
                        predictors=needs.predictors)
    results = {name: _run(profiled, name, kw, over[name], workload=workload) for name in names}
    table = compare_table(results, baseline)
    if csv_path:
        write_text_atomic(csv_path, table.to_csv())
    if kw["as_json"]:
        echo_json({"baseline": baseline, "winner": winner(results, baseline),
                   "systems": {n: r.to_dict() for n, r in results.items()},
                   "table": table.reset_index().to_dict(orient="records")})
        return
    click.echo(format_compare(results, baseline, table))


@sim.command("systems")
@click.option("--verbose", "-v", is_flag=True, help="Also show each system's source and resolved parameters.")
def systems_cmd(verbose: bool) -> None:
    """List the system presets: name, reading (paper, best, ours, baseline, bound, reference) and a line of
    description each (docs/policies.md, "Readings")."""
    from dali_sim.policies.base import CACHES, PLACEMENTS, PREFETCHERS
    from dali_sim.policies.systems import resolve_system, system_description, system_names, system_reading

    names = system_names()
    width = max(map(len, names))
    tag = max(len(system_reading(n)) for n in names)
    click.echo(f"{'system':<{width}} {'reading':<{tag}} description")
    for name in names:
        click.echo(f"{name:<{width}} {system_reading(name):<{tag}} {system_description(name)}")
        if verbose:
            conf = resolve_system(name)
            if conf.source:
                click.echo(f"{'':<{width + 2}}source: {conf.source}")
            for section, values in conf.to_dict().items():
                if isinstance(values, dict):
                    click.echo(f"{'':<{width + 2}}{section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    click.echo("\nreadings: paper = as the DALI paper ran the competitor (or as its released code runs, where the "
               "paper did not run it); best = its most favourable reasonable reading (NAME-best); ours = beyond DALI; "
               "baseline = textbook policies; bound; reference = an oracle heuristic, not a bound")
    click.echo("policies: placement " + ", ".join(PLACEMENTS.names()) + "; cache " + ", ".join(CACHES.names())
               + "; prefetch " + ", ".join(PREFETCHERS.names()))


@sim.command("profiles")
def profiles_cmd() -> None:
    """List the shipped hardware profiles with a line of description each."""
    from dali_sim.hardware.profile import load_profile, profile_names

    for name in profile_names():
        mark = " (default)" if name == DEFAULT_HARDWARE else ""
        click.echo(f"{name:<24} {load_profile(name).description}{mark}")
