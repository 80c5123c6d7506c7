"""Newton–Schulz of host-resident matrices (FSDP2 ``cpu_offload``) on the GPU, pipelined.

Used only where the matrices and Newton–Schulz live on different devices: a CPU-only run orthogonalizes where
the state is, with no copies. Serial blocking copies leave the GPU idle while each matrix crosses the bus;
``HostStagedNS`` instead, per matrix i:
- lets the host write the input (Muon's momentum update) straight into a pinned buffer, *after* matrix i-1's
  Newton–Schulz is enqueued, so the host work and the pageable-to-pinned traffic overlap device work;
- copies it in on a host-to-device stream; Newton–Schulz waits for it on the compute stream;
- copies the result back into a pinned buffer on a device-to-host stream once Newton–Schulz is done.
Each direction has its own stream, so a copy in never queues behind a copy back. The host waits once, at the
end. Buffers are kept across steps, keyed by shape, dtype and occurrence within a step (two matrices in flight
never share one).

The streams are an object with a small interface (``CudaStreams``), so the schedule's order, its waits and its
host synchronizations are tested on CPU with a stand-in that records them.
"""

from collections.abc import Callable, Sequence

import torch


class CudaStreams:
    """A host-to-device and a device-to-host copy stream on ``device``; ``compute`` is the stream current outside
    ``on``. Streams are named ``"compute"``, ``"to_device"``, ``"to_host"``."""

    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self._side = {"to_device": torch.cuda.Stream(device), "to_host": torch.cuda.Stream(device)}

    def _stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device) if name == "compute" else self._side[name]

    def on(self, name: str):
        return torch.cuda.stream(self._side[name])

    def record(self) -> torch.cuda.Event:
        """An event on the stream now current."""
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the current stream wait for ``event`` (device-side; the host does not block)."""
        torch.cuda.current_stream().wait_event(event)

    def keep_for(self, tensor: torch.Tensor, name: str) -> None:
        """``tensor`` was allocated on one stream and is used on ``name``: the caching allocator must not hand its
        memory out again until that stream's work queued so far is done."""
        tensor.record_stream(self._stream(name))

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class HostStagedNS:
    """Runs ``ns`` on ``device`` for host matrices written by ``fill``; results come back in reused host buffers.

    ``streams``: ``CudaStreams(device)`` by default. ``trace``: a list that receives ``(operation, index)`` in the
    order operations are issued (tests read it).
    """

    def __init__(self, device: torch.device, streams=None, trace: list | None = None):
        self.device = device
        self.streams = CudaStreams(device) if streams is None else streams
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

    def run(self, inputs: Sequence[tuple[torch.Size, torch.dtype]], fill: Callable[[int, torch.Tensor], None],
            ns: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> list[torch.Tensor]:
        """``ns[i](matrix i on device)`` for each ``(shape, dtype)`` of ``inputs``; ``fill(i, buffer)`` writes matrix
        i into a host buffer of that shape, just before its copy in. The returned host tensors are this object's
        buffers: use them before the next ``run``."""
        streams, seen, nth = self.streams, {}, []
        for shape, dtype in inputs:
            key = (tuple(shape), dtype)
            nth.append(seen.get(key, 0))
            seen[key] = nth[-1] + 1

        def copy_in(i: int) -> tuple[torch.Tensor, object]:
            staged = self._buffer("in", inputs[i][0], inputs[i][1], nth[i])
            fill(i, staged)
            self._log("fill", i)
            with streams.on("to_device"):
                on_device = staged.to(self.device, non_blocking=True)
                arrived = streams.record()
            streams.keep_for(on_device, "compute")
            self._log("copy_in", i)
            return on_device, arrived

        results, done = [], None
        incoming = copy_in(0) if inputs else None
        for i in range(len(inputs)):
            G_device, arrived = incoming
            streams.wait(arrived)
            O = ns[i](G_device)
            del G_device
            self._log("ns", i)
            ns_done = streams.record()
            streams.keep_for(O, "to_host")
            with streams.on("to_host"):
                streams.wait(ns_done)
                out = self._buffer("out", O.shape, O.dtype, nth[i])
                out.copy_(O, non_blocking=True)
                done = streams.record()
            self._log("copy_out", i)
            results.append(out)
            if i + 1 < len(inputs):
                incoming = copy_in(i + 1)  # the host fills the next while the device runs this Newton–Schulz
        if done is not None:
            streams.synchronize(done)  # each stream runs in order and each waited for the one before
            self._log("synchronize", len(inputs))
        return results
