"""`dali` starts fast: the CLI and `dali --help` import no scipy, pandas or pyarrow (they cost about 1.5 s);
the commands import them when they run. (Wall times are measured by benchmarks/startup.py, not here.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("scipy", "pandas", "pyarrow", "simpy", "matplotlib", "torch")


def loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("LOADED:"))
    return set(filter(None, line.removeprefix("LOADED:").split(",")))


def test_importing_the_cli_imports_no_heavy_module():
    assert loaded_after("import dali_sim.cli.main") == set()


def test_help_of_every_group_imports_no_heavy_module():
    for args in ([], ["trace"], ["sim"], ["exec"], ["model"], ["hw"]):
        code = ("from dali_sim.cli.main import cli\ntry:\n"
                f"    cli({args + ['--help']!r}, standalone_mode=False)\nexcept SystemExit:\n    pass")
        assert loaded_after(code) == set(), args


def test_small_commands_import_only_what_they_need():
    # model list reads presets only; trace info reads a footer (pyarrow) but no pandas
    assert loaded_after("from dali_sim.cli.main import cli\ncli(['model', 'list'], standalone_mode=False)") == set()
    got = loaded_after("from dali_sim.cli.main import cli\n"
                       "cli(['trace', 'info', 'traces/gpt-oss-20b.parquet'], standalone_mode=False)")
    assert "pandas" not in got and "scipy" not in got


def test_lazy_package_exports_are_the_objects_not_modules():
    """A lazy export is resolved on first use; importing the package's submodules first must not turn a
    name into the module of the same name (the import system sets package attributes)."""
    import importlib
    import pkgutil
    import types

    import dali_sim

    for m in pkgutil.walk_packages(dali_sim.__path__, "dali_sim."):
        importlib.import_module(m.name)
    for pkg in ("dali_sim.trace", "dali_sim.runtime", "dali_sim.workload", "dali_sim.sim", "dali_sim.hardware",
                "dali_sim.policies", "dali_sim.models"):
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            assert not isinstance(getattr(mod, name), types.ModuleType), f"{pkg}.{name} is a module"
    from dali_sim.sim import simulate
    from dali_sim.trace import read_trace

    assert callable(simulate) and callable(read_trace)


@pytest.mark.parametrize("module", ["dali_sim.runtime.memory", "dali_sim.policies.base", "dali_sim.policies.systems",
                                    "dali_sim.sim.lower_bound", "dali_sim.hardware.cost", "dali_sim.workload.builder"])
def test_every_module_imports_first(module):
    """Any module can be the first one imported (no import cycle that only a particular order hides)."""
    subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=True)
