"""Sweeps: a TOML spec of traces x hardware x grid x systems, run in parallel into a resumable result
store, and reports on it (docs/sweeps.md). Names are imported on first use."""

from dali_sim.lazy import lazy_exports

_EXPORTS = {
    "RunConfig": "dali_sim.sweep.spec", "SpecError": "dali_sim.sweep.spec", "SweepError": "dali_sim.sweep.spec",
    "load_spec": "dali_sim.sweep.spec", "plan_runs": "dali_sim.sweep.spec",
    "ResultStore": "dali_sim.sweep.store", "read_results": "dali_sim.sweep.store",
    "LocalEngine": "dali_sim.sweep.engines", "RayEngine": "dali_sim.sweep.engines",
    "SerialEngine": "dali_sim.sweep.engines", "make_engine": "dali_sim.sweep.engines",
    "run_sweep": "dali_sim.sweep.run", "write_report": "dali_sim.sweep.report",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
