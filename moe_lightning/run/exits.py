"""How a run ends, as a requeue script reads it: the exit statuses and the one line said on the way out.

0: finished; ``128 + signal``: preempted or interrupted (a ``fit`` has written its checkpoint, a ``tokenize`` kept
its finished units); ``EXIT_MAX_TIME`` (75): ``trainer.max_time`` stopped a ``fit`` (the final checkpoint is
written); ``EXIT_STALLED`` (69): a rank of a ``fit`` stopped making progress (``run/watchdog.py`` printed which and
wrote ``stall-report.json``; the newest complete checkpoint is untouched); 1: an error; 2: bad usage. A requeue
script relaunches the same command on 75 and on ``128 + n``, and on 69 without the host the report names.
"""

import os
import signal
import subprocess

EXIT_MAX_TIME = 75
"""sysexits.h's ``EX_TEMPFAIL`` ("temporary failure, try again"): the run is not finished."""

EXIT_STALLED = 69
"""sysexits.h's ``EX_UNAVAILABLE`` ("a service is unavailable"): a rank stalled; relaunch without its host."""


class Preempted(SystemExit):
    """Raised once a stopped run has kept what it can (every rank of a ``fit``); the process exits with ``code``."""

    def __init__(self, code: int, message: str, said: bool = False):
        super().__init__(code)
        self.message, self.said = message, said  # said: printed already (the console entry point prints it if not)

    def __str__(self) -> str:
        return self.message


def stopped_word(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else "preempted"


def say(text: str) -> None:
    """One line on stderr, unbuffered: in order with Lightning's stderr, from every rank."""
    os.write(2, (text.rstrip("\n") + "\n").encode())


def requeue_slurm_job() -> str:
    """Ask SLURM to requeue this job (or array task); returns what to add to the stop line."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"; `scontrol requeue {job}` failed ({error}): resubmit the job"
    if result.returncode != 0:
        return f"; `scontrol requeue {job}` failed ({(result.stderr or result.stdout).strip()}): resubmit the job"
    return f"; SLURM job {job} requeued"
