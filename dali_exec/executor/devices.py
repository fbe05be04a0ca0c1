"""The two devices of a run: the accelerator (CUDA, or the CPU device when there is no CUDA) and the host.

On CUDA the accelerator lane computes on the current stream and copies run on a separate copy stream
from pinned host memory; without CUDA the accelerator *is* the CPU device, copies are host copies, and
every code path is the same (only real overlap of copy, GPU and CPU work is missing).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from dali_exec.executor.problem import DTYPE_PRECISION

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert set(TORCH_DTYPES) == set(DTYPE_PRECISION)


def cpu_name() -> str:
    """The host CPU's model name (from /proc/cpuinfo where there is one)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_memory_bytes(available: bool = False) -> int:
    """Physical (or currently available) host memory."""
    pages = os.sysconf("SC_AVPHYS_PAGES" if available else "SC_PHYS_PAGES")
    return int(pages * os.sysconf("SC_PAGE_SIZE"))


def to_device_async(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor on ``device`` (and ``dtype``): on CUDA queued from pinned memory, without a wait. From pageable
    memory torch makes the host wait until the stream has drained (its sync debug mode names the call:
    ``benchmarks/exec_overhead.py --sync-sites``), so the host stops issuing work while the GPU empties its queue."""
    if device.type == "cuda":
        return t.pin_memory().to(device, dtype, non_blocking=True)
    return t.to(device, dtype)


def resolve_device(device: str | None) -> torch.device:
    """``cuda`` / ``cpu`` / ``cuda:N``; None = CUDA if present, else the CPU device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    if d.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {device!r}")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def lane_threads(is_cuda: bool, cpu_threads: int | None, accel_threads: int | None) -> tuple[int, int | None]:
    """Threads of the CPU lane and (on the CPU device) of the accelerator lane. Defaults: with CUDA all
    cores but two for the CPU lane, one left to the main thread (it issues the accelerator's work) and one
    to the copy thread (its waits for copies spin, as CUDA's waits do by default with one context per
    core); with only one left, the three would keep a core more busy than there are, and a parallel region
    of the CPU lane waits for whichever of its threads is preempted. Without CUDA half the cores each (the
    two lanes share the CPU)."""
    cores = os.cpu_count() or 1
    for name, v in (("cpu_threads", cpu_threads), ("accel_threads", accel_threads)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if is_cuda:
        return cpu_threads or max(1, cores - 2), None
    cpu = cpu_threads or max(1, cores // 2)
    return cpu, accel_threads or max(1, cores - cpu)


@dataclass
class Devices:
    """The accelerator, the host, the weight dtype and (on CUDA) the copy stream."""

    accel: torch.device
    dtype: torch.dtype
    dtype_name: str

    def __post_init__(self) -> None:
        self.host = torch.device("cpu")
        self.is_cuda = self.accel.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.accel) if self.is_cuda else None

    @classmethod
    def create(cls, device: str | None = None, dtype: str = "bf16") -> "Devices":
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
        return cls(resolve_device(device), TORCH_DTYPES[dtype], dtype)

    def of(self, lane: str) -> torch.device:
        """``gpu`` -> the accelerator, ``cpu`` -> the host."""
        if lane not in ("gpu", "cpu"):
            raise ValueError(f"device lane must be gpu or cpu, got {lane!r}")
        return self.accel if lane == "gpu" else self.host

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.accel)

    def accel_name(self) -> str:
        if self.is_cuda:
            return torch.cuda.get_device_name(self.accel)
        return f"CPU device (no CUDA): {cpu_name()}"

    def accel_memory_bytes(self) -> int:
        if self.is_cuda:
            return int(torch.cuda.get_device_properties(self.accel).total_memory)
        return host_memory_bytes()

    def accel_free_bytes(self) -> int:
        """Bytes an allocation can still get: on CUDA the device's free memory plus what torch's caching allocator
        holds unused (``mem_get_info`` counts that as taken; a replay's freed slots go there)."""
        if self.is_cuda:
            cached = torch.cuda.memory_reserved(self.accel) - torch.cuda.memory_allocated(self.accel)
            return int(torch.cuda.mem_get_info(self.accel)[0]) + int(cached)
        return host_memory_bytes(available=True)

    def describe(self) -> dict:
        return {"accelerator": str(self.accel), "accelerator_name": self.accel_name(), "host": cpu_name(),
                "dtype": self.dtype_name, "torch": torch.__version__,
                "cuda": torch.version.cuda if self.is_cuda else None}
