"""The package's one way to take a stop signal (SIGINT, SIGTERM, SLURM's requeue signal): record it now, act on it
at the next step boundary. ``fit`` (``training/callbacks/preemption.py``) and ``tokenize`` both use it.

A handler runs between any two bytecodes of the main thread (inside a print, a log call, a pool's bookkeeping), so
``StopSignals.handle`` only records the signal; the loop that owns the work looks at ``signum`` where stopping is
safe (``fit``: an optimizer step's end; ``tokenize``: between batches and units) and stops there. Two cases cannot
wait for a boundary, and the handler acts itself:

- before the work has begun (``started`` is False: a model being built, a lock being waited for, a corpus being
  planned) there is nothing to keep, so it raises the caller's ``stop(signum)`` at once, which also ends a blocking
  wait;
- a repeat more than ``repeat_grace_s`` after the first exits at once with ``128 + signal`` (the user insists).
  ``timeout`` and process-group delivery send one signal twice at once: within the grace it is one request.

Before any command has handlers of its own (Python starting, Lightning importing, the folder lock's holder record
being written), ``startup_guard`` stands in: a stop signal raises the command's ``stop`` at once, so files being
written are removed by their writers' clean-up and the command says why it stopped, where the default action
(SIGTERM, SLURM's SIGUSR1) would kill it silently mid-write. ``fit`` ends the guard (``end_startup``) when its
own handlers take over.
"""

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StopSignals:
    """The first stop signal this process received (``signum``), recorded by ``handle``.

    Args:
        signals: The signals ``installed`` takes over.
        stop: The exception raised at once for a signal before the work has begun (``started`` False).
        repeat_grace_s: A repeat within this many seconds of the first signal is the same request.
    """

    def __init__(self, signals: list[int], stop: Callable[[int], BaseException], repeat_grace_s: float = 1.0):
        self.signals, self.stop, self.repeat_grace_s = list(signals), stop, repeat_grace_s
        self.signum: int | None = None
        self.started = False
        self._first_at = 0.0

    def reset(self) -> None:
        self.signum, self.started = None, False

    def handle(self, signum: int, frame) -> None:
        """Records the signal, nothing else; before the work has begun it raises ``stop``, on a late repeat it exits
        (see the module docstring)."""
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if not self.started:
                raise self.stop(signum)
        elif now - self._first_at >= self.repeat_grace_s:
            os._exit(128 + signum)

    def exit_on_repeat(self) -> None:
        """From now on a repeat kills the process at once (the kernel's default action), even inside a collective:
        for the last stretch, the save a stop makes. Waits out the grace first, so the second copy of a double
        delivery cannot kill that save."""
        if self.signum is None:
            return  # this process's first signal may still come: it must not kill the save
        time.sleep(max(0.0, self._first_at + self.repeat_grace_s - time.monotonic()))
        for signum in self.signals:
            signal.signal(signum, signal.SIG_DFL)

    @contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        """``handle`` for ``signals`` while the block runs (the main thread only: Python delivers signals there),
        the previous handlers after it. ``fit`` installs through Lightning's signal connector instead
        (``lightning_internals.install_signal_handlers``), which Lightning would otherwise replace."""
        saved = {}
        if threading.current_thread() is threading.main_thread():
            saved = {signum: signal.signal(signum, self.handle) for signum in self.signals}
        try:
            yield self
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


STARTUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_GUARDS: list[tuple[StopSignals, dict]] = []  # the active startup guards and the handlers they replaced


def _restore(guard: StopSignals, saved: dict) -> None:
    for signum, handler in saved.items():
        if signal.getsignal(signum) == guard.handle:  # still the guard's: not replaced since
            signal.signal(signum, handler)


@contextmanager
def startup_guard(stop: Callable[[int], BaseException],
                  signals: tuple[int, ...] = STARTUP_SIGNALS) -> Iterator[StopSignals]:
    """While the block runs (or until ``end_startup``), a stop signal raises ``stop(signum)`` at once (see the
    module docstring); the previous handlers after it. The main thread only, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield StopSignals(list(signals), stop)
        return
    guard = StopSignals(list(signals), stop)
    saved = {signum: signal.signal(signum, guard.handle) for signum in signals}
    _GUARDS.append((guard, saved))
    try:
        yield guard
    finally:
        _GUARDS.remove((guard, saved))
        _restore(guard, saved)


def end_startup() -> None:
    """The command's own handlers take over now: every active ``startup_guard`` gives back the handlers it replaced
    (a signal the command does not take, e.g. SIGUSR1 outside SLURM, gets its previous action back)."""
    for guard, saved in _GUARDS:
        _restore(guard, saved)
