"""Corruption is detected: every single-byte change of a trace or a next-use file is refused, or reads
back exactly what was written (a byte no reader uses, e.g. a statistic); old files without checksums read."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO
from dali_sim.cli.main import cli
from dali_sim.trace import read_meta, read_trace
from dali_sim.trace.checksum import CHECKSUM_KEY
from dali_sim.trace.synth import SynthConfig, synthesize

sys.path.insert(0, str(REPO / "benchmarks"))
import corruption  # noqa: E402  (the flip experiment, shared with the benchmark)

SHIPPED = sorted((REPO / "traces").glob("*.parquet"))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("flip") / "synth.parquet"
    synthesize(SynthConfig("mixtral-8x7b", sequences=2, prompt_len=16, gen_len=16, seed=1,
                           lookahead=("next-gate=0.8",)), path, progress=False)
    return path


def _no_silent_change(counts: dict, flips: int) -> None:
    assert counts["silently_different"] == 0 and counts["crashed"] == 0, counts
    assert counts["rejected"] + counts["identical"] == flips
    assert counts["rejected"] >= 0.9 * flips, counts  # nearly every byte matters


def test_byte_flips_in_a_synthetic_trace_are_rejected_or_harmless(synthetic):
    _no_silent_change(corruption.run(synthetic, 150, 0, corruption.trace_content), 150)


def test_byte_flips_in_the_shipped_gpt_oss_trace_are_rejected_or_harmless():
    path = REPO / "traces" / "gpt-oss-20b.parquet"
    _no_silent_change(corruption.run(path, 60, 0, corruption.trace_content), 60)


def test_byte_flips_in_a_next_use_file_are_rejected_or_harmless(synthetic, tmp_path):
    from dali_sim.runtime.future import write_future
    from dali_sim.workload.builder import WorkloadConfig

    future = write_future(read_trace(synthetic), WorkloadConfig(2), tmp_path / "f.parquet", share=0.0)
    counts = corruption.run(future, 100, 0, lambda p: corruption.future_content(p, synthetic, 2))
    assert counts["silently_different"] == 0 and counts["crashed"] == 0, counts


@pytest.mark.slow
def test_byte_flips_at_the_issue_counts():  # 300 flips of a synthetic trace, 200 of the GPT-OSS trace
    with_checks = []
    for path, flips in ((None, 300), (REPO / "traces" / "gpt-oss-20b.parquet", 200)):
        if path is None:
            path = Path(pytest.importorskip("tempfile").mkdtemp()) / "s.parquet"
            synthesize(SynthConfig("mixtral-8x7b", sequences=2, prompt_len=16, gen_len=16, seed=1,
                                   lookahead=("next-gate=0.8",)), path, progress=False)
        counts = corruption.run(path, flips, 1, corruption.trace_content)
        with_checks.append(counts)
        _no_silent_change(counts, flips)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_trace_carries_checksums(path):
    from dali_sim.trace.reader import _read_footer

    assert CHECKSUM_KEY.encode() in _read_footer(path)


def test_trace_without_checksum_still_reads_and_validate_says_so(synthetic, tmp_path):
    import pyarrow.parquet as pq

    old = tmp_path / "old.parquet"
    table = pq.read_table(synthetic)  # as an older dali wrote it: the same file without the checksum record
    footer = {k: v for k, v in pq.read_metadata(synthetic).metadata.items() if k != CHECKSUM_KEY.encode()}
    pq.write_table(table.replace_schema_metadata(footer), old)
    t = read_trace(old)
    assert t.checksum is None and len(t) == len(read_trace(synthetic))
    r = CliRunner().invoke(cli, ["trace", "validate", str(old)])
    assert r.exit_code == 0 and "no checksum" in r.output
    r = CliRunner().invoke(cli, ["trace", "validate", str(synthetic)])
    assert r.exit_code == 0 and "checksums verified" in r.output


def test_changed_metadata_is_refused_by_info(synthetic, tmp_path):
    data = bytearray(synthetic.read_bytes())
    i = data.find(b'"weights_note"')
    data[i + 20] ^= 0x01  # one letter of the note, inside the footer's JSON
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="metadata does not match the checksum"):
        read_meta(bad)
    r = CliRunner().invoke(cli, ["trace", "info", str(bad)])
    assert r.exit_code == 1 and "bad.parquet" in r.output


def test_changed_hidden_state_sidecar_is_refused(tmp_path):
    src = REPO / "traces" / "dali-tiny-moe-hidden.parquet"
    for name in (src.name, "dali-tiny-moe-hidden.hidden.parquet"):
        shutil.copy(src.with_name(name), tmp_path / name)
    side = tmp_path / "dali-tiny-moe-hidden.hidden.parquet"
    t = read_trace(tmp_path / src.name)
    keys, hidden = t.hidden_states()  # intact: reads
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(side)
    footer = pq.read_metadata(side).metadata
    col = table.column("hidden").combine_chunks()
    values = col.flatten().to_numpy(zero_copy_only=False).copy()
    values[7] += 1  # one value changed, the file rewritten with the original footer
    changed = table.set_column(3, "hidden", pa.FixedSizeListArray.from_arrays(pa.array(values), col.type.list_size))
    pq.write_table(changed.replace_schema_metadata(footer), side)
    with pytest.raises(ValueError, match="column 'hidden' does not match the checksum"):
        read_trace(tmp_path / src.name).hidden_states()
