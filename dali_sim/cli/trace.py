"""``dali trace``: import, generate, validate and describe routing traces."""

from __future__ import annotations

from pathlib import Path

import click

from dali_sim.cli.common import UserErrorGroup, check_outputs, command_line, echo_json, printable
from dali_sim.cli.trace_stats import stats
from dali_sim.cli.trace_synth import synth
from dali_sim.trace.importers import IMPORTERS

# heavy modules (pyarrow, pandas) are imported inside the commands: `dali --help` stays fast


@click.group(cls=UserErrorGroup)
def trace() -> None:
    """Routing traces: one Parquet row per (sequence, token, MoE layer). See docs/trace-format.md."""


@trace.command("import")
@click.option("--format", "fmt", required=True, type=click.Choice(IMPORTERS.names()),
              help="Input format (see `dali trace formats`).")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Trace to write (.parquet).")
def import_cmd(fmt: str, files: tuple[Path, ...], output: Path) -> None:
    """Convert public routing traces (FILES or folders of them) into a dali trace."""
    from dali_sim.trace import read_trace
    from dali_sim.trace.importers import import_trace

    path = import_trace(fmt, files, output, command_line())
    t = read_trace(path)
    click.echo(f"wrote {path}: {len(t)} rows, {t.num_sequences} sequences, model {t.model.name}")


@trace.command("formats")
def formats() -> None:
    """List the import formats."""
    for name in IMPORTERS.names():
        click.echo(f"{name}: {IMPORTERS.get(name).description}")


@trace.command("validate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--allow-partial", is_flag=True, help="Accept a partial trace left by an interrupted writer.")
def validate(path: Path, allow_partial: bool) -> None:
    """Check a trace fully (checksums included); print the first offending row if it is bad (exit code 1)."""
    from dali_sim.trace import read_trace

    t = read_trace(path, allow_partial=allow_partial)
    checked = ("checksums verified" if t.checksum is not None else
               "no checksum: written by an older dali, so changed bytes cannot be detected; rewrite it to add one")
    click.echo(f"{path}: ok ({len(t)} rows, {t.num_sequences} sequences, status {t.meta.status}; {checked})")


@trace.command("info")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the whole metadata as JSON.")
def info(path: Path, as_json: bool) -> None:
    """Show a trace's metadata (model, provenance, columns) without reading its rows."""
    from dali_sim.trace.reader import read_meta_and_checksum

    meta, record = read_meta_and_checksum(path)
    if as_json:
        import json

        echo_json(json.loads(meta.to_json()))
        return
    m = meta.model
    lines = [
        f"{path}: schema v{meta.schema_version}, {meta.status}, {meta.num_rows} rows",
        f"  model: {m.name} ({m.precision_label}, {m.num_moe_layers} MoE layers {list(m.moe_layers)[:4]}..., "
        f"{m.num_experts} experts, top-{m.top_k})",
        f"  weights: {meta.weights_note if meta.has_weights else 'none'}",
        f"  router logits: {'yes' if meta.has_router_logits else 'no'}",
        "  lookahead predictors: "
        + (", ".join(f"{p.name} (layer+{p.target_offset})" for p in meta.predictors.values()) or "none"),
        f"  hidden states: {meta.hidden_states.file if meta.hidden_states else 'none'}",
        f"  sequences: {len(meta.sequences)} described",
        f"  source: {meta.provenance.get('source')}  command: {meta.provenance.get('command')}",
        "  checksum: " + ("SHA-256 of the metadata and of every column, and Parquet page checksums"
                          if record is not None else "none (written by an older dali)"),
    ]
    for line in lines:  # metadata is text from a file: escape codes are shown, not obeyed
        click.echo(printable(line))


@trace.command("enrich")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--batch-size", default=1, show_default=True, type=int, help="Sequences per batch, as in `dali sim`.")
@click.option("--prefill-chunk", default=0, show_default=True, type=int,
              help="Prompt positions per prefill step, as in `dali sim` (0 = whole prompt).")
@click.option("--profile-share", default=0.25, show_default=True, type=float,
              help="As in `dali sim`: the first share of the sequences profile and are not evaluated, so they get no "
                   "next-use times (0 = every sequence; use 0 when `dali sim` gets --profile-trace).")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Where to write (default: beside the trace, X.future-b<B>[-c<C>][-p<SHARE>].parquet).")
def enrich(path: Path, batch_size: int, prefill_chunk: int, profile_share: float, output: Path | None) -> None:
    """Compute next-use times for policies that read the future (the `optimal` and `belady` caches).

    Next uses depend on the batching (a batch-mate's later use counts) and on the evaluated sequences (the
    profile split), so they are computed for one batch size, prefill chunk and profile share; `dali sim`
    finds the file beside the trace and refuses a stale one.
    """
    from dali_sim.runtime.future import future_path, write_future
    from dali_sim.trace import read_trace
    from dali_sim.workload.builder import WorkloadConfig
    from dali_sim.workload.profiling import ProfileSpec

    ProfileSpec(share=profile_share)  # a bad share fails before anything is read
    config = WorkloadConfig(batch_size, prefill_chunk)
    out = output or future_path(path, config, profile_share)
    check_outputs({"next-use file": out}, [path])
    out = write_future(read_trace(path), config, out, command_line(), share=profile_share)
    click.echo(f"wrote {out}")


trace.add_command(stats)
trace.add_command(synth)
from dali_sim.cli.trace_record import calibrate_residual, record  # noqa: E402  (torch-free until invoked)
trace.add_command(record); trace.add_command(calibrate_residual)  # noqa: E702
