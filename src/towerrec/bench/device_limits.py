"""The physical limits a benchmark's figures are set against, measured on the device it
runs on, in the same run: memory bandwidth (a copy), matrix throughput (a square matmul
per dtype) and the host <-> device link (copies from and to page-locked host memory).

On a GPU every measurement is timed to its end on the device (``synchronize``); on the
CPU the same code measures host memory and the CPU's matmul (``link`` is then a copy
within host memory). Sizes default to what fills an accelerator; tests pass small ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "DeviceLimits",
    "measure_limits",
    "measure_link",
    "synchronize",
    "time_per_call",
]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(
    fn: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 2
) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` calls, each timed to its end on
    ``device``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


@dataclass(frozen=True)
class DeviceLimits:
    """What one device did at its best in this run (module doc); bytes and FLOPs per
    second."""

    device: str
    memory_bytes_per_s: float  # a copy, bytes read plus bytes written
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s of an n x n x n matmul
    h2d_bytes_per_s: float  # host (page-locked) -> device
    d2h_bytes_per_s: float  # device -> host (page-locked)
    copy_bytes: int
    matmul_n: int
    float32_matmul_precision: str  # torch's setting the fp32 figure was taken under

    def matmul_peak(self, dtype: torch.dtype) -> float:
        """FLOP/s at ``dtype`` (fp32 when it was not measured)."""
        return self.matmul_flops.get(_name(dtype), self.matmul_flops["float32"])

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["memory_gb_per_s"] = round(self.memory_bytes_per_s / 1e9, 1)
        out["h2d_gb_per_s"] = round(self.h2d_bytes_per_s / 1e9, 2)
        out["d2h_gb_per_s"] = round(self.d2h_bytes_per_s / 1e9, 2)
        out["matmul_tflops"] = {k: round(v / 1e12, 2) for k, v in self.matmul_flops.items()}
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_limits(
    device: torch.device,
    *,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    repeats: int = 10,
) -> DeviceLimits:
    """Measure ``device``'s limits (module doc). Defaults: 2 GiB copies and n = 8192 on a
    GPU; 16 MiB and n = 256 on the CPU (a CPU without bf16 units takes seconds for a
    larger bf16 matmul)."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if cuda else 16 << 20)
    matmul_n = matmul_n or (8192 if cuda else 256)
    memory, h2d, d2h = _copies(device, copy_bytes, repeats)
    flops = {_name(d): _matmul(device, d, matmul_n, repeats) for d in dtypes}
    if cuda:
        torch.cuda.empty_cache()
    return DeviceLimits(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        memory_bytes_per_s=memory,
        matmul_flops=flops,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        copy_bytes=copy_bytes,
        matmul_n=matmul_n,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    )


def measure_link(
    device: torch.device, nbytes: int | None = None, repeats: int = 10
) -> dict[str, float]:
    """Bytes per second of ``device``'s memory (a copy, read plus written) and of its
    link to the host each way (``measure_limits``' copies alone; 1 GiB on a GPU, 16 MiB
    on the CPU, where the link is a copy within host memory)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 16 << 20)
    memory, h2d, d2h = _copies(device, nbytes, repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"memory_bytes_per_s": memory, "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h}


def _copies(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float, float]:
    """Bytes per second of a copy on ``device`` (read plus written), host -> device and
    device -> host (page-locked host memory on a GPU)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
    copy_s = time_per_call(lambda: dst.copy_(src), device, repeats)
    h2d_s = time_per_call(lambda: dst.copy_(host, non_blocking=True), device, repeats)
    d2h_s = time_per_call(lambda: host.copy_(dst, non_blocking=True), device, repeats)
    return 2 * nbytes / copy_s, nbytes / h2d_s, nbytes / d2h_s


def _matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """FLOP/s of an ``n x n x n`` matmul at ``dtype`` on ``device``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / time_per_call(lambda: torch.mm(a, b), device, repeats)
