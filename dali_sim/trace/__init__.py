"""The routing trace: format, writer, reader, importers, generator and statistics."""

from dali_sim.trace.reader import Trace, read_meta, read_trace
from dali_sim.trace.schema import (
    PHASES,
    SCHEMA_VERSION,
    HiddenStatesInfo,
    PredictorInfo,
    SequenceInfo,
    TraceError,
    TraceMeta,
)
from dali_sim.trace.writer import TraceWriter

__all__ = [
    "PHASES", "SCHEMA_VERSION", "HiddenStatesInfo", "PredictorInfo", "SequenceInfo", "Trace", "TraceError",
    "TraceMeta", "TraceWriter", "read_meta", "read_trace",
]
