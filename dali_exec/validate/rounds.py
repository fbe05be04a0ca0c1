"""How far the calibration's own rounds move a prediction (docs/validation.md, "The calibration's rounds").

A calibration measures its tables in rounds and keeps each point's median. For the expert tables and the lanes'
fixed parts per grouped call, the profile also keeps every round's (``provenance.expert_rounds``). A validation
simulates each system once more per round, with that round's tables in place of the medians: the range of those
totals is how much of a simulated time the calibration alone leaves open: on Qwen3-30B-A3B's small experts 16-27%
of a system's total on the 2-core VM, on Mixtral's 5-17%.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dali_sim.hardware.measured import CurveTable, MeasuredProfile, write_measured_profile

LANES = ("gpu", "cpu")


def round_profiles(profile: MeasuredProfile, out: Path) -> list[str]:
    """One profile per calibration round, written under ``out``: ``profile`` with that round's expert tables and
    lanes' fixed parts instead of their medians. [] for a profile with fewer than two rounds or without them (one
    written before they were kept)."""
    rounds = profile.provenance.get("expert_rounds")
    if not rounds:
        return []
    n = _rounds(profile, rounds)
    if n < 2:
        return []
    paths = []
    for r in range(n):
        variant = dataclasses.replace(
            profile, name=f"{profile.name}-round{r}",
            gpu_expert=CurveTable(profile.gpu_expert.x, tuple(rounds["gpu"]["shares"][r])),
            cpu_expert=CurveTable(profile.cpu_expert.x, tuple(rounds["cpu"]["shares"][r])),
            lanes={lane: float(rounds[lane]["fixed"][r]) for lane in LANES})
        path = out / f"profile.round{r}.json"
        try:
            paths.append(str(write_measured_profile(path, variant)))
        except ValueError as exc:  # (the reader's message, without the temporary file's name)
            raise ValueError(f"{profile.path or profile.name}: provenance.expert_rounds, round {r}: "
                             f"{str(exc).replace(f'{path}: ', '')}") from None
    return paths


def _rounds(profile: MeasuredProfile, rounds) -> int:
    """The number of rounds in ``provenance.expert_rounds``, its shape checked against the profile's expert tables
    (each lane: as many shares lists, each as long as the table, as fixed parts)."""
    where = f"{profile.path or profile.name}: provenance.expert_rounds"
    try:
        n = len(rounds["gpu"]["fixed"])
        for lane in LANES:
            r, points = rounds[lane], len(getattr(profile, f"{lane}_expert").x)
            if len(r["fixed"]) != n or len(r["shares"]) != n or any(len(s) != points for s in r["shares"]):
                raise ValueError(f"{where}.{lane}: {n} rounds of fixed parts and of shares ({points} points each) "
                                 f"expected, got {len(r['fixed'])} and {[len(s) for s in r['shares']]}")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{where}: must map gpu and cpu to their rounds' shares and fixed parts ({exc!r})") from None
    return n


def rounds_warning(system: str, sim_s: float, totals: list[float], limit: float) -> str | None:
    """A warning when the totals simulated with each round's tables (``totals``) span more than ``limit`` (a
    fraction) of ``sim_s``, the total with the rounds' medians: a verdict within that span may be the calibration's
    and not the model's."""
    lo, hi = min(totals), max(totals)
    if not sim_s > 0 or (hi - lo) / sim_s <= limit:
        return None
    return (f"{system}: the calibration's rounds alone put its simulated total at {lo:.3f}-{hi:.3f} s "
            f"({lo / sim_s - 1:+.0%} to {hi / sim_s - 1:+.0%} of the {sim_s:.3f} s simulated with their medians): its "
            "expert tables and fixed parts per call were not measured steadier than that (docs/validation.md, "
            "\"The calibration's rounds\")")


__all__ = ["round_profiles", "rounds_warning"]
