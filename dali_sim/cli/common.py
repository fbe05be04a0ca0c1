"""Helpers shared by the subcommands."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import click

from dali_sim.jsonsafe import json_safe
from dali_sim.registry import UnknownNameError
from dali_sim.trace.schema import TraceError

#: errors that are the user's input, shown as one clear line instead of a traceback
USER_ERRORS = (TraceError, UnknownNameError, ValueError, FileNotFoundError)


_ARGV_KEY = "dali.argv"


def command_line() -> str:
    """The command as typed (recorded by the root group), for provenance."""
    ctx = click.get_current_context(silent=True)
    argv = ctx.find_root().meta.get(_ARGV_KEY) if ctx else None
    if argv is None:
        argv = sys.argv[1:]
    return " ".join(["dali", *(shlex.quote(a) for a in argv)])


def echo_json(data: Any) -> None:
    """Strict JSON (NaN -> null) on stdout."""
    click.echo(json.dumps(json_safe(data), indent=2, allow_nan=False, default=str))


class UserErrorGroup(click.Group):
    """A group whose subcommands report input errors as one ``Error: ...`` line (exit code 1)."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        ctx = super().make_context(info_name, list(args), parent=parent, **extra)
        if parent is None:
            ctx.meta[_ARGV_KEY] = list(args)
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            raise click.ClickException(str(exc)) from exc
