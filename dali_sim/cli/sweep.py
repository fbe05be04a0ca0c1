"""``dali sweep``: run a sweep spec into a resumable result store, and report on it (docs/sweeps.md)."""

from __future__ import annotations

from pathlib import Path

import click

from dali_sim.cli.common import Terminated, UserErrorGroup


class DefaultRunGroup(UserErrorGroup):
    """``dali sweep SPEC ...`` is ``dali sweep run SPEC ...``; ``dali sweep report OUT`` reports."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().resolve_command(ctx, args)


@click.group(cls=DefaultRunGroup)
def sweep() -> None:
    """Ablations at scale: traces x hardware x grid x systems from a TOML spec, run in parallel (local
    processes or Ray) into a resumable Parquet result store.

    \b
    dali sweep SPEC.toml -o OUT/            # the same as `dali sweep run SPEC.toml -o OUT/`
    dali sweep SPEC.toml -o OUT/ --ray auto # on Ray (a cluster: ray start --head, then --ray HOST:6379)
    dali sweep report OUT/ --baseline llamacpp
    """


@sweep.command("run")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Result folder: results.parquet, manifests/, traces/ (reused: stored configurations are skipped).")
@click.option("--workers", type=click.IntRange(min=1),
              help="Local worker processes (default: every core; 1 = in this process). With --ray: the most "
                   "tasks in flight (default: the cluster's CPUs).")
@click.option("--ray", "ray_address", metavar="auto|ADDRESS",
              help="Run on Ray: auto (this machine's cluster, else a new local Ray) or a cluster address "
                   "(HOST:6379, ray://HOST:10001). Needs the ray extra.")
@click.option("--retry-failed", is_flag=True, help="Also rerun configurations stored with an error.")
@click.option("--save-every", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Seconds between writes of results.parquet (it is also written at the end and on Ctrl-C).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def run_cmd(spec: Path, out: Path, workers: int | None, ray_address: str | None, retry_failed: bool,
            save_every: float, quiet: bool) -> None:
    """Run every configuration of SPEC not yet stored in OUT (by configuration hash)."""
    from dali_sim.sweep.engines import import_ray, make_engine
    from dali_sim.sweep.run import run_sweep

    if ray_address is not None:
        import_ray()  # before any work: without Ray, one line that says how to get it

    def log(message: str) -> None:
        click.echo(message, err=True)

    try:
        summary = run_sweep(spec, out, lambda: make_engine(workers, ray_address), retry_failed=retry_failed,
                            save_every=save_every, progress=not quiet, log=log)
    except Terminated:
        raise
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    if summary.failed:
        log(f"{summary.failed} configurations failed: see the status and error columns, and "
            f"{out / 'manifests'}/<config_hash>.json for tracebacks")


@sweep.command("report")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--index", "index_key", help="Grid key of the table rows (default: the first key that varies).")
@click.option("--columns", "columns_key", default="system", show_default=True, help="Grid key of the table columns.")
@click.option("--baseline", help="System the speedups are over (default: the spec's baseline, else the first).")
@click.option("--metric", "metrics", multiple=True,
              help="Metric to tabulate and plot (repeatable; default: tokens/s, hit rate, GPU share, copies, time).")
@click.option("--report-dir", "-o", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the report (default: OUT/report).")
def report_cmd(out: Path, index_key: str | None, columns_key: str, baseline: str | None, metrics: tuple[str, ...],
               report_dir: Path | None) -> None:
    """Tables (pivots by two grid keys, speedups over a baseline), one plot per metric and a self-contained
    HTML page from a sweep's results."""
    from dali_sim.sweep.report import write_report

    written = write_report(out, report_dir or out / "report", index=index_key, columns=columns_key,
                           baseline=baseline, metrics=list(metrics) or None)
    click.echo(f"report: {written['html']} ({len(written['figures'])} figures, {len(written['tables'])} tables)")
