"""numba's on-disk cache of compiled kernels, keyed also by every kernel source file of the package.

numba checks a cached kernel against its own source file only, yet a kernel that calls another compiled
function carries that function's machine code in its cache entry: after an edit of ``policies/kernels.py``
(or an upgrade that changes it but not its callers), the cached plan kernels of ``runtime/plan_kernel.py``
would go on running the old code, silently. Here every kernel's cache entry is keyed also by a SHA-256 of
the package's kernel sources (every ``.py`` file of ``dali_sim`` and ``dali_exec`` that compiles a kernel:
its text holds ``jit(``), so any change to them compiles afresh.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Callable

#: the packages whose kernels call each other (``dali_exec``'s only when installed beside ``dali_sim``)
_PACKAGES = ("dali_sim", "dali_exec")
_ROOT = Path(__file__).resolve().parents[2]  # (the folder holding them)
_MARKER = b"jit("


@functools.cache
def kernel_sources() -> tuple[Path, ...]:
    """The package's source files that compile kernels, in a fixed order."""
    files = []
    for package in _PACKAGES:
        files += [p for p in sorted((_ROOT / package).rglob("*.py")) if _MARKER in p.read_bytes()]
    return tuple(files)


@functools.cache
def sources_fingerprint() -> str:
    """SHA-256 over the kernel source files' paths (relative) and contents."""
    h = hashlib.sha256()
    for p in kernel_sources():
        h.update(p.relative_to(_ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _cache_class():
    from numba.core.caching import FunctionCache

    class KernelCache(FunctionCache):
        """numba's cache of a function, its index key extended by :func:`sources_fingerprint`."""

        def _index_key(self, sig, codegen):
            return (*super()._index_key(sig, codegen), sources_fingerprint())

    return KernelCache


def njit_cached(nb, fn: Callable):
    """``numba.njit(nogil=True)(fn)`` with the on-disk cache keyed by the kernel sources (numba's own
    ``cache=True`` where its dispatcher does not take a cache object as this expects)."""
    dispatcher = nb.njit(nogil=True)(fn)
    if not hasattr(dispatcher, "_cache"):
        return nb.njit(cache=True, nogil=True)(fn)
    dispatcher._cache = _cache_class()(fn)
    return dispatcher
