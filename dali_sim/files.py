"""The files commands read and write: checked before any work starts, written atomically.

* :func:`check_input`: an input must be a regular file (or a folder where one is accepted); a FIFO
  or a device would block or never end.
* :func:`check_output`: refuses an output that is one of the inputs, a folder, a device node, a
  FIFO or a socket, that lies under something that is not a folder, or whose folder cannot be
  written (probed by creating a file there, which also catches read-only mounts and root).
* :func:`temp_path` / :func:`atomic_output` / :func:`write_text_atomic`: every output is written
  to a unique temporary name beside it (``.NAME.<random>.partial``) and renamed into place only when
  complete, so two writers never share a file, a reader never sees half a file, and a failed or
  interrupted write leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Iterator

TEMP_SUFFIX = ".partial"


class PathError(ValueError):
    """An input or output path that cannot be used; the message names the path."""


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_input(path: str | Path, what: str = "input", *, folder_ok: bool = False) -> Path:
    """``path`` exists and is a regular file (or a folder if ``folder_ok``); else :class:`PathError`
    (:class:`FileNotFoundError` when it does not exist)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file ({what})") from None
    except OSError as exc:
        raise PathError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    kind = _kind(mode)
    if kind is not None and not (folder_ok and stat.S_ISDIR(mode)):
        raise PathError(f"{path}: the {what} is {kind}, not a regular file")
    return path


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output(path: str | Path, inputs: Iterable[str | Path | None] = (), what: str = "output",
                 *, folder: bool = False) -> Path:
    """Refuse an unusable output path before any work is done (see the module docstring).

    ``inputs``: paths this run reads (None entries are ignored); the output must be none of them.
    ``folder``: the output is a folder (it may exist as one; files go inside it)."""
    path = Path(path)
    for src in inputs:
        if src is not None and _same_file(path, Path(src)):
            raise PathError(f"{path}: the {what} is also an input of this command; writing it would destroy "
                            "the input: choose another output path")
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:
        raise PathError(f"{path}: cannot use as {what}: {exc.strerror}") from None
    if mode is not None:
        kind = _kind(mode)
        if folder and not stat.S_ISDIR(mode):
            raise PathError(f"{path}: the {what} must be a folder, but it is {kind or 'a file'}")
        if not folder and kind is not None:
            raise PathError(f"{path}: the {what} is {kind}; give the path of a regular file to write")
    parent = path if (folder and mode is not None) else path.parent
    anchor = _nearest_existing(parent)
    if not anchor.is_dir():
        raise PathError(f"{path}: cannot write the {what}: {anchor} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dali-write-check.", dir=anchor)
    except OSError as exc:
        raise PathError(f"{path}: cannot write the {what}: folder {anchor} is not writable ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def files_of(path: str | Path | None) -> list[Path]:
    """``path`` and, for a folder, the files directly in it: the inputs an output must not overwrite."""
    if path is None:
        return []
    p = Path(path)
    return [p, *(c for c in sorted(p.iterdir()) if c.is_file())] if p.is_dir() else [p]


def temp_path(path: str | Path) -> Path:
    """A new, unique, empty file beside ``path`` (``.NAME.<random>.partial``), created here so that no
    other writer can pick the same name; the caller renames it into place or removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    return Path(tmp)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then act on them as usual, so that a writer's
    bookkeeping and its file never disagree (a row group written but not counted). Main thread only
    (Python runs signal handlers there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:  # None: installed outside Python, left alone
            old[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in caught:
            signal.raise_signal(sig)


def write_error(path: str | Path, exc: OSError) -> PathError:
    """A one-line error for a failed write (full disk, quota, file size limit, ...)."""
    return PathError(f"{path}: cannot write: {exc.strerror or exc}")


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is renamed to ``path`` (atomic on one file
    system), on any exception (Ctrl-C and SIGTERM included) it is removed."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename not in (None, str(tmp), str(path)):
            raise  # about another file the caller touched
        raise write_error(path, exc) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


__all__ = ["PathError", "atomic_output", "check_input", "check_output", "deferred_signals", "files_of", "temp_path",
           "write_error", "write_text_atomic"]
