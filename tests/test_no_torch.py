"""dali_sim must never import torch (DESIGN.md): the simulator installs and runs anywhere."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

CHECK = """
import pkgutil, importlib, sys
import dali_sim
names = [m.name for m in pkgutil.walk_packages(dali_sim.__path__, 'dali_sim.')]
for name in names:
    importlib.import_module(name)
print(len(names), 'torch' in sys.modules, 'transformers' in sys.modules)
"""


def test_importing_every_dali_sim_module_never_imports_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout.split()
    count, torch_loaded, transformers_loaded = int(out[0]), out[1], out[2]
    assert count >= 10  # the walk really found the modules
    assert torch_loaded == "False" and transformers_loaded == "False"


def test_the_check_would_notice_torch():
    # guards against a check that can never fail: importing dali_exec does load torch
    if importlib.util.find_spec("torch") is None:
        import pytest

        pytest.skip("torch is not installed here")
    code = "import sys, dali_exec; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"
