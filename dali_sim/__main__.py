"""``python -m dali_sim`` = the ``dali`` command."""

from dali_sim.cli.main import cli

if __name__ == "__main__":
    cli(prog_name="dali")
