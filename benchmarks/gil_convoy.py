"""A CPU-lane group under another Python thread's load: many torch calls against one.

    python benchmarks/gil_convoy.py                       # 15 experts of 4 tokens, hidden 512, intermediate 192
    python benchmarks/gil_convoy.py --experts 30 --rounds 100 --json out.json

Each torch call releases the GIL while it computes and takes it back when it returns. A thread that makes many
short calls (the CPU lane's grouped call of a sparse table: ``grouped._loop_mm``, two products per expert) takes
the GIL back once per call, and each time waits for whatever the other thread is doing: at most until that
thread's next torch call, or up to the interpreter's switch interval (5 ms) where it runs pure Python. This
times one group of ``--experts`` experts (``--tokens`` each; up-projection, SiLU, down-projection per expert,
fp32, one torch thread) in two forms, per expert (3 torch calls each, as the loop does) and as one batched
product per projection (3 calls in all, the same arithmetic per expert), alone and while another thread runs
one of two loads: pure Python (the replay's bookkeeping between its calls), or short torch calls with a little
Python between (an accelerator lane's one-expert turns). Medians over ``--rounds`` calls, microseconds.
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


def per_expert(x, up, down):
    """One expert after another: three torch calls per expert (and one to concatenate)."""
    return torch.cat([torch.mm(F.silu(torch.mm(x, up[e])), down[e]) for e in range(up.shape[0])])


def batched(x, up, down):
    """The same products as one batched call per projection."""
    return torch.bmm(F.silu(torch.bmm(x.expand(up.shape[0], -1, -1), up)), down).reshape(-1, down.shape[2])


class Load:
    """Another thread's work while a group is timed: ``python`` (pure Python) or ``torch`` (short torch calls,
    a little Python between); counts its rounds (a load that never ran would measure nothing)."""

    def __init__(self, kind: str):
        self.kind, self.rounds = kind, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a, b = torch.randn(4, 64), torch.randn(64, 64)
        while not self._stop.is_set():
            if self.kind == "torch":
                for _ in range(5):
                    torch.mm(a, b)
            s = 0
            for i in range(200 if self.kind == "python" else 50):
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


def timed(fn, args, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(ts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=15)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, generator=g)
    up = torch.randn(a.experts, a.hidden, a.inter, generator=g) * 0.05
    down = torch.randn(a.experts, a.inter, a.hidden, generator=g) * 0.05
    if not torch.allclose(per_expert(x, up, down), batched(x, up, down), atol=1e-4):
        raise AssertionError("the two forms do not compute the same products")
    forms = {"per_expert": per_expert, "batched": batched}
    for fn in forms.values():  # (warm-up)
        timed(fn, (x, up, down), 5)
    rows = []
    for load in ("none", "python", "torch"):
        for name, fn in forms.items():
            if load == "none":
                us, load_rounds = timed(fn, (x, up, down), a.rounds), 0
            else:
                with Load(load) as running:
                    us = timed(fn, (x, up, down), a.rounds)
                load_rounds = running.rounds
            rows.append({"load": load, "form": name, "us": us, "load_rounds": load_rounds})
    alone = {r["form"]: r["us"] for r in rows if r["load"] == "none"}
    print(f"{a.experts} experts x {a.tokens} tokens, hidden {a.hidden}, intermediate {a.inter}; median of "
          f"{a.rounds} calls (us), and over the same form alone; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    for r in rows:
        r["over_alone"] = r["us"] / alone[r["form"]]
        print(f"  load {r['load']:6s} {r['form']:10s} {r['us']:10.0f} us  {r['over_alone']:7.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"settings": vars(a) | {"json": str(a.json)}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
