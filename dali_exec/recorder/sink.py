"""Forward-pass captures -> trace rows, buffered so the writer sees few large blocks.

Memory stays bounded: rows are handed to the :class:`~dali_sim.trace.writer.TraceWriter` (which
writes row groups as they fill) every ``flush_rows`` rows, hidden states every ``hidden_flush_rows``.
Call :meth:`RowSink.flush` before closing or aborting the writer so that every completed forward
pass is in the file, interrupted runs included.
"""

from __future__ import annotations

import numpy as np

from dali_exec.recorder.hooks import StepRouting
from dali_sim.trace import TraceWriter


class RowSink:
    def __init__(self, writer: TraceWriter, layers: tuple[int, ...], *, flush_rows: int = 65536,
                 hidden_flush_rows: int | None = None):
        self.writer = writer
        self.layers = np.asarray(layers, dtype=np.int64)
        self.flush_rows = flush_rows
        dim = writer.meta.hidden_states.dim if writer.meta.hidden_states else 1
        # about 32 MB of float16 per sidecar row group
        self.hidden_flush_rows = hidden_flush_rows or max(1024, (32 << 20) // (2 * dim))
        self._rows: list[dict] = []
        self._hidden: list[tuple] = []
        self._buffered = self._hidden_buffered = 0

    def add(self, step: StepRouting, seq_id: np.ndarray, pos: np.ndarray, phase: str) -> None:
        """Rows of one forward pass: ``seq_id`` and ``pos`` per recorded token (N,)."""
        num_layers, n, _ = step.ids.shape
        if n == 0:
            return
        seq = np.tile(seq_id, num_layers)
        positions = np.tile(pos, num_layers)
        layer = np.repeat(self.layers, n)
        flat = lambda a: a.reshape(num_layers * n, a.shape[-1])  # noqa: E731
        block = {
            "seq_id": seq, "pos": positions, "layer": layer, "phase": phase,
            "experts": flat(step.ids), "weights": flat(step.weights),
            "router_logits": flat(step.router_logits) if step.router_logits is not None else None,
            "lookahead": {name: flat(v) for name, v in step.lookahead.items()},
        }
        self._rows.append(block)
        self._buffered += num_layers * n
        if step.hidden is not None:
            self._hidden.append((seq, positions, layer, flat(step.hidden)))
            self._hidden_buffered += num_layers * n
        if self._buffered >= self.flush_rows:
            self._flush_rows()
        if self._hidden_buffered >= self.hidden_flush_rows:
            self._flush_hidden()

    def _flush_rows(self) -> None:
        if not self._rows:
            return
        blocks, self._rows, self._buffered = self._rows, [], 0
        cat = lambda key: np.concatenate([b[key] for b in blocks])  # noqa: E731
        phases = np.concatenate([np.full(len(b["seq_id"]), b["phase"] == "decode", dtype=np.int8) for b in blocks])
        self.writer.write(
            seq_id=cat("seq_id"), phase=phases, pos=cat("pos"), layer=cat("layer"),
            experts=cat("experts"), weights=cat("weights"),
            router_logits=cat("router_logits") if blocks[0]["router_logits"] is not None else None,
            lookahead={name: np.concatenate([b["lookahead"][name] for b in blocks]) for name in blocks[0]["lookahead"]},
        )

    def _flush_hidden(self) -> None:
        if not self._hidden:
            return
        parts, self._hidden, self._hidden_buffered = self._hidden, [], 0
        seq, pos, layer, hidden = (np.concatenate(col) for col in zip(*parts))
        self.writer.write_hidden(seq_id=seq, pos=pos, layer=layer, hidden=hidden)

    def flush(self) -> None:
        self._flush_rows()
        self._flush_hidden()
