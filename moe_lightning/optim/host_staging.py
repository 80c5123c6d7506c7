"""Newton–Schulz of host-resident matrices (FSDP2 ``cpu_offload``) on the GPU, pipelined.

Used only where the matrices and Newton–Schulz live on different devices: a CPU-only run orthogonalizes where
the state is, with no copies. Serial blocking copies leave the GPU idle while each matrix crosses the bus;
``HostStagedNS`` instead, per matrix i:
- lets the host write the input (Muon's momentum update) straight into a pinned buffer, *after* matrix i-1's
  Newton–Schulz is enqueued, so the host work and the pageable-to-pinned traffic overlap device work;
- copies it in on a host-to-device stream; Newton–Schulz waits for it on the compute stream;
- copies the result back into a pinned buffer on a device-to-host stream once Newton–Schulz is done.
Each direction has its own stream, so a copy in never queues behind a copy back. Every device tensor is allocated
on the compute stream, so it lives in that stream's caching-allocator pool (memory a side stream allocates stays
cached for that stream alone: at the seed's scale side streams held 27.3 GiB with 6.4 GiB in use); copies are
ordered with events instead of ``record_stream``: matrix i+1's destination is allocated before matrix i's
Newton–Schulz is enqueued, and its copy in waits only for the compute work issued before that allocation; a
result stays referenced until the host has seen its copy back finish. Pinned memory is a ring of
two slots per (shape, dtype) and direction, kept across steps: before the host refills a slot it waits for the
copy that last used it, and each result is applied (``apply``) once its own copy back is done, after the next
matrix's copy in is issued, rather than held to the end. So the pinned memory is four buffers per distinct
shape, not two per matrix (at configs/1t.yaml, cpu_offload, that was ~15 GiB pinned per GPU); ``plan`` prices
the ring (``staging_bytes``).

The streams are an object with a small interface (``CudaStreams``), so the schedule's order, its waits and its
host synchronizations are tested on CPU with a stand-in that records them.
"""

import math
from collections.abc import Callable, Sequence

import torch


class CudaStreams:
    """A host-to-device and a device-to-host copy stream on ``device``; ``compute`` is the stream current outside
    ``on``. Streams are named ``"compute"``, ``"to_device"``, ``"to_host"``."""

    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self._side = {"to_device": torch.cuda.Stream(device), "to_host": torch.cuda.Stream(device)}

    def on(self, name: str):
        return torch.cuda.stream(self._side[name])

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor from the pool of the stream now current (the compute stream: called outside ``on``)."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def record(self) -> torch.cuda.Event:
        """An event on the stream now current."""
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        """Make the current stream wait for ``event`` (device-side; the host does not block)."""
        torch.cuda.current_stream().wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()


class HostStagedNS:
    """Runs ``ns`` on ``device`` for host matrices written by ``fill``; results come back in a ring of host buffers.

    ``streams``: ``CudaStreams(device)`` by default. ``trace``: a list that receives ``(operation, index)`` in the
    order operations are issued (tests read it).
    """

    def __init__(self, device: torch.device, streams=None, trace: list | None = None):
        self.device = device
        self.streams = CudaStreams(device) if streams is None else streams
        self.trace = trace
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._last_use: dict[tuple, object] = {}  # slot -> event of the copy that last used it (this run)

    def _slot(self, role: str, shape: torch.Size, dtype: torch.dtype, nth: int) -> tuple[tuple, torch.Tensor]:
        """Ring slot ``nth % 2`` of (role, shape, dtype), once the copy that last used it is done."""
        key = (role, tuple(shape), dtype, nth % SLOTS)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.streams.pin)
        if key in self._last_use:
            self.streams.synchronize(self._last_use.pop(key))
        return key, self._buffers[key]

    def _log(self, operation: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((operation, i))

    def run(self, inputs: Sequence[tuple[torch.Size, torch.dtype]], fill: Callable[[int, torch.Tensor], None],
            ns: Sequence[Callable[[torch.Tensor], torch.Tensor]], apply: Callable[[int, torch.Tensor], None]) -> None:
        """``apply(i, ns[i](matrix i on device))`` for each ``(shape, dtype)`` of ``inputs``, the result in a host
        buffer that is reused once ``apply`` returns; ``fill(i, buffer)`` writes matrix i into a host buffer of that
        shape, just before its copy in."""
        streams, seen, nth = self.streams, {}, []
        for shape, dtype in inputs:
            key = (tuple(shape), dtype)
            nth.append(seen.get(key, 0))
            seen[key] = nth[-1] + 1
        self._last_use.clear()  # the previous run ended with every copy done

        def allocate(i: int) -> tuple[torch.Tensor, object]:
            """Matrix i's device copy, from the compute stream's pool; the event marks the compute work its memory
            may still be in use by (the copy in waits for it)."""
            destination = streams.empty(inputs[i][0], inputs[i][1])
            self._log("allocate", i)
            return destination, streams.record()

        def copy_in(i: int, destination: torch.Tensor, allocated) -> tuple[torch.Tensor, object]:
            key, staged = self._slot("in", inputs[i][0], inputs[i][1], nth[i])
            fill(i, staged)
            self._log("fill", i)
            with streams.on("to_device"):
                streams.wait(allocated)
                destination.copy_(staged, non_blocking=True)
                arrived = self._last_use[key] = streams.record()
            self._log("copy_in", i)
            return destination, arrived

        def finish(i: int, out: torch.Tensor, done, O: torch.Tensor) -> None:
            streams.synchronize(done)  # the copy back has read O: its memory may go back to the compute pool
            apply(i, out)
            self._log("apply", i)

        back = None  # (index, host buffer, its copy-back event, device result) of the result not yet applied
        incoming = copy_in(0, *allocate(0)) if inputs else None
        for i in range(len(inputs)):
            G_device, arrived = incoming
            following = allocate(i + 1) if i + 1 < len(inputs) else None  # before this NS is enqueued
            streams.wait(arrived)
            O = ns[i](G_device)
            del G_device  # allocated on compute, read there after the wait: no other stream touches it again
            self._log("ns", i)
            ns_done = streams.record()
            _, out = self._slot("out", O.shape, O.dtype, nth[i])  # its last user was applied already
            with streams.on("to_host"):
                streams.wait(ns_done)
                out.copy_(O, non_blocking=True)
                done = streams.record()
            self._log("copy_out", i)
            if following is not None:
                incoming = copy_in(i + 1, *following)  # the host fills the next while the device runs this NS
            if back is not None:
                finish(*back)
            back = (i, out, done, O)
            del O
        if back is not None:
            finish(*back)  # each stream runs in order and each waited for the one before: every copy is done


SLOTS = 2  # pinned buffers per (shape, dtype) and direction


def staging_bytes(shapes: Sequence[tuple[int, ...]], ns_element_size: int, pinned_bytes: Callable[[int], int]) -> int:
    """Pinned host bytes ``HostStagedNS`` keeps for matrices of these shapes: a ring of ``SLOTS`` fp32 inputs and
    ``SLOTS`` Newton–Schulz-dtype outputs per distinct shape, each an allocation of ``pinned_bytes``."""
    return sum(SLOTS * (pinned_bytes(4 * math.prod(s)) + pinned_bytes(ns_element_size * math.prod(s)))
               for s in set(map(tuple, shapes)))
