"""Contention: how fast each busy lane progresses while other lanes are busy too.

The engine runs at most one activity per lane at a time: the accelerator lane (``gpu``: dense parts
and GPU experts, and the host's own work, which runs on the same thread), the CPU lane (``cpu``) and
the copy lane (``h2d``). Alone, an activity takes its cost-model time. While several lanes are busy
they may share something physical: host DRAM bandwidth (CPU experts and DMA copies both read host
memory) and, when the "GPU" is the CPU device, the cores themselves. A :class:`Contention` model
gives each busy lane a *rate* in (0, 1] (1 = as fast as alone) from the set of busy lanes; the engine
keeps rates constant between starts and ends of activities (a fluid, rate-sharing model with coarse
events, docs/simulator.md).

Two models, one interface, chosen by the profile:

* :class:`SharedHostBandwidth` (analytic profiles): each activity declares the host-DRAM bandwidth it
  draws alone (bytes moved / time alone); while the demands of the busy lanes exceed the DRAM's
  sustainable total, every host-memory user slows by the same factor (proportional sharing).
* :class:`MeasuredSlowdowns` (measured profiles): slowdown factors measured by ``dali exec calibrate``
  for every combination of busy lanes (each primitive alone and under the others' load).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import combinations
from typing import Mapping

LANES = ("gpu", "cpu", "h2d")


def combo_key(lanes) -> str:
    """The table key of a set of busy lanes, in canonical order: ``"cpu+gpu"``, ``"cpu+gpu+h2d"``, ..."""
    return "+".join(sorted(set(lanes)))


def lane_combinations() -> list[str]:
    """Every set of two or more lanes, as table keys."""
    return [combo_key(c) for n in range(2, len(LANES) + 1) for c in combinations(LANES, n)]


class Contention(ABC):
    """Rates of the busy lanes. ``busy`` maps each busy lane to the host-DRAM bandwidth (bytes/s) its
    current activity draws when alone (used by bandwidth models; 0 = none)."""

    @abstractmethod
    def rates(self, busy: Mapping[str, float]) -> dict[str, float]:
        """Rate in (0, 1] of each lane of ``busy``."""

    @abstractmethod
    def interferes(self, busy: Mapping[str, float]) -> bool:
        """Could any rate be below 1 if these lanes (with at most these demands) were busy together?"""

    def describe(self) -> dict:
        return {"model": type(self).__name__}


class NoContention(Contention):
    """Lanes never slow each other (the model before contention; also a reference for tests)."""

    def rates(self, busy: Mapping[str, float]) -> dict[str, float]:
        return dict.fromkeys(busy, 1.0)

    def interferes(self, busy: Mapping[str, float]) -> bool:
        return False


@dataclass(frozen=True)
class SharedHostBandwidth(Contention):
    """Proportional sharing of host DRAM bandwidth (``capacity``, bytes/s) among the lanes that read it.

    With demands ``d_i`` (bytes/s each would draw alone) and ``D = sum d_i``: if ``D <= capacity`` every
    rate is 1; otherwise every lane with ``d_i > 0`` runs at ``capacity / D`` and lanes that draw no
    host bandwidth (a real GPU computing from its own memory) at 1. Proportional sharing is the simplest
    model that conserves bandwidth; real memory controllers are roughly fair between a DMA stream and
    CPU cores, not strictly so."""

    capacity: float

    def __post_init__(self) -> None:
        if not self.capacity > 0:
            raise ValueError(f"host memory capacity must be > 0 bytes/s, got {self.capacity}")

    def rates(self, busy: Mapping[str, float]) -> dict[str, float]:
        total = sum(busy.values())
        if total <= self.capacity:
            return dict.fromkeys(busy, 1.0)
        share = self.capacity / total
        return {lane: (share if d > 0 else 1.0) for lane, d in busy.items()}

    def interferes(self, busy: Mapping[str, float]) -> bool:
        return sum(busy.values()) > self.capacity

    def describe(self) -> dict:
        return {"model": "SharedHostBandwidth", "capacity_gbs": self.capacity / 1e9}


@dataclass(frozen=True)
class MeasuredSlowdowns(Contention):
    """Slowdowns measured per combination of busy lanes: ``table["cpu+h2d"]["h2d"] = 1.4`` means a copy
    takes 1.4x as long while a CPU expert runs. A combination missing from the table (or a lane missing
    from a combination) is taken as no slowdown only if ``complete`` is False; measured profiles are
    complete (calibration measures every combination)."""

    table: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, factors in self.table.items():
            lanes = key.split("+")
            if key != combo_key(lanes) or len(lanes) < 2 or not set(lanes) <= set(LANES):
                raise ValueError(f"contention table key {key!r}: expected two or more of {LANES} joined by '+' in "
                                 f"sorted order, e.g. {lane_combinations()[0]!r}")
            if set(factors) != set(lanes):
                raise ValueError(f"contention table {key!r}: needs a slowdown for each of {lanes}, got {sorted(factors)}")
            for lane, f in factors.items():
                if not f >= 1.0 or f != f or f == float("inf"):
                    raise ValueError(f"contention table {key}.{lane}: a slowdown must be a finite number >= 1, got {f!r}")

    def rates(self, busy: Mapping[str, float]) -> dict[str, float]:
        if len(busy) < 2:
            return dict.fromkeys(busy, 1.0)
        factors = self.table.get(combo_key(busy))
        if factors is None:
            return dict.fromkeys(busy, 1.0)
        return {lane: 1.0 / factors[lane] for lane in busy}

    def interferes(self, busy: Mapping[str, float]) -> bool:
        if len(busy) < 2:
            return False
        lanes = list(busy)
        for n in range(2, len(lanes) + 1):
            for c in combinations(lanes, n):
                f = self.table.get(combo_key(c))
                if f is not None and any(v > 1.0 for v in f.values()):
                    return True
        return False

    def describe(self) -> dict:
        return {"model": "MeasuredSlowdowns", "table": {k: dict(v) for k, v in self.table.items()}}


__all__ = ["LANES", "Contention", "MeasuredSlowdowns", "NoContention", "SharedHostBandwidth", "combo_key",
           "lane_combinations"]
