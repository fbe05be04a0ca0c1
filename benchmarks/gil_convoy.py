"""A CPU-lane group under another thread's work: many torch calls against one per projection.

    python benchmarks/gil_convoy.py                       # 15 of 120 experts, 4 tokens each, hidden 512, bf16
    python benchmarks/gil_convoy.py --experts 30 --rounds 20 --json out.json

The group is what the CPU lane computes for a layer on the CPU device: ``--experts`` experts scattered over a
span of ``--rows`` rows of a layer's host store (up-projection, SiLU gate, down-projection), in two forms:
``per_expert``, two ``mm`` calls and the gate per expert (``grouped._loop_mm``, the executor's form for a sparse
span), and ``grouped``, one grouped product per projection over the whole span (``torch`` grouped mm, the
executor's form for a dense one; the same results). Each is timed (wall and this thread's CPU, medians over
``--rounds`` x ``--calls`` calls) alone and while another thread runs one of three loads:

* ``python``: pure Python (the replay's bookkeeping between its calls). A torch call gives the GIL up and takes
  it back, so each of the group's calls waits for the other thread, here up to the switch interval (5 ms);
* ``torch``: short torch calls with a little Python between;
* ``accel``: an accelerator lane on the CPU device: one expert after another from another table, a little
  Python between (the replay's situation, which ``cpu_lane_beside.py`` measures in a replay itself).

The loads take turns within each of ``--rounds`` rounds (``--calls`` calls of each form each), so that a machine
whose speed drifts over seconds weighs on every load alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
LOADS = ("none", "python", "torch", "accel")


class Group:
    """``experts`` of ``rows`` table rows (the used ones at random, sorted), ``tokens`` each."""

    def __init__(self, rows: int, experts: int, tokens: int, hidden: int, inter: int, dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.inter = inter
        self.up = (torch.randn(rows, hidden, 2 * inter, generator=g) * 0.05).to(dtype)
        self.down = (torch.randn(rows, inter, hidden, generator=g) * 0.05).to(dtype)
        used = np.sort(np.random.default_rng(seed).choice(rows, experts, replace=False))
        self.lo, hi = int(used[0]), int(used[-1]) + 1
        self.counts = np.zeros(hi - self.lo, np.int64)
        self.counts[used - self.lo] = tokens
        self.offs = torch.from_numpy(np.cumsum(self.counts).astype(np.int32))
        self.x = (torch.randn(experts * tokens, hidden, generator=g)).to(dtype)

    def _gate(self, y):
        return F.silu(y[:, : self.inter]) * y[:, self.inter:]

    def per_expert(self):
        out, a = [], 0
        for r in np.flatnonzero(self.counts).tolist():
            b = a + int(self.counts[r])
            out.append(torch.mm(self._gate(torch.mm(self.x[a:b], self.up[self.lo + r])), self.down[self.lo + r]))
            a = b
        return torch.cat(out)

    def grouped(self):
        hi = self.lo + len(self.counts)
        y = self._gate(_GROUPED_MM(self.x, self.up[self.lo:hi], offs=self.offs))
        return _GROUPED_MM(y, self.down[self.lo:hi], offs=self.offs)


class Load:
    """Another thread's work while a group is timed (one of :data:`LOADS` but ``none``); counts its rounds (a load
    that never ran would measure nothing)."""

    def __init__(self, kind: str, table: Group):
        self.kind, self.table, self.rounds = kind, table, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a, b = torch.randn(4, 64), torch.randn(64, 64)
        t, x = self.table, self.table.x[:1]
        k = 0
        while not self._stop.is_set():
            if self.kind == "torch":
                for _ in range(5):
                    torch.mm(a, b)
            elif self.kind == "accel":
                r = k % t.up.shape[0]
                torch.mm(t._gate(torch.mm(x, t.up[r])), t.down[r])
                k += 1
            s = 0
            for i in range(200 if self.kind == "python" else 30):
                s += i
            self.rounds += 1

    def __enter__(self) -> "Load":
        self._thread.start()
        while not self.rounds:
            time.sleep(1e-4)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn, calls: int, wall: list, cpu: list) -> None:
    """``calls`` calls of ``fn()``, each one's wall and thread-CPU seconds appended to ``wall`` and ``cpu``."""
    for _ in range(calls):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=120)
    p.add_argument("--experts", type=int, default=15)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--rounds", type=int, default=10,
                   help="rounds over the loads (this machine's speed drifts: each round times every load and form)")
    p.add_argument("--calls", type=int, default=5, help="calls of each form per load and round")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not 1 <= a.experts <= a.rows:
        p.error("--experts must be between 1 and --rows")
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    group = Group(a.rows, a.experts, a.tokens, a.hidden, a.inter, dtype)
    other = Group(a.rows, a.experts, a.tokens, a.hidden, a.inter, dtype, seed=1)  # (the accel load's own table)
    forms = {"per_expert": group.per_expert}
    if _GROUPED_MM is not None:
        if not torch.equal(group.per_expert(), group.grouped()):
            raise AssertionError("the two forms do not compute the same products")
        forms["grouped"] = group.grouped
    for fn in forms.values():  # (warm-up)
        timed(fn, 5, [], [])
    samples = {(load, name): ([], []) for load in LOADS for name in forms}
    load_rounds = dict.fromkeys(LOADS, 0)
    for _ in range(a.rounds):
        for load in LOADS:
            if load == "none":
                for name, fn in forms.items():
                    timed(fn, a.calls, *samples[(load, name)])
                continue
            with Load(load, other) as running:
                for name, fn in forms.items():
                    timed(fn, a.calls, *samples[(load, name)])
            load_rounds[load] += running.rounds
    rows = [{"load": load, "form": name, "wall_us": 1e6 * float(np.median(w)), "cpu_us": 1e6 * float(np.median(c)),
             "load_rounds": load_rounds[load]} for (load, name), (w, c) in samples.items()]
    alone = {r["form"]: r for r in rows if r["load"] == "none"}
    print(f"{a.experts} of {a.rows} experts x {a.tokens} tokens, hidden {a.hidden}, intermediate {a.inter}, "
          f"{a.dtype}; medians of {a.rounds} x {a.calls} calls, the loads in turn in each round; switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms")
    for r in rows:
        r["wall_over_alone"] = r["wall_us"] / alone[r["form"]]["wall_us"]
        r["cpu_over_alone"] = r["cpu_us"] / alone[r["form"]]["cpu_us"]
        print(f"  load {r['load']:6s} {r['form']:10s} wall {r['wall_us']:9.0f} us ({r['wall_over_alone']:6.2f}x)  "
              f"thread CPU {r['cpu_us']:7.0f} us ({r['cpu_over_alone']:.2f}x)")
    if a.json:
        a.json.write_text(json.dumps({"settings": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
