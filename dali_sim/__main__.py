"""``python -m dali_sim`` = the ``dali`` command."""

from dali_sim.cli.main import cli

cli(prog_name="dali")
