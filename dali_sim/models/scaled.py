"""Scaled model shapes: ``mixtral-8x7b-x0.125`` is Mixtral-8x7B with hidden, intermediate and head sizes
times 1/8, ``...-4L`` its first 4 MoE layers. The executor replays and calibrates such shapes
(``dali exec run/calibrate --scale``); the same names resolve here, without torch, so that
``dali trace synth --model mixtral-8x7b-x0.125`` writes a trace a calibrated profile fits.
"""

from __future__ import annotations

import dataclasses
import re

from dali_sim.models.spec import ModelSpec, Precision

_SCALED = re.compile(r"^(?P<base>.+?)(?:-x(?P<scale>[0-9]*\.?[0-9]+(?:e-?[0-9]+)?))?(?:-(?P<layers>[0-9]+)L)?$")


def _scaled(value: int, scale: float) -> int:
    return max(1, int(round(value * scale))) if value else 0


def scale_model(spec: ModelSpec, scale: float = 1.0, layers: int | None = None,
                precision: Precision | str | None = None) -> ModelSpec:
    """``spec`` with hidden, intermediate and attention head sizes times ``scale`` (head counts, experts,
    top-k and vocabulary kept), cut to its first ``layers`` MoE layers (and the dense blocks before
    them), at ``precision``. The identity for ``scale=1, layers=None, precision=None``; the name gets
    ``-x<scale>`` and ``-<layers>L`` (what :func:`parse_scaled_name` reads back)."""
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must lie in (0, 1], got {scale}")
    n = spec.num_moe_layers if layers is None else layers
    if not 1 <= n <= spec.num_moe_layers:
        raise ValueError(f"layers must lie in 1..{spec.num_moe_layers} (the MoE layers of {spec.name}), got {layers}")
    if isinstance(precision, str):
        from dali_sim.models.presets import get_precision

        precision = get_precision(precision)
    moe_layers = spec.moe_layers[:n]
    a = spec.attention
    attention = dataclasses.replace(
        a, head_dim=_scaled(a.head_dim, scale), q_lora_rank=_scaled(a.q_lora_rank, scale),
        kv_lora_rank=_scaled(a.kv_lora_rank, scale), qk_nope_head_dim=_scaled(a.qk_nope_head_dim, scale),
        qk_rope_head_dim=_scaled(a.qk_rope_head_dim, scale), v_head_dim=_scaled(a.v_head_dim, scale))
    name = spec.name
    if scale != 1.0:
        name += f"-x{scale:g}"
    if n != spec.num_moe_layers:
        name += f"-{n}L"
    return dataclasses.replace(
        spec, name=name, num_layers=moe_layers[-1] + 1, moe_layers=moe_layers,
        hidden_size=_scaled(spec.hidden_size, scale),
        expert_intermediate_size=_scaled(spec.expert_intermediate_size, scale),
        shared_expert_intermediate_size=_scaled(spec.shared_expert_intermediate_size, scale),
        dense_intermediate_size=_scaled(spec.dense_intermediate_size, scale),
        attention=attention,
        precision=precision or spec.precision,
        dense_precision=None if precision else spec.dense_precision,  # a replay's dtype is every weight's
    )


def parse_scaled_name(name: str) -> tuple[str, float, int | None] | None:
    """``"mixtral-8x7b-x0.125-4L"`` -> ``("mixtral-8x7b", 0.125, 4)``; None for a name without a suffix."""
    m = _SCALED.match(name)
    if m is None or (m["scale"] is None and m["layers"] is None):
        return None
    return m["base"], float(m["scale"]) if m["scale"] is not None else 1.0, \
        int(m["layers"]) if m["layers"] is not None else None


__all__ = ["parse_scaled_name", "scale_model"]
