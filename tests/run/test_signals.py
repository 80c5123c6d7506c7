"""The one stop-signal helper (``run/signals.py``) that ``fit`` and ``tokenize`` share: record now, act at the step
boundary; before the work begins, stop at once; a repeat after the grace period exits at once."""

import os
import signal
import subprocess
import sys

import pytest

from moe_lightning.run.signals import StopSignals
from moe_lightning.training.callbacks.preemption import Preemption
from tests.support.distributed import clean_env


class Stop(Exception):
    pass


def test_the_handler_only_records_a_signal_and_a_repeat_after_the_grace_period_exits_at_once():
    """In a child process, with the work begun: the handler prints nothing (a handler may run inside a print); two
    signals at once (`timeout`'s double delivery) are one request; a repeat a moment later exits at once with
    128 + signal."""
    script = ("import os, signal, time\n"
              "from moe_lightning.run.signals import StopSignals\n"
              "s = StopSignals([signal.SIGTERM], stop=RuntimeError, repeat_grace_s=0.2)\n"
              "s.started = True\n"
              "with s.installed():\n"
              "    os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print('still running', s.signum, flush=True)\n"
              "    time.sleep(0.3)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(5); print('not reached', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 128 + signal.SIGTERM
    assert result.stdout == f"still running {int(signal.SIGTERM)}\n"
    assert result.stderr == ""


def test_before_the_work_begins_a_signal_raises_the_callers_stop_and_the_handlers_are_restored():
    def previous(signum, frame):
        raise AssertionError("the helper's handler should have had it")

    before = signal.signal(signal.SIGTERM, previous)
    try:
        signals = StopSignals([signal.SIGTERM], stop=lambda signum: Stop(signum))
        with pytest.raises(Stop) as stopped, signals.installed():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a bytecode boundary: Python runs the handler here
        assert stopped.value.args == (signal.SIGTERM,) and signals.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is previous
        signals.reset()
        signals.started = True  # the work has begun: recorded, nothing raised
        with signals.installed():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)
        assert signals.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)


def test_exit_on_repeat_leaves_a_repeat_to_the_kernel_only_once_a_signal_was_received():
    signals = StopSignals([signal.SIGUSR2], stop=Stop, repeat_grace_s=0.0)
    with signals.installed():
        signals.exit_on_repeat()  # no signal yet: the first one must still be recorded, not kill the process
        assert signal.getsignal(signal.SIGUSR2) == signals.handle
        signals.signum = signal.SIGUSR2
        signals.exit_on_repeat()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # what was there before the block


def test_fit_takes_its_signals_through_the_helper():
    preemption = Preemption(repeat_grace_s=0.5)
    assert isinstance(preemption.signals, StopSignals) and preemption.signals.repeat_grace_s == 0.5
    assert preemption.signals.signals == [signal.SIGINT, signal.SIGTERM] and preemption.signum is None
    stop = preemption.signals.stop(signal.SIGINT)
    assert stop.code == 128 + signal.SIGINT and str(stop) == "interrupted before the first step: nothing to save"
