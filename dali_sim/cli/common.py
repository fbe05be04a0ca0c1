"""Helpers shared by the subcommands."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

import click

from dali_sim.files import check_output
from dali_sim.registry import UnknownNameError
from dali_sim.trace.schema import TraceError

#: errors that are the user's input or the machine's (a full disk, a missing file), shown as one clear
#: line instead of a traceback
USER_ERRORS = (TraceError, UnknownNameError, ValueError, OSError)


def error_line(exc: BaseException) -> str:
    """The one line shown for a user error; an OS error names its file."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def printable(value: Any) -> str:
    """Text read from a file, safe to print: control characters (terminal escape codes) shown escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(value))


EXEC_HINT = "install the exec extra: pip install torch==2.13.0 && pip install -e '.[exec]'"


def require_exec(module: str):
    """Import a torch-side module for a command; without torch (or transformers) one line that says how to
    get it, the same for every command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise click.ClickException(f"this command needs torch and transformers ({exc}); {EXEC_HINT}") from None


class GiBType(click.ParamType):
    """A memory size in GiB: a finite number > 0 (0, NaN and inf are refused, not read as "the default")."""

    name = "GIB"

    def convert(self, value, param, ctx):
        from dali_sim.hardware.profile import MAX_MEMORY_GIB

        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of GiB", param, ctx)
        if not 0.0 < x <= MAX_MEMORY_GIB:  # also refuses NaN and inf
            self.fail(f"must be a number of GiB in (0, {MAX_MEMORY_GIB:g}], got {value!r}; omit the option for the "
                      "hardware profile's GPU memory", param, ctx)
        return x


GIB_TYPE = GiBType()


class DtypeType(click.ParamType):
    """A weight dtype of the one vocabulary (:mod:`dali_sim.dtypes`): bf16, fp16, fp32 (and auto where a
    checkpoint is loaded); bfloat16, float16, float32 are accepted as aliases."""

    name = "DTYPE"

    def __init__(self, allow_auto: bool = False):
        self.allow_auto = allow_auto

    def convert(self, value, param, ctx):
        from dali_sim.dtypes import canonical_dtype

        try:
            return canonical_dtype(value, allow_auto=self.allow_auto)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)

    def get_metavar(self, param, ctx=None) -> str:
        return "[bf16|fp16|fp32" + ("|auto]" if self.allow_auto else "]")


#: replayed or calibrated random weights (exec run, validate, calibrate): bf16 by default
REPLAY_DTYPE = DtypeType()
#: a real checkpoint's weights (trace record, calibrate-residual, exec generate): fp32 by default, auto = its own
MODEL_DTYPE = DtypeType(allow_auto=True)
#: tokens generated per prompt, the same default wherever a real model generates (record, generate)
MAX_NEW_TOKENS = 32
#: seeds: NumPy seeds are non-negative
SEED_TYPE = click.IntRange(min=0)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, batch schedulers), raised like Ctrl-C so that every writer keeps
    what it has written (a readable partial trace) or removes its temporary file."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the clean-up
    raise Terminated()


#: the files of a transformers checkpoint folder that loading it reads
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "model*.safetensors", "*.safetensors.index.json",
                     "pytorch_model*.bin", "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "vocab*",
                     "merges.txt", "*.model", "chat_template*")


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The files of a local checkpoint folder a model load reads (outputs must be none of them); [] for a
    name in the Hugging Face cache."""
    p = Path(model_path)
    if not p.is_dir():
        return []
    return sorted({f for pattern in _CHECKPOINT_FILES for f in p.glob(pattern) if f.is_file()})


def check_outputs(outputs: Mapping[str, str | Path | None], inputs: Iterable[str | Path | None]) -> None:
    """Before any work: each given output (``{what: path}``) is usable, none is an input, no two coincide."""
    inputs = [Path(p) for p in inputs if p is not None]
    done: list[Path] = []
    for what, path in outputs.items():
        if path is not None:
            check_output(path, inputs + done, what)
            done.append(Path(path))


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
    from dali_sim.jsonsafe import json_safe

    click.echo(json.dumps(json_safe(data), indent=2, allow_nan=False, default=str))


class UserErrorGroup(click.Group):
    """A group whose subcommands report input errors as one ``Error: ...`` line (exit code 1)."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        ctx = super().make_context(info_name, list(args), parent=parent, **extra)
        if parent is None:
            ctx.meta[_ARGV_KEY] = list(args)
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        previous = None
        if ctx.parent is None and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return super().invoke(ctx)
        except USER_ERRORS as exc:
            raise click.ClickException(error_line(exc)) from exc
        except Terminated:
            click.echo("stopped: terminated (SIGTERM)", err=True)
            raise click.exceptions.Exit(128 + signal.SIGTERM) from None
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
