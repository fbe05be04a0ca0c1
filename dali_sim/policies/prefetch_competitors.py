"""Prefetchers of competing systems (sources and readings in docs/policies.md).

* ``next-layer-all`` (MoE-Lightning, Cao et al., ASPLOS 2025): the expert FFN weights of a layer are
  streamed to the GPU over PCIe while the previous layer computes (CGOPipe, a CPU-GPU-I/O pipeline with
  paged weights): at each layer, request every expert of the next layer, whether it will be activated or
  not (ids in ascending order). Use with ``gpu-only`` placement, ``memory.prefetch_slots`` = the number
  of experts and ``system.dense_device=cpu`` (attention on the CPU). MoE-Lightning's policy search (its
  Hierarchical Roofline Model) also keeps a share ``wg`` of the weights resident on the GPU (the
  artifact's printed policies: ``wg`` = 0.06 on an L4); with a ``static`` cache and cache slots the
  resident experts are skipped by the runtime. The first layer of a step cannot be prefetched (targets
  must be later layers of the same step): its experts are copied on demand.
"""

from __future__ import annotations

from dali_sim.policies.base import PREFETCHERS, LayerView, PrefetchPolicy, registered


@registered(PREFETCHERS)
class NextLayerAll(PrefetchPolicy):
    name = "next-layer-all"
    description = "MoE-Lightning's weight streaming: prefetch every expert of the next layer (the whole layer's weights)"

    def prefetch(self, view: LayerView) -> list[tuple[int, int]]:
        target = view.layer + 1
        if target >= view.num_layers:
            return []
        return [(target, e) for e in range(view.num_experts)]
