"""Host cost of the CUDA calls the executor's accelerator lane makes in every layer visit, each beside a
cheaper form of the same work. CUDA only (exit 2 without it).

    python benchmarks/cuda_host_calls.py                  # a few seconds
    python benchmarks/cuda_host_calls.py --calls 5000 --rounds 7 --json calls.json

On the first GPU lent (an H200, benchmarks/README.md "On a lent H200") the lane's host work per visit was
5-14x the CPU device's. Under cProfile most of it was in four places: a new timing event per stamp
(``Timer.mark``), a ``torch.cuda.stream`` context around each copy, and index arrays moved to the GPU by
``pin_memory()`` and ``.to()`` twice per visit. This measures each against the form that would replace it, so
that one device call decides which change pays before any is made. The second GPU lent measured them and the
executor took the second form of the first three (74202af; benchmarks/README.md, "The second lent H200"):
events made when a run starts, ``set_stream`` pairs, and a ring of pinned buffers:

* ``event new + record`` (``Timer.mark``) / ``event pooled record`` (events made at set-up, recorded again);
* ``stream context`` (``with torch.cuda.stream(s)``) / ``set_stream pair`` (``torch.cuda.set_stream`` to the
  copy stream and back);
* ``index pin_memory + to`` (``_device_indices``: a new pinned tensor, then a device tensor) / ``index into
  pinned + copy_`` (written into a pinned buffer and copied into a device buffer, both made at set-up);
* ``stream wait_event`` and ``expert copy issue`` (``dst.copy_(src, non_blocking=True)`` from pinned memory,
  in a stream context as ``CopyEngine.copy_one`` makes it): what every fetch makes.

Per case: thread-CPU microseconds per call (what the host spends; the device work is queued, not waited
for), the median over ``--rounds`` rounds of ``--calls`` calls each, the device synchronised between rounds.
The pooled and buffered forms reuse their event or buffer without waiting, so they time the calls only: a
real pool must not record an event again, nor write a buffer, before the device has passed its last use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dali_exec.executor.devices import cpu_name

#: the Qwen3-30B-A3B shape at batch 32: 256 (token, expert) pairs a visit
PAIRS = 256
#: a small expert (64 KiB in bf16): the host's cost of issuing a copy, without filling the copy queue (a full
#: queue makes the issuing thread wait, which would read as host time)
EXPERT_NUMEL = 1 << 15


def cases(device: torch.device) -> dict:
    """Name -> a call of no arguments, made ``--calls`` times a round."""
    copy, compute = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    pool = [torch.cuda.Event(enable_timing=True) for _ in range(64)]
    for ev in pool:  # (an event is created on the device at its first record)
        ev.record(compute)
    done = pool[0]
    index = np.arange(2 * PAIRS, dtype=np.int64)
    pinned = torch.empty(2 * PAIRS, dtype=torch.int64, pin_memory=True)
    on_device = torch.empty(2 * PAIRS, dtype=torch.int64, device=device)
    host = torch.randn(4, EXPERT_NUMEL).to(torch.bfloat16).pin_memory()
    slots = torch.empty(4, EXPERT_NUMEL, dtype=torch.bfloat16, device=device)
    turn = iter(range(1 << 62))

    def new_event():
        torch.cuda.Event(enable_timing=True).record(compute)

    def pooled_event():
        pool[next(turn) & 63].record(compute)

    def stream_context():
        with torch.cuda.stream(copy):
            pass

    def set_stream_pair():
        torch.cuda.set_stream(copy)
        torch.cuda.set_stream(compute)

    def pin_and_to():
        torch.from_numpy(index).pin_memory().to(device, non_blocking=True)

    def into_pinned():
        pinned.copy_(torch.from_numpy(index))
        on_device.copy_(pinned, non_blocking=True)

    def wait_event():
        copy.wait_event(done)

    def expert_copy():
        i = next(turn) & 3
        with torch.cuda.stream(copy):
            slots[i].copy_(host[i], non_blocking=True)

    return {"event new + record": new_event, "event pooled record": pooled_event,
            "stream context": stream_context, "set_stream pair": set_stream_pair,
            "index pin_memory + to": pin_and_to, "index into pinned + copy_": into_pinned,
            "stream wait_event": wait_event, "expert copy issue (in a stream context)": expert_copy}


def measure(calls: dict, n: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Median over rounds of thread-CPU microseconds per call (one warm-up round first)."""
    out = {}
    for name, fn in calls.items():
        per_round = []
        for r in range(rounds + 1):
            torch.cuda.synchronize(device)
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            spent = time.thread_time() - t0
            if r:
                per_round.append(1e6 * spent / n)
        torch.cuda.synchronize(device)
        out[name] = float(np.median(per_round))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.calls < 1 or a.rounds < 1:
        ap.error("--calls and --rounds must be at least 1")
    if not torch.cuda.is_available():
        print("cuda_host_calls: CUDA is not available (this measures CUDA calls only)", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    with torch.cuda.device(device):
        us = measure(cases(device), a.calls, a.rounds, device)
    machine = {"gpu": torch.cuda.get_device_name(device), "cpu": cpu_name(), "cores": os.cpu_count(),
               "load_average": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version()}
    print(f"machine: {machine}")
    print(f"thread-CPU us per call, median of {a.rounds} rounds of {a.calls} calls")
    for name, v in us.items():
        print(f"{name:42s} {v:8.2f}")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine, "settings": vars(a) | {"json": str(a.json)},
                                      "us_per_call": us}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
