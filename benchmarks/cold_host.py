"""What a host call costs right after other work, on this machine: warm, after a few milliseconds of
spinning on the clock (which touches almost no memory), of a compiled busy wait (which touches none and runs
next to no interpreter code), after sleeping, and after a pass over a buffer.

    python benchmarks/cold_host.py                    # about a minute
    python benchmarks/cold_host.py --quick --json out.json

The executor's decisions and bookkeeping run between a layer's computes, which take milliseconds. On a
machine whose cores and caches are its own, what evicts the host code's data and code from the caches
is the tensor work, and a pass over a buffer as large as that work's data (``pass``) reproduces it. On a
virtual machine whose physical core is shared (another tenant on its sibling hardware thread, or the
hypervisor running something else on it), time alone does it: a spin that touches nothing but the clock
then leaves the next call as slow as a pass over tens of MiB. Which kind of machine this is decides how
``exec_overhead.py``'s figures read (benchmarks/README.md, "Executor overhead").

Per case (one Python, NumPy, numba or torch call, as the executor's host path makes them) and per
condition: the median wall-clock microseconds of one call made right after the condition, over
``--trials`` trials, and its ratio to the warm median (the call right after the same call). Wall clock:
the thread-CPU clock is a system call, itself slowed by the same effect. ``condition_ms`` is how long the
condition took (the pass's time grows with its size)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dali_exec.executor.devices import cpu_name
from dali_sim.policies.kernels import jit


def spin(seconds: float) -> None:
    """Busy for ``seconds`` on this thread, reading nothing but the clock."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _registers(n):
    """``n`` steps of a linear congruential generator: compiled, it touches no memory (registers only)."""
    x = 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    return x


_busy_loop = jit(_registers)
_CHUNK_S = 50e-6  # the clock is read between chunks of about this long


class BusyWait:
    """Busy for at least a given time, as :func:`spin`, but in compiled chunks of register-only work with the clock
    read between them (every ~50 us): the wait itself runs next to no interpreter code and touches no memory, so
    whatever it leaves in the caches and branch predictors differently from before is time's doing, not its own.
    The chunk's length in steps is measured once (the fastest of five 2 ms runs). Without numba: refused."""

    def __init__(self):
        if _busy_loop is None:
            raise RuntimeError("a busy wait of compiled register-only work needs numba (DALI_NUMBA=0 is set)")
        _busy_loop(10)
        probe = 200_000
        best = min(self._timed(probe) for _ in range(5))
        self.chunk = max(1, int(probe * _CHUNK_S / best))

    @staticmethod
    def _timed(n: int) -> float:
        t0 = time.perf_counter()
        _busy_loop(n)
        return time.perf_counter() - t0

    def __call__(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        loop, chunk, clock = _busy_loop, self.chunk, time.perf_counter
        while clock() < end:
            loop(chunk)


def cases() -> dict:
    """The calls timed: each a zero-argument callable doing one thing the executor's host path does."""
    ids = np.arange(64)
    weights = np.arange(64, dtype=np.float32)
    x, index = torch.randn(64, 64), torch.arange(8)
    out = {
        "python call": lambda: None,
        "np.zeros(64)": lambda: np.zeros(64),
        "np.flatnonzero": lambda: np.flatnonzero(ids),
        "ndarray.tolist": ids.tolist,
        "torch.from_numpy": lambda: torch.from_numpy(weights),
        "Tensor.narrow": lambda: x.narrow(0, 2, 8),
        "Tensor.index_select": lambda: x.index_select(0, index),
        "time.thread_time": time.thread_time,
    }
    five = jit(_five)
    if five is not None:  # (numba off: the case is left out)
        five(ids, ids, ids, ids, ids)
        out["numba call, 5 arrays"] = lambda: five(ids, ids, ids, ids, ids)
    return out


def _five(a, b, c, d, e):
    """A compiled call's body that does next to nothing with its five array arguments."""
    return a[0] + b[0] + c[0] + d[0] + e[0]


def conditions(spin_ms: list[float], pass_mib: list[int]) -> dict:
    """What runs before each timed call: name -> callable (None: the warm case, the call itself)."""
    out = {"warm": None}
    busy = BusyWait() if _busy_loop is not None else None  # (numba off: the busy wait is left out)
    for ms in spin_ms:
        out[f"spin {ms:g} ms"] = lambda s=ms / 1e3: spin(s)
        if busy is not None:
            out[f"busy {ms:g} ms"] = lambda s=ms / 1e3: busy(s)
        out[f"sleep {ms:g} ms"] = lambda s=ms / 1e3: time.sleep(s)
    for mib in pass_mib:
        buf = np.zeros((mib << 20) // 8)
        out[f"pass {mib} MiB"] = lambda b=buf: np.add(b, 1.0, out=b)
    return out


def measure(cases: dict, conditions: dict, trials: int) -> pd.DataFrame:
    """Median microseconds of each case after each condition; conditions interleaved trial by trial, so a
    drift of the machine spreads over all of them."""
    clock = time.perf_counter_ns
    names = list(conditions)
    rows = []
    for case, fn in cases.items():
        fn()
        took = {c: [] for c in names}
        spent = {c: [] for c in names}
        for _ in range(trials):
            for c in names:
                before = conditions[c]
                t0 = clock()
                if before is None:
                    fn()
                else:
                    before()
                t1 = clock()
                fn()
                took[c].append(clock() - t1)
                spent[c].append(t1 - t0)
        warm = np.median(took["warm"]) / 1e3
        for c in names:
            us = np.median(took[c]) / 1e3
            rows.append({"case": case, "condition": c, "us": us, "ratio": us / warm,
                         "condition_ms": np.median(spent[c]) / 1e6})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spin-ms", default="1,3,10", help="spin, busy-wait and sleep durations (comma-separated)")
    ap.add_argument("--pass-mib", default="4,32", help="buffer sizes of the memory passes (comma-separated)")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="10 trials, spin/sleep 1 and 10 ms, one 4 MiB pass")
    ap.add_argument("--json", type=Path, help="write the table, the machine and the settings here")
    a = ap.parse_args(argv)
    if a.quick:
        a.trials, a.spin_ms, a.pass_mib = 10, "1,10", "4"
    try:
        spin_ms = [float(v) for v in a.spin_ms.split(",") if v]
        pass_mib = [int(v) for v in a.pass_mib.split(",") if v]
    except ValueError as e:
        ap.error(f"--spin-ms / --pass-mib: {e}")
    if a.trials < 1 or any(v <= 0 for v in spin_ms + pass_mib):
        ap.error("--trials, --spin-ms and --pass-mib must be positive")
    if a.json is not None and not a.json.parent.is_dir():
        ap.error(f"--json {a.json}: no such directory {a.json.parent}")
    torch.set_num_threads(1)
    table = measure(cases(), conditions(spin_ms, pass_mib), a.trials)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
               "torch": torch.__version__, "python": platform.python_version()}
    print(f"machine: {machine}")
    print(f"wall-clock us of one call right after the condition, median of {a.trials} trials (ratio: to warm)")
    wide = table.pivot(index="case", columns="condition", values="us")[list(dict.fromkeys(table["condition"]))]
    spent = table.groupby("condition", sort=False)["condition_ms"].median()
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(wide.round(1).to_string())
        print("condition ms: " + ", ".join(f"{c} {v:.2f}" for c, v in spent.items()))
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "settings": vars(a) | {"json": str(a.json)},
                                      "rows": table.to_dict("records")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
