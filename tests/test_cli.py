"""The `dali` command: every group and subcommand explains itself."""

from __future__ import annotations

import subprocess
import sys

import click
from click.testing import CliRunner

from dali_sim.cli.main import cli


def walk(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from walk(sub, path + (name,))


def test_every_command_has_help():
    seen = []
    for path, cmd in walk(cli):
        r = CliRunner().invoke(cli, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        assert (cmd.help or "").strip(), f"`dali {' '.join(path)}` has no help text"
        assert "Usage: " in r.output
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden and param.name not in ("help", "version"):
                assert param.help, f"`dali {' '.join(path)}` option {param.opts} has no help"
        seen.append(" ".join(path))
    assert {"trace", "trace import", "trace validate", "trace info", "model", "model show"} <= set(seen)


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "dali_sim", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "dali: study and run expert offloading" in out.stdout
