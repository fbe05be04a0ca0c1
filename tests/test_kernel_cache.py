"""numba's on-disk kernel cache is keyed by every kernel source file (dali_sim.policies.kernel_cache): a kernel
that calls another compiled function is compiled afresh when that function's source changes, instead of
running the machine code cached before the change."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dali_sim.policies import kernel_cache, kernels

REPO = Path(__file__).resolve().parents[1]
needs_numba = pytest.mark.skipif(kernels.backend() == "python", reason="numba is off")


def _calls_jit(path: Path) -> bool:
    """Does the module call something named ``jit`` or ``njit_cached`` (the ways a kernel is compiled)?"""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("jit", "njit", "njit_cached"):
                return True
    return False


def test_every_module_that_compiles_a_kernel_is_in_the_fingerprint():
    compiling = {p for package in ("dali_sim", "dali_exec") for p in (REPO / package).rglob("*.py") if _calls_jit(p)}
    assert compiling, "no kernel module found"
    assert compiling <= set(kernel_sources := kernel_cache.kernel_sources()), sorted(compiling - set(kernel_sources))
    assert REPO / "dali_sim" / "runtime" / "plan_kernel.py" in compiling


@needs_numba
def test_a_compiled_kernel_is_cached_under_the_sources_fingerprint():
    fn = kernels.jit(lambda x: x + 1)
    assert fn(2) == 3
    cache = fn._cache
    assert type(cache).__name__ == "KernelCache"
    sig = next(iter(fn.overloads))
    key = cache._index_key(sig, fn.targetctx.codegen())
    assert key[-1] == kernel_cache.sources_fingerprint()


_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numba
    from dali_sim.policies import kernel_cache
    kernel_cache.sources_fingerprint = lambda: sys.argv[2]  # (the stand-in for the package's sources)
    import callee
    inner = kernel_cache.njit_cached(numba, callee.inner)
    import caller
    caller.inner = inner
    outer = kernel_cache.njit_cached(numba, caller.outer)
    print(outer(1), sum(outer.stats.cache_hits.values()))
""")


@needs_numba
def test_a_changed_callee_is_compiled_afresh(tmp_path):
    """numba alone would load ``outer`` from its cache after ``inner``'s file changed (its own file did not)
    and return the old value; keyed by the sources' fingerprint, it compiles again."""
    (tmp_path / "caller.py").write_text("inner = None\n\ndef outer(x):\n    return inner(x) * 10\n")
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)

    def run(body: str, fingerprint: str) -> list[str]:
        (tmp_path / "callee.py").write_text(f"def inner(x):\n    return x + {body}\n")
        for pyc in (tmp_path / "__pycache__").glob("callee*.pyc"):
            pyc.unlink()  # (a rewrite within the same second keeps the .pyc's stamp)
        out = subprocess.run([sys.executable, str(script), str(tmp_path), fingerprint], capture_output=True,
                             text=True, check=True, cwd=REPO)
        return out.stdout.split()

    assert run("1", "a") == ["20", "0"]  # compiled, then cached
    assert run("1", "a") == ["20", "1"]  # loaded from the cache
    assert run("2", "b")[0] == "30"  # the callee changed, and with it the fingerprint: compiled afresh
