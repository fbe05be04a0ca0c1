"""Offloading policies (placement, prefetch, cache), their registries and the system presets.

Importing this package registers every built-in policy.
"""

from dali_sim.policies import (  # noqa: F401  (registration)
    cache,
    cache_belady,
    cache_dali,
    cache_link,
    cache_optimal,
    hybrimoe,
    placement,
    placement_competitors,
    placement_dali,
    placement_optimal,
    prefetch,
    prefetch_competitors,
    prefetch_gated,
    prefetch_lookahead,
)
from dali_sim.policies.base import (
    CACHES,
    PLACEMENTS,
    PREFETCHERS,
    CachePolicy,
    LayerView,
    PlacementPolicy,
    PolicyConfig,
    PrefetchPolicy,
    SetupContext,
)
from dali_sim.policies.systems import SystemConfig, parse_overrides, resolve_system, system_names

__all__ = [
    "CACHES", "PLACEMENTS", "PREFETCHERS", "CachePolicy", "LayerView", "PlacementPolicy", "PolicyConfig",
    "PrefetchPolicy", "SetupContext", "SystemConfig", "parse_overrides", "resolve_system", "system_names",
]
