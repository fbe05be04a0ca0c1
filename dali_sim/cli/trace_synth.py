"""``dali trace synth``: write a synthetic routing trace (see docs/synthetic-traces.md)."""

from __future__ import annotations

import time

import click

from dali_sim.cli.common import SEED_TYPE, command_line
from dali_sim.trace import synth as S


def _probabilities(text: str | None, name: str):
    """``0.3`` or ``0.1,0.2,...`` (one per MoE layer / layer pair) -> float or tuple; None stays None."""
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected a number or comma-separated numbers", param_hint=name) from None
    return values[0] if len(values) == 1 else values


@click.command("synth")
@click.option("--model", "model", required=True, help="Model preset (dali model list), e.g. gpt-oss-20b.")
@click.option("--precision", default=None, help="Store the model spec at this precision (routing is unaffected).")
@click.option("--sequences", "-n", type=int, default=1, show_default=True, help="Number of sequences.")
@click.option("--prompt-len", type=int, default=128, show_default=True, help="Prefill tokens per sequence.")
@click.option("--gen-len", type=int, default=128, show_default=True, help="Decode tokens per sequence.")
@click.option("--prompt-len-jitter", type=float, default=0.0, show_default=True,
              help="Each sequence's prompt length uniform in P(1 -/+ jitter), at least 1.")
@click.option("--gen-len-jitter", type=float, default=0.0, show_default=True,
              help="Each sequence's generated length uniform in G(1 -/+ jitter), at least 1.")
@click.option("--seed", type=SEED_TYPE, default=0, show_default=True, help="Seed; same arguments + seed = same file.")
@click.option("--skew", type=float, default=S.DEFAULT_SKEW, show_default=True,
              help="How unequal expert popularity is per layer (0 = uniform); see --popularity-shape.")
@click.option("--popularity-shape", type=click.Choice(list(S.POPULARITY_SHAPES)), default=S.DEFAULT_SHAPE,
              show_default=True, help="lognormal: p = exp(-skew * normal quantile of the rank); zipf: rank^-skew.")
@click.option("--topic-spread", type=float, default=S.DEFAULT_TOPIC_SPREAD, show_default=True,
              help="Sigma of a per-sequence log-normal factor on each expert's popularity (0 = off).")
@click.option("--drift-spread", type=float, default=S.DEFAULT_DRIFT_SPREAD, show_default=True,
              help="Sigma of a log-normal factor that drifts along the sequence (0 = off).")
@click.option("--drift-halflife", type=float, default=S.DEFAULT_DRIFT_HALFLIFE, show_default=True,
              help="Positions after which the drifting factor is half forgotten.")
@click.option("--reuse", default=str(S.DEFAULT_REUSE), show_default=True,
              help="Probability that each expert of the previous token (same layer) is kept; one value or one "
                   "per MoE layer, comma-separated.")
@click.option("--prefill-reuse", default=None, help="Same as --reuse for prompt tokens (default: --reuse).")
@click.option("--crosslayer", default=str(S.DEFAULT_CROSSLAYER), show_default=True,
              help="Probability that the successor of each expert of the previous MoE layer is chosen; one value "
                   "or one per adjacent layer pair.")
@click.option("--weight-alpha", type=float, default=S.DEFAULT_WEIGHT_ALPHA, show_default=True,
              help="Dirichlet concentration of the top-k gate weights (larger = more even).")
@click.option("--weight-total", type=float, default=S.DEFAULT_WEIGHT_TOTAL, show_default=True,
              help="Mean top-k weight mass for models that do not renormalise the top-k (norm_topk_prob false).")
@click.option("--popularity-from", type=click.Path(exists=True), default=None,
              help="Calibrate popularity from a dali trace (.parquet), an OLMoE-style counts JSON or a folder of "
                   "them (replaces --skew).")
@click.option("--lookahead", "lookahead", multiple=True, metavar="NAME=ACC[@OFFSET]",
              help="Add a lookahead column whose top-k holds each true expert of the layer OFFSET (default 1) "
                   "MoE layers later with probability ACC. Repeatable.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="Output trace (.parquet).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")
def synth(model, precision, sequences, prompt_len, gen_len, prompt_len_jitter, gen_len_jitter, seed, skew,
          popularity_shape, topic_spread, drift_spread, drift_halflife, reuse, prefill_reuse, crosslayer, weight_alpha,
          weight_total, popularity_from, lookahead, output, quiet) -> None:
    """Write a synthetic routing trace with tunable popularity skew, temporal reuse, cross-layer
    correlation and lookahead predictions of chosen accuracy.

    \b
    dali trace synth --model gpt-oss-20b --sequences 8 --prompt-len 256 --gen-len 256 -o synth.parquet
    dali trace synth --model olmoe-1b-7b --popularity-from routing_counts/olmoe/expert_counts -o o.parquet
    dali trace synth --model mixtral-8x7b --lookahead next=0.8 --lookahead far=0.6@2 -o m.parquet
    """
    config = S.SynthConfig(
        model=model, precision=precision, sequences=sequences, prompt_len=prompt_len, gen_len=gen_len,
        seed=seed, prompt_len_jitter=prompt_len_jitter, gen_len_jitter=gen_len_jitter, skew=skew,
        popularity_shape=popularity_shape,
        topic_spread=topic_spread, drift_spread=drift_spread, drift_halflife=drift_halflife,
        reuse=_probabilities(reuse, "--reuse"), prefill_reuse=_probabilities(prefill_reuse, "--prefill-reuse"),
        crosslayer=_probabilities(crosslayer, "--crosslayer"), weight_alpha=weight_alpha,
        weight_total=weight_total, popularity_from=popularity_from,
        lookahead=tuple(S.LookaheadSpec.parse(x) for x in lookahead),
    )
    start = time.perf_counter()
    path = S.synthesize(config, output, command=command_line(), progress=False if quiet else None)
    if not quiet:
        seconds = time.perf_counter() - start
        rows = S.total_rows(config)
        click.echo(f"wrote {path}: {rows} rows, {config.sequences} sequences, model {config.model} "
                   f"({seconds:.1f} s, {rows / max(seconds, 1e-9):,.0f} rows/s)")
