"""The offloading executor: performs the simulator's plans on real devices (docs/executor.md).

``execute(trace, system, ReplayOptions(...), ExecOptions(...))`` replays a trace with random weights
and returns a :class:`dali_sim.sim.simulate.SimResult`; :class:`OffloadRuntime` is the layer-execution
API underneath (slots, copy lane, CPU lane) for other drivers such as a real model.
"""

from dali_exec.executor.devices import Devices
from dali_exec.executor.problem import ReplayOptions, ReplaySetup, prepare_replay, scale_model
from dali_exec.executor.reference import reference_moe
from dali_exec.executor.replay import ExecOptions, LayerRecord, Replay, execute
from dali_exec.executor.routing import LayerRouting
from dali_exec.executor.runtime import OffloadRuntime
from dali_exec.executor.slots import SlotNotReady, SlotPool
from dali_exec.executor.store import HostExpertStore

__all__ = ["Devices", "ExecOptions", "HostExpertStore", "LayerRecord", "LayerRouting", "OffloadRuntime", "Replay",
           "ReplayOptions", "ReplaySetup", "SlotNotReady", "SlotPool", "execute", "prepare_replay", "reference_moe",
           "scale_model"]
