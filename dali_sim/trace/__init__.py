"""The routing trace: format, writer, reader, importers, generator and statistics.

The names below are imported on first use (:mod:`dali_sim.lazy`): importing the package stays cheap.
"""

from dali_sim.lazy import lazy_exports

_EXPORTS = {
    "Trace": "dali_sim.trace.reader", "read_meta": "dali_sim.trace.reader", "read_trace": "dali_sim.trace.reader",
    "PHASES": "dali_sim.trace.schema", "SCHEMA_VERSION": "dali_sim.trace.schema",
    "HiddenStatesInfo": "dali_sim.trace.schema", "PredictorInfo": "dali_sim.trace.schema",
    "SequenceInfo": "dali_sim.trace.schema", "TraceError": "dali_sim.trace.schema",
    "TraceMeta": "dali_sim.trace.schema",
    "TraceWriter": "dali_sim.trace.writer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
