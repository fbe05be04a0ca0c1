"""One transfer for a group's index arrays (dali_exec/executor/packed.py): the int64 arrays and the 4-byte ones
(int32 offsets, float32 weights) come back exactly, as views of one buffer; the runtime's CUDA branch slices
them as its callers expect (run here with the transfer on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dali_exec.executor import packed  # noqa: E402
from dali_exec.executor import runtime  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("n4", [0, 1, 2, 5])
def test_every_array_comes_back_exactly_from_one_buffer(n4):
    rng = np.random.default_rng(n4)
    ints = [rng.integers(-2**62, 2**62, 7), np.zeros(0, np.int64), np.arange(3, dtype=np.int64)]
    offs = np.array([0, 2**31 - 1, -2**31, 5, 9][:n4], np.int32)
    w = np.array([np.nan, -0.0, 1e-45, np.inf, 0.3][:n4], np.float32)  # (bit patterns a cast would not keep)
    out64, out4 = packed.to_device(ints, [offs, w], CPU)
    for a, t in zip(ints, out64):
        assert t.dtype == torch.int64 and np.array_equal(t.numpy(), a)
    assert out4[0].dtype == torch.int32 and np.array_equal(out4[0].numpy(), offs)
    assert out4[1].dtype == torch.float32 and out4[1].numpy().view(np.int32).tolist() == w.view(np.int32).tolist()
    base = out64[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out64 + out4)  # views of one buffer: one transfer


def test_other_four_byte_types_are_refused():
    with pytest.raises(TypeError, match="must be int32 or float32, not int16"):
        packed.to_device([], [np.zeros(2, np.int16)], CPU)


@pytest.mark.parametrize("bias", [False, True])
def test_cuda_branches_slice_the_transfer_as_their_callers_expect(bias, monkeypatch):
    sent, to_device = [], packed.to_device

    def on_cpu(int64s, fours, device):  # the CUDA branch's transfer, made on the CPU
        sent.append(device.type)
        return to_device(int64s, fours, CPU)

    monkeypatch.setattr(packed, "to_device", on_cpu)
    cuda = torch.device("cuda")
    pairs, tokens = np.array([4, 1, 6], np.int64), np.array([2, 0, 3], np.int64)
    offs, rows = np.array([1, 3], np.int32), np.array([0, 1, 1], np.int64)
    weights = np.array([0.5, 0.25, 0.125], np.float32)
    pos, tok, o, r, w = runtime._device_indices(pairs, tokens, offs, lambda: rows, weights, cuda, torch.bfloat16, bias)
    assert pos.tolist() == [4, 1, 6] and tok.tolist() == [2, 0, 3] and o.dtype == torch.int32 and o.tolist() == [1, 3]
    assert (r.tolist() == [0, 1, 1]) if bias else r is None
    assert w.shape == (3, 1) and w.dtype == torch.bfloat16 and w[:, 0].float().tolist() == [0.5, 0.25, 0.125]
    rt = runtime.OffloadRuntime.__new__(runtime.OffloadRuntime)
    rt.dev = type("Dev", (), {"is_cuda": True, "accel": cuda, "dtype": torch.float32})()
    pos, tok, w = rt._pairs_on_accel(pairs, tokens, weights)
    assert pos.tolist() == [4, 1, 6] and tok.tolist() == [2, 0, 3]
    assert w.shape == (3, 1) and w[:, 0].tolist() == [0.5, 0.25, 0.125]
    assert sent == ["cuda", "cuda"]
