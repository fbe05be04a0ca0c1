"""Implementation traits: how a system's *code* runs its policies on the machine.

Two systems with the same policies can differ in time because their implementations differ: where
expert copies read from (pinned or pageable host memory), whether a layer's CPU and GPU work run at the
same time, whether shared experts overlap the CPU's routed experts, whether the LM head is computed,
and how much host (framework, launch, Python) time a layer costs. An :class:`Implementation` names
those traits; a system preset names its implementation (``system.implementation``), and
:class:`~dali_sim.hardware.cost.CostModel` combines it with the hardware profile's physical costs.

The traits are data (``implementations.toml``), each with the source it was read from (repository,
file, function), so the comparison is of systems as they really run, not only of their policies.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, Mapping

from dali_sim.registry import UnknownNameError

#: the implementation a measured profile describes: dali's own executor, whose costs calibration measured
EXECUTOR = "dali-executor"
#: a time bound's implementation: the least cost of every implementation the profile can price
ANY = "any"
COPY_FROM = ("pinned", "pageable")
HOST_MODELS = ("none", "measured", "launches")
GPU_KERNELS = ("per-expert", "grouped")
CUDA_GRAPHS = ("none", "full-gpu", "decode")
OVERLAP = ("always", "decode", "never")  # when two things may run at the same time: in every step, decode only, never
LM_HEAD = ("none", "last", "all")
#: when the CPU lane's call pays the profile's lane_wake: never, every call (a worker thread that sleeps
#: between layers), or only beside GPU experts (a layer without them runs the CPU lane inline); a dense part on
#: the CPU is such a call without GPU experts
CPU_LANE_WAKES = ("never", "always", "beside-gpu")
#: when the buffer of a prefetched expert that a layer visit uses is free for the next prefetch: as the visit's
#: plan is made (the controller's accounting: every prefetch starts at its visit's start), or once the runtime is
#: done with it, the visit's prefetches that find no free buffer waiting until then: ``at-use`` a runtime that
#: issues the layer's work and goes on (the cache adopts as the routing is grouped, while the dense part is
#: queued; a declined expert's buffer takes its next copy once the accelerator lane has computed the layer's
#: prefetched experts), ``in-order`` one whose thread does the work in order (adopted after the dense part,
#: declined after the accelerator lane)
PREFETCH_BUFFERS = ("at-plan", "at-use", "in-order")
GPU_CALLS = ("layer", "landed")  # the GPU lane's fixed part: once per layer, or again after each wait for a copy  # logits for no token, every decode token and a prompt's last, or every token
#: kernel counts an implementation declares (``kernels``), each per MoE layer unless said otherwise
KERNEL_KEYS = {
    "dense_gqa": "GPU kernels of the dense part of a layer with GQA/MHA attention (norms, projections, rope, "
                 "KV-cache writes, attention, output projection, residual, router and top-k)",
    "dense_mla": "the same for MLA attention (DeepSeek)",
    "moe": "GPU kernels of a layer's routed experts when they are grouped (one launch sequence for all experts)",
    "expert": "GPU kernels per routed GPU expert when experts are launched one by one",
    "shared": "GPU kernels of a layer's shared experts",
    "block_ffn": "GPU kernels of the FFN of a dense (non-MoE) block, besides its attention",
    "head": "GPU kernels of the final norm and LM head, per step",
    "cpu_moe": "CPU parallel ops (each a thread-pool dispatch and barrier) of a layer's routed experts, grouped",
    "cpu_expert": "CPU parallel ops per routed CPU expert when experts are computed one by one",
    "cpu_dense": "CPU parallel ops of the dense part of a layer (or a dense block, or the LM head) on the CPU",
    "sync_layer": "host-GPU synchronisations per MoE layer (the host waits for the GPU, e.g. to read expert ids)",
    "sync_expert": "host-GPU synchronisations per routed GPU expert (e.g. a .tolist() of its token indices)",
    "sync_all_experts": "host-GPU synchronisations per expert of the model's layer (active or not) in a layer with GPU "
                        "experts (a loop over every expert asking whether it has tokens)",
    "sync_cpu_expert": "host-GPU round trips per routed CPU expert (its tokens and weights read to the host one expert "
                       "at a time), on the CPU lane",
}


@dataclass(frozen=True)
class Implementation:
    """The traits of one implementation (docs/hardware.md, "Implementations")."""

    name: str
    description: str
    copy_from: str = "pinned"  # host memory expert copies read: pinned (DMA at the link's rate) or pageable
    lanes_overlap: str = "always"  # when a layer's CPU lane and GPU lane run at the same time (else one after the other)
    shared_overlap: str = "never"  # when shared experts run on the GPU lane while the CPU lane works (else in the dense part)
    lm_head: str = "none"  # each step ends with the LM head: none | last (a prompt's last token, every decode token) | all
    activation_copies: bool = False  # a lane on another device than the dense part gets its activations over the link
    host: str = "none"  # host time per layer: none | measured (the profile's executor costs) | launches
    gpu_experts: str = "per-expert"  # routed GPU experts: kernels per expert, or one grouped launch per layer
    compute_waits_copies: bool = False  # a layer's GPU experts start only when all its on-demand copies have landed
    gpu_calls: str = "layer"  # the GPU lane's fixed part (lane overhead) once per layer, or per call on what has landed
    evict_writeback: bool = False  # an eviction copies the evicted expert back to the host (one more copy on the link)
    cpu_lane_wakes: str = "never"  # CPU_LANE_WAKES: which CPU-lane calls pay the profile's lane_wake (a sleeping worker)
    #: seconds the CPU lane's worker spins for its next job before it sleeps: a hand-over within that time of its last
    #: job's end finds it awake and pays the profile's lane_wake.*_spinning instead of lane_wake.*; dali's executor:
    #: set from the profile's record (``executor_on``)
    wait_spin_s: float = 0.0
    prefetch_buffers: str = "at-plan"  # PREFETCH_BUFFERS: when a used prefetch's buffer takes the next prefetch
    cuda_graphs: str = "none"  # steps replayed from a captured graph: none | full-gpu (1-token steps, all on GPU) | decode
    host_op_us: float = 0.0  # framework host time per GPU kernel beyond the profile's launch_us (e.g. Python)
    kernels: Mapping[str, int] = field(default_factory=dict)  # kernel counts (KERNEL_KEYS); missing = 0
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f"implementation {self.name!r}"
        for key, allowed in (("copy_from", COPY_FROM), ("host", HOST_MODELS), ("gpu_experts", GPU_KERNELS),
                             ("cuda_graphs", CUDA_GRAPHS), ("lanes_overlap", OVERLAP), ("shared_overlap", OVERLAP),
                             ("lm_head", LM_HEAD), ("gpu_calls", GPU_CALLS),
                             ("cpu_lane_wakes", CPU_LANE_WAKES), ("prefetch_buffers", PREFETCH_BUFFERS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{where}: {key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"{where}: {f.name} must be true or false, got {v!r}")
        for key in ("host_op_us", "wait_spin_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{where}: {key} must be a finite number >= 0, got {v!r}")
        unknown = sorted(set(self.kernels) - set(KERNEL_KEYS))
        if unknown:
            raise ValueError(f"{where}: kernels: unknown key(s) {unknown}; keys: {', '.join(KERNEL_KEYS)}")
        for k, v in self.kernels.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: kernels.{k} must be a non-negative integer, got {v!r}")

    def count(self, key: str) -> int:
        return int(self.kernels.get(key, 0))

    @staticmethod
    def in_step(mode: str, decode: bool) -> bool:
        """Whether an ``OVERLAP`` mode holds in a decode (or prefill) step."""
        return mode == "always" or (mode == "decode" and decode)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sources", "kernels")}
        out["kernels"] = dict(self.kernels)
        out["sources"] = dict(self.sources)
        return out


_TRAITS = {f.name for f in fields(Implementation)} - {"name", "description", "sources"}


def implementation_from_dict(name: str, data: Mapping[str, Any], source: str = "implementations.toml") -> Implementation:
    """Build and check one implementation from its TOML table; every trait needs a ``<trait>_source``."""
    data = dict(data)
    sources = {}
    values = {}
    for key in list(data):
        if key.endswith("_source"):
            trait = key[: -len("_source")]
            if trait not in _TRAITS:
                raise ValueError(f"{source}: [{name}] {key}: no trait {trait!r}")
            sources[trait] = str(data.pop(key))
    description = data.pop("description", None)
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"{source}: [{name}] description: missing")
    unknown = sorted(set(data) - _TRAITS)
    if unknown:
        raise ValueError(f"{source}: [{name}]: unknown trait(s) {unknown}; traits: {sorted(_TRAITS)}")
    for key, value in data.items():
        if key not in sources:
            raise ValueError(f"{source}: [{name}] {key}_source: missing (every trait names where it was read)")
        values[key] = value
    return Implementation(name=name, description=description, sources=sources, **values)


@functools.lru_cache(maxsize=1)
def _implementations() -> dict[str, Implementation]:
    text = resources.files("dali_sim.hardware").joinpath("implementations.toml").read_text(encoding="utf-8")
    return {name: implementation_from_dict(name, table) for name, table in tomllib.loads(text).items()}


def implementation_names() -> list[str]:
    return sorted(_implementations())


def get_implementation(name: str | Implementation) -> Implementation:
    if isinstance(name, Implementation):
        return name
    impls = _implementations()
    if name not in impls:
        raise UnknownNameError(f"unknown implementation {name!r}; known: {', '.join(sorted(impls))}")
    return impls[name]


__all__ = ["ANY", "COPY_FROM", "CPU_LANE_WAKES", "CUDA_GRAPHS", "EXECUTOR", "GPU_CALLS", "GPU_KERNELS", "HOST_MODELS", "KERNEL_KEYS", "LM_HEAD", "OVERLAP", "PREFETCH_BUFFERS", "Implementation", "get_implementation",
           "implementation_from_dict", "implementation_names"]
