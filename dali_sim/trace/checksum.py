"""Content checksums in the footer of dali's Parquet files (traces, hidden-state and next-use sidecars).

Parquet's own page checksums (CRC-32, written and verified too) cover compressed page bodies only, not
page headers, the footer or dali's metadata. So the writer also stores, under the footer key
``dali.checksum``, a JSON record: the SHA-256 of the metadata value it protects and, per column, the
SHA-256 of the column's values exactly as the reader returns them (fixed dtype, C order, null rows of
float columns as NaN), fed block by block in file order. A reader recomputes both and refuses any
difference, so a changed byte anywhere is either refused or has changed nothing that is read.

Files written before checksums have no record: they still read, and ``dali trace validate`` says so.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Mapping

import numpy as np

from dali_sim.trace.schema import TraceError

CHECKSUM_KEY = "dali.checksum"
ALGORITHM = "sha256"


class ContentHasher:
    """SHA-256 per column, updated with each block of values in file order."""

    def __init__(self, columns: Iterable[str]):
        self._columns = {name: hashlib.sha256() for name in columns}

    def update(self, name: str, values: np.ndarray) -> None:
        self._columns[name].update(np.ascontiguousarray(values).data)

    def digests(self) -> dict[str, str]:
        return {name: h.hexdigest() for name, h in sorted(self._columns.items())}


def digest(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).data).hexdigest()


def nan_null_rows(values: np.ndarray) -> np.ndarray:
    """Float rows that are entirely NaN (stored as nulls) as the reader returns them: the canonical NaN."""
    null = np.isnan(values).all(axis=1)
    if not null.any():
        return values
    out = values.copy()
    out[null] = np.nan
    return out


def checksum_record(meta: str | bytes, columns: Mapping[str, str]) -> str:
    """The footer value: the SHA-256 of the metadata value ``meta`` and of every column."""
    raw = meta.encode() if isinstance(meta, str) else meta
    return json.dumps({"algorithm": ALGORITHM, "metadata": hashlib.sha256(raw).hexdigest(),
                       "columns": dict(sorted(columns.items()))}, sort_keys=True)


def read_record(footer: Mapping[bytes, bytes] | None, meta: bytes, where: str) -> dict | None:
    """The checksum record of a footer (None: written before checksums), after checking that the metadata
    value ``meta`` still has the SHA-256 recorded for it."""
    raw = (footer or {}).get(CHECKSUM_KEY.encode())
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        ok = (isinstance(record, dict) and record.get("algorithm") == ALGORITHM
              and isinstance(record.get("metadata"), str) and isinstance(record.get("columns"), dict)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in record["columns"].items()))
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise TraceError(f"{where}: the '{CHECKSUM_KEY}' record in the footer is damaged")
    if hashlib.sha256(meta).hexdigest() != record["metadata"]:
        raise TraceError(f"{where}: the metadata does not match the checksum written with it: the file was "
                         "changed or damaged after it was written")
    return record


def verify_digests(record: dict, digests: Mapping[str, str], where: str) -> None:
    """Some columns' SHA-256 (computed by the caller, e.g. while streaming) against the record."""
    for name in sorted(digests):
        if record["columns"].get(name) != digests[name]:
            raise TraceError(f"{where}: column {name!r} does not match the checksum written with it: the file "
                             "was changed or damaged after it was written")


def verify_columns(record: dict, arrays: Mapping[str, np.ndarray], where: str) -> None:
    """Every column of ``record`` is in ``arrays`` and has the recorded SHA-256 (and no other column is)."""
    expected = record["columns"]
    if set(expected) != set(arrays):
        raise TraceError(f"{where}: columns {sorted(arrays)} do not match the checksummed columns "
                         f"{sorted(expected)}: the file was changed or damaged after it was written")
    verify_digests(record, {name: digest(arrays[name]) for name in expected}, where)


__all__ = ["ALGORITHM", "CHECKSUM_KEY", "ContentHasher", "checksum_record", "digest", "nan_null_rows",
           "read_record", "verify_columns", "verify_digests"]
