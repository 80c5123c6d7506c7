"""The CUDA calls the GPU parts make, behind one small interface with a host stand-in, so a dry run on CPU walks
the same code (and a test can stub the device: ``tests/benchmarks/test_gpu_recipe.py``)."""

import time

import torch


class HostEvent:
    """``torch.cuda.Event``'s timing interface on the host clock."""

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return 1e3 * (end.t - self.t)

    def synchronize(self):
        pass


class Device:
    """A CUDA device's timing events, synchronisation and allocator statistics; on CPU the host clock and no
    allocator (empty statistics and snapshots)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def event(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else HostEvent()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def memory_stats(self) -> dict:
        return torch.cuda.memory_stats(self.device) if self.cuda else {}

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def memory_snapshot(self) -> list[dict]:
        return torch.cuda.memory_snapshot() if self.cuda else []

    def compute_stream_id(self) -> int | None:
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def mem_get_info(self) -> tuple[int, int] | None:
        """Free and total bytes of the device (``None`` on the host)."""
        return torch.cuda.mem_get_info(self.device) if self.cuda else None


def gemm_ceiling(device: Device, n: int = 8192, runs: int = 20) -> float:
    """FLOP/s of a square bf16 matmul (fp32 on the host: bf16 there may be emulated), after 3 warm-up calls: the
    attainable ceiling MFU is also reported against."""
    dtype = torch.bfloat16 if device.cuda else torch.float32
    a, b = (torch.randn(n, n, device=device.device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = device.event(), device.event()
    start.record()
    for _ in range(runs):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * runs / (start.elapsed_time(end) / 1e3)
