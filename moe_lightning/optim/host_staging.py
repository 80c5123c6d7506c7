"""Newton–Schulz of host-resident matrices (FSDP2 ``cpu_offload``) on the compute device, pipelined.

Serial blocking copies leave the GPU idle while each matrix crosses the bus. ``HostStagedNS`` instead stages
every input in a pinned host buffer, issues its host→device copy on a side stream one matrix ahead (so it
overlaps the Newton–Schulz of the previous matrix on the compute stream), copies each result back into a pinned
buffer on the side stream, and waits once at the end. The staging buffers are kept across steps, keyed by shape,
dtype and occurrence within a step (two matrices in flight never share one).

The schedule is device-agnostic: on a CPU-only run ``_HostStreams`` stands in for the streams (nothing to wait
for) and buffers are plain host memory, so the same code path runs, and is tested, without CUDA.
"""

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch


class _HostStreams:
    """Streams and events where there are none: every operation is already ordered on the host."""

    pin = False
    compute = copy = None

    def side(self):
        return nullcontext()

    def record(self):
        return None

    def wait(self, event) -> None:
        pass

    def keep_for(self, tensor: torch.Tensor, stream) -> None:
        pass

    def synchronize(self, event) -> None:
        pass


class _CudaStreams:
    """One side stream for copies on ``device``; the compute stream is whichever is current outside ``side()``."""

    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self.copy = torch.cuda.Stream(device)

    @property
    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side(self):
        return torch.cuda.stream(self.copy)

    def record(self) -> torch.cuda.Event:
        """An event on the stream now current (the side stream inside ``side()``, else the compute stream)."""
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the current stream wait for ``event`` (device-side; the host does not block)."""
        torch.cuda.current_stream().wait_event(event)

    def keep_for(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """``tensor`` was allocated on one stream and is used on ``stream``: the caching allocator must not hand
        its memory out again until ``stream``'s work queued so far is done."""
        tensor.record_stream(stream)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class HostStagedNS:
    """Runs ``ns`` on ``device`` for a list of host matrices; results come back in reused host buffers.

    ``trace``: a list that receives ``(operation, index)`` in the order operations are issued (tests read it).
    """

    def __init__(self, device: torch.device, trace: list | None = None):
        self.device = device
        self.streams = _CudaStreams(device) if device.type == "cuda" else _HostStreams()
        self.trace = trace
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, role: str, shape: torch.Size, dtype: torch.dtype, nth: int) -> torch.Tensor:
        key = (role, tuple(shape), dtype, nth)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.streams.pin)
        return self._buffers[key]

    def _log(self, operation: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((operation, i))

    def run(self, matrices: Sequence[torch.Tensor], ns: Sequence[Callable[[torch.Tensor], torch.Tensor]]
            ) -> list[torch.Tensor]:
        """``ns[i](matrix on device)`` for each host matrix. The returned host tensors are this object's
        buffers: use them before the next ``run``."""
        streams = self.streams
        seen: dict[tuple, int] = {}
        nth = []
        for G in matrices:
            key = (tuple(G.shape), G.dtype)
            nth.append(seen.get(key, 0))
            seen[key] = nth[-1] + 1
        arrived: list = [None] * len(matrices)  # (device tensor, event after its copy)

        def copy_in(i: int) -> None:
            staged = self._buffer("in", matrices[i].shape, matrices[i].dtype, nth[i]).copy_(matrices[i])
            with streams.side():
                on_device = staged.to(self.device, non_blocking=True)
                arrived[i] = (on_device, streams.record())
            streams.keep_for(on_device, streams.compute)
            self._log("copy_in", i)

        results = []
        done = None
        if matrices:
            copy_in(0)
        for i in range(len(matrices)):
            if i + 1 < len(matrices):
                copy_in(i + 1)  # crosses the bus while matrix i is orthogonalized
            G_device, event = arrived[i]
            arrived[i] = None
            streams.wait(event)
            O = ns[i](G_device)
            self._log("ns", i)
            ns_done = streams.record()
            streams.keep_for(O, streams.copy)
            with streams.side():
                streams.wait(ns_done)
                out = self._buffer("out", O.shape, O.dtype, nth[i])
                out.copy_(O, non_blocking=True)
                done = streams.record()
            self._log("copy_out", i)
            results.append(out)
        if done is not None:
            streams.synchronize(done)  # the side stream is in order: its last event covers every copy back
        self._log("synchronize", len(matrices))
        return results
