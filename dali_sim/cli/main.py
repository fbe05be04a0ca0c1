"""Entry point: ``dali`` with one subcommand group per area."""

from __future__ import annotations

import click

from dali_sim import __version__
from dali_sim.cli.common import UserErrorGroup
from dali_sim.cli.exec_cmd import exec_group
from dali_sim.cli.hw import hw
from dali_sim.cli.model import model
from dali_sim.cli.sim import sim
from dali_sim.cli.sweep import sweep
from dali_sim.cli.trace import trace


@click.group(cls=UserErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dali")
def cli() -> None:
    """dali: study and run expert offloading for Mixture-of-Experts inference on one PC.

    \b
    trace   make, import, check and describe routing traces (Parquet)
    model   model shape presets and specs read from Hugging Face configs
    hw      hardware profiles and the cost model built on them
    sim     simulate offloading systems (placement, prefetch, cache) on a trace
    sweep   ablations at scale: a TOML grid of traces, systems and settings, in parallel, resumable
    exec    run them on real devices with torch: replay, real models, calibration, validation
    """


cli.add_command(trace)
cli.add_command(model)
cli.add_command(hw)
cli.add_command(sim)
cli.add_command(sweep)
cli.add_command(exec_group)
