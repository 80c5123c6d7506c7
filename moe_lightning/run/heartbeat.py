"""What this rank's training thread is doing, kept in memory for the stall watchdog (``run/watchdog.py``).

The training thread only assigns a few attributes (no I/O, no lock, no collective): its step, its phase (data,
validation, checkpoint, forward, backward, optimizer) and the last collective it entered or finished (operation, the
mesh dimension's name, sequence number). Every change bumps ``progress``; the watchdog thread publishes a snapshot
through the rendezvous store, where the other ranks' watchdogs read it. A SIGSTOPped process stops both threads, so
its published ``tick`` stops too; a rank stuck in its own code (a data-loader worker that never answers) keeps
ticking but stops progressing.

Package code marks its collectives through the module functions ``entered`` / ``finished`` (no-ops while no
heartbeat is active, as in a single process), so they need no handle on the watchdog; a long write that is not a
collective (a checkpoint's files) calls ``progressed`` as it goes, so it is not taken for a stall.

``waited_s`` adds up the host seconds this rank spent *blocked* in collectives, which the straggler check
(``run/stragglers.py``) subtracts from its step time. Only the blocking call is timed, by its caller, through
``waited(seconds)`` (or ``collective``, which times its block): ``entered`` and ``finished`` do not time, since an
asynchronous collective's launch and land have compute in between (the shared experts, autograd) and other
collectives may enter and finish while it is in flight.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = ("start", "data", "validation", "checkpoint", "forward", "backward", "optimizer")
"""The phases of one heartbeat step in the order a rank passes them: the step counts up when an optimizer step ends,
so a validation and a save at that boundary belong to the next step, before its forward (``start``: before the
first training batch). The watchdog compares ranks in this order."""


def unnamed_group(group) -> str:
    """The dimension name when nothing better is known: ``world``, or ``group of N``."""
    if group is None:
        return "world"
    size = group.size() if hasattr(group, "size") else None
    return f"group of {size}" if size is not None else "group"


class Heartbeat:
    """This rank's step, phase and last collective; ``progress`` counts every change.

    Args:
        name_of: Maps a process group to its mesh dimension's name (``strategy.parallel.name_of`` once the strategy
            has one mesh); a group it does not know may raise ``KeyError`` or return ``None``.
    """

    def __init__(self, name_of: Callable[[object], str | None] | None = None):
        self.name_of = name_of
        self.step, self.phase, self.progress = 0, "start", 0
        self.trained = False  # a first training batch has completed: only then is this rank judged
        self.collectives = 0  # sequence number of the last collective entered
        self.collective: tuple[str, str, int, str] | None = None  # (op, dimension, seq, "entered" | "finished")
        self.device_done: Callable[[], bool] | None = None  # whether the device has completed it (see ``finished``)
        self.waited_s = 0.0  # host seconds spent blocked in collectives, summed (see ``waited``)

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase = phase
        self.progress += 1

    def batch_done(self) -> None:
        """A training batch has completed (the first one may compile and start the data loader for long)."""
        self.trained = True
        self.progress += 1

    def entered(self, op: str, group=None, dim: str | None = None) -> None:
        """This rank enters collective ``op`` over ``group`` (``dim``: its name, when no group names it)."""
        self.device_done = None
        self.collectives += 1
        self.collective = (op, dim or self.dimension(group), self.collectives, "entered")
        self.progress += 1

    def finished(self, device_done: Callable[[], bool] | None = None) -> None:
        """The wait of the collective entered last returned. On NCCL that only orders the current stream after it:
        ``device_done`` (a CUDA event's ``query``) then says whether the device has completed it, and until it
        does the snapshot still says "entered"."""
        self.device_done = device_done
        if self.collective is not None:
            op, dim, seq, _ = self.collective
            self.collective = (op, dim, seq, "finished")
            self.progress += 1

    def waited(self, seconds: float) -> None:
        """This rank was blocked ``seconds`` in a collective's wait (timed by the caller around the blocking call
        only, so overlapped compute and nested collectives are neither counted nor lost)."""
        self.waited_s += seconds

    def dimension(self, group) -> str:
        try:
            name = self.name_of(group) if self.name_of is not None else None
        except (KeyError, ValueError):
            name = None
        return name or unnamed_group(group)

    def snapshot(self) -> dict:
        """The fields the watchdog publishes (read from another thread: each is one atomic assignment)."""
        collective, device_done = self.collective, self.device_done
        if collective is not None and device_done is not None and not device_done():
            collective = (*collective[:3], "entered")
        return {"step": self.step, "phase": self.phase, "progress": self.progress, "trained": self.trained,
                "collective": None if collective is None else dict(zip(("op", "dim", "seq", "state"), collective))}


_active: Heartbeat | None = None


def activate(heartbeat: Heartbeat | None) -> None:
    """Make ``heartbeat`` the one the module functions update (``None``: none)."""
    global _active
    _active = heartbeat


def active() -> Heartbeat | None:
    return _active


def entered(op: str, group=None, dim: str | None = None) -> None:
    """This rank enters collective ``op`` over ``group`` (a launch, for an asynchronous one)."""
    if _active is not None:
        _active.entered(op, group, dim)


def progressed() -> None:
    """Work that is not a collective moved on (a chunk of a checkpoint written), from any thread: a long healthy
    write is progress, a write that stopped is not."""
    heartbeat = _active  # read once: the training thread may deactivate it between the check and the increment
    if heartbeat is not None:
        heartbeat.progress += 1  # a lost increment between threads is harmless: any change counts


def finished(output=None) -> None:
    """The collective entered last has completed here (its wait returned); ``output``, its output tensor: on a
    CUDA one the wait only ordered the stream, so a CUDA event recorded now tells the watchdog when it completes."""
    if _active is None:
        return
    device_done = None
    if output is not None and output.is_cuda:
        import torch

        event = torch.cuda.Event()
        event.record()
        device_done = event.query
    _active.finished(device_done)


def waited(seconds: float) -> None:
    """This rank was blocked ``seconds`` in a collective's wait (see ``Heartbeat.waited``)."""
    heartbeat = _active
    if heartbeat is not None:
        heartbeat.waited(seconds)


@contextmanager
def collective(op: str, group=None, dim: str | None = None) -> Iterator[None]:
    """Marks a blocking collective: entered before the block, finished after it; the block's time is waited."""
    entered(op, group, dim)
    started = time.perf_counter()
    yield
    waited(time.perf_counter() - started)
    finished()
