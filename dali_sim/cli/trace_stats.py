"""``dali trace stats``: statistics of a routing trace (definitions in docs/statistics.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("stats")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print every statistic as one JSON object.")
@click.option("--allow-partial", is_flag=True, help="Also read a partial trace (OUT.parquet.partial).")
def stats(trace_path: Path, as_json: bool, allow_partial: bool) -> None:
    """Expert popularity, temporal reuse, cross-layer predictability and lookahead accuracy of TRACE.

    \b
    Per MoE layer (by block index): expert counts, entropy / Gini of the counts, reuse of the previous
    token's top-k (overall, prefill, decode); per consecutive layer pair: in-sample co-occurrence
    recall and top-1 mutual information; per lookahead predictor: top-k recall. Definitions:
    docs/statistics.md.
    """
    from dali_sim.trace.reader import read_trace
    from dali_sim.trace.stats import format_text, summary

    result = summary(read_trace(trace_path, allow_partial=allow_partial))
    if as_json:
        click.echo(json.dumps(result, indent=2, allow_nan=False))
    else:
        click.echo(format_text(result))
