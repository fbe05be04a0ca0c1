"""The routing recorder: forward hooks on the routers of a transformers MoE model during greedy
generation, written as a dali trace (docs/recorder.md); and DALI's residual-vector calibration.

>>> result = record_trace(model, read_prompts("prompts.jsonl"), "out.parquet", tokenizer=tok,
...                       options=RecordOptions(batch_size=4, max_new_tokens=32))
"""

from dali_exec.recorder.generation import BatchResult, ForwardRows, greedy_generate
from dali_exec.recorder.hooks import GateInputHooks, RoutingCapture, StepRouting
from dali_exec.recorder.loading import load_model
from dali_exec.recorder.prompts import Prompt, read_prompts, tokenize
from dali_exec.recorder.record import RecordOptions, RecordResult, record_trace
from dali_exec.recorder.residual import ResidualVectors, calibrate_residuals, config_sha256

__all__ = [
    "BatchResult", "ForwardRows", "GateInputHooks", "Prompt", "RecordOptions", "RecordResult", "ResidualVectors",
    "RoutingCapture", "StepRouting", "calibrate_residuals", "config_sha256", "greedy_generate", "load_model",
    "read_prompts", "record_trace", "tokenize",
]
