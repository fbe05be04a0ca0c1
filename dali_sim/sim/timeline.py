"""Chrome / Perfetto trace export: one track per resource (open in ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from dali_sim.files import write_text_atomic
from dali_sim.sim.engine import TRACKS, Interval


def chrome_trace(intervals: Iterable[Interval], process_name: str = "dali sim") -> dict:
    """Trace Event Format: complete ("X") events in microseconds, one thread per track."""
    tid = {track: i + 1 for i, track in enumerate(TRACKS)}
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": process_name}}]
    for track, i in tid.items():
        events.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": track.upper()}})
    for iv in intervals:
        events.append({"ph": "X", "pid": 1, "tid": tid[iv.track], "name": iv.name, "cat": iv.track,
                       "ts": iv.start * 1e6, "dur": (iv.end - iv.start) * 1e6, "args": iv.args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(path: str | Path, intervals: Iterable[Interval], process_name: str = "dali sim") -> Path:
    return write_text_atomic(path, json.dumps(chrome_trace(intervals, process_name)))
