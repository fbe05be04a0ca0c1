"""``dali model``: model shape presets."""

from __future__ import annotations

import click

from dali_sim.cli.common import UserErrorGroup, echo_json
from dali_sim.models import get_model, model_names, precision_names, resolve_model


@click.group(cls=UserErrorGroup)
def model() -> None:
    """Model shape presets (layers, experts, top-k, sizes) and specs from HF config.json files."""


@model.command("list")
def list_models() -> None:
    """List the presets with their default precision (how each is run; --precision overrides it) and the
    sizes derived at it."""
    click.echo(f"{'preset':<20} {'precision':>10} {'MoE layers':>10} {'experts':>7} {'top-k':>5} {'expert MiB':>10} "
               f"{'total B':>8} {'active B':>8}")
    for name in model_names():
        spec = get_model(name)
        s = spec.summary()
        click.echo(
            f"{name:<20} {spec.precision_label:>10} {s['moe_layers']:>10} {s['experts']:>7} {s['top_k']:>5} "
            f"{s['expert_bytes'] / 2**20:>10.1f} {s['total_params'] / 1e9:>8.2f} {s['active_params'] / 1e9:>8.2f}"
        )
    click.echo(f"precisions: {', '.join(precision_names())}")


@model.command("show")
@click.argument("name_or_config")
@click.option("--precision", help="Weight format, e.g. bf16, q8_0, q4_0, mxfp4 (default: the preset's).")
@click.option("--json", "as_json", is_flag=True, help="Print the full spec as JSON.")
def show(name_or_config: str, precision: str | None, as_json: bool) -> None:
    """Show a preset (or a scaled one, e.g. mixtral-8x7b-x0.125), or the spec read from a config.json (or a
    model folder holding one)."""
    spec = resolve_model(name_or_config, precision)
    if as_json:
        echo_json({"spec": spec.to_dict(), "derived": spec.summary()})
        return
    for key, value in spec.summary().items():
        click.echo(f"{key:>18}: {value:,}" if isinstance(value, int) else f"{key:>18}: {value}")
    click.echo(f"{'moe layer indices':>18}: {list(spec.moe_layers)}")
    click.echo(f"{'source':>18}: {spec.source}")
    if spec.notes:
        click.echo(f"{'notes':>18}: {spec.notes}")
