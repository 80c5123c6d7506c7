"""Which failures a user caused and reads as one line, and which keep their traceback.

Every command (``moe-lightning fit`` ... ``plan``) ends a refusal with one line on stderr,
``moe-lightning COMMAND: error: <what is wrong and the fix>``, and exit status 2 (usage and input errors, as
argparse does) or 1 (the state of the machine: a folder in use, a full disk, a file system without locks).
``--traceback`` anywhere on the command line, or ``MOE_LIGHTNING_TRACEBACK=1`` in the environment, shows the
stack instead (the flag sets the variable, so the ranks Lightning launches see it too).

A refusal is an exception of these classes, raised by this package's own checks (the innermost frame of its
traceback is in ``moe_lightning``): ``ValueError`` (the package's ``ConfigError``, ``HFFormatError``,
``MeshError``, ``ResumeMismatchError`` ... are ValueErrors), ``ImportError`` (an optional dependency to install),
``FolderInUseError``, ``NoFlockError``, ``NotALockFileError``, ``CheckpointError``, ``TokenizeError``; and, from
anywhere, the errors that name a path (``FileNotFoundError``, ``FileExistsError``, ``IsADirectoryError``,
``NotADirectoryError``, ``PermissionError``, ``DiskFullError``) and Lightning's ``MisconfigurationException``.
Everything else keeps its traceback: a ``TypeError``, ``RuntimeError`` or ``KeyError`` is a bug to report, and so
is a ``ValueError`` raised inside torch or numpy. So does any exception raised inside a trainer's run with more than
one process once its process group exists (``keep_traceback``): the rank that failed first is the one to read, in
full. A refusal raised in such a run before the process group exists (the checks every rank makes alike from the
same config: the mesh sizes and the sequence length, in the strategy's ``setup_environment``) stays one line, said by
rank 0 alone when every rank made the same check, the other ranks exiting with the same status silently; any other
such refusal by each rank that hit it, naming its rank (``in_multi_process_run``).
"""

import argparse
import os
import sys
from pathlib import Path

TRACEBACK_ENV = "MOE_LIGHTNING_TRACEBACK"
TRACEBACK_FLAG = "--traceback"
PACKAGE = Path(__file__).resolve().parents[1]

_FROM_ANYWHERE = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_OURS = (ValueError, ImportError)
# (module, class) of the package's and Lightning's refusal classes, looked up only where already imported: an
# exception of a class whose module was never imported cannot be one of them.
_NAMED_OURS = (("moe_lightning.run.locks", "FolderInUseError"), ("moe_lightning.run.locks", "NoFlockError"),
               ("moe_lightning.run.locks", "NotALockFileError"), ("moe_lightning.checkpoint.safe_load", "CheckpointError"),
               ("moe_lightning.data.tokenize.errors", "TokenizeError"))
_NAMED_ANYWHERE = (("moe_lightning.run.durable", "DiskFullError"),
                   ("lightning.fabric.utilities.exceptions", "MisconfigurationException"))
_STATE_OF_THE_MACHINE = (("moe_lightning.run.locks", "FolderInUseError"), ("moe_lightning.run.locks", "NoFlockError"),
                         ("moe_lightning.run.durable", "DiskFullError"))


def traceback_requested() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def take_traceback_flag(words: list[str]) -> list[str]:
    """``words`` without ``--traceback``; given, it sets ``MOE_LIGHTNING_TRACEBACK=1`` for this process and the
    processes it launches."""
    if TRACEBACK_FLAG in words:
        os.environ[TRACEBACK_ENV] = "1"
    return [word for word in words if word != TRACEBACK_FLAG]


def keep_traceback(error: BaseException) -> BaseException:
    """Mark ``error`` as one whose stack must be shown (raised inside a multi-process trainer's run)."""
    error.moe_lightning_keep_traceback = True
    return error


def same_on_every_rank(error: BaseException) -> BaseException:
    """Mark a refusal that every rank of a run reaches alike (a check of the shared config: the layout's sizes), so
    that rank 0 alone says it."""
    error.moe_lightning_same_on_every_rank = True
    return error


def in_multi_process_run(error: BaseException, rank: int) -> None:
    """Mark ``error``, raised inside a trainer's run of several processes on global ``rank``: a refusal raised
    before the process group exists stays one line (no rank waits in a collective): said by rank 0 alone when every
    rank made the same check (``same_on_every_rank``), else by the ranks that hit it, each naming itself (a folder
    one node cannot write); anything else keeps its stack."""
    if is_refusal(error) and not _process_group_exists():
        if getattr(error, "moe_lightning_same_on_every_rank", False):
            error.moe_lightning_silent = rank != 0
        else:
            error.moe_lightning_rank = rank
        return
    keep_traceback(error)


def _process_group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no process group either
    return dist is not None and dist.is_available() and dist.is_initialized()


def _classes(names) -> tuple[type, ...]:
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(c for c in found if isinstance(c, type))


def _raised_by_package(error: BaseException) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` is reported as one line (see the module docstring)."""
    if not isinstance(error, Exception) or getattr(error, "moe_lightning_keep_traceback", False):
        return False
    if isinstance(error, _FROM_ANYWHERE + _classes(_NAMED_ANYWHERE)):
        return True
    return isinstance(error, _OURS + _classes(_NAMED_OURS)) and _raised_by_package(error)


def exit_status(error: BaseException) -> int:
    """2 for usage and input errors, 1 for the state of the machine (a busy folder, a full disk, an I/O error: try
    again later, or elsewhere)."""
    machine = _classes(_STATE_OF_THE_MACHINE)
    return 1 if isinstance(error, machine) or isinstance(error, OSError) and not isinstance(error, _FROM_ANYWHERE) \
        else 2


def one_line(error: BaseException | str) -> str:
    """The message on one line (a ``KeyError``'s without its quotes)."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(message).split()) or type(error).__name__


def say_refusal(command: str, error: BaseException | str) -> None:
    if not getattr(error, "moe_lightning_silent", False):  # rank 0 says what every rank refused
        rank = getattr(error, "moe_lightning_rank", None)
        where = "" if rank is None else f"rank {rank}: "
        os.write(2, f"moe-lightning {command}: error: {where}{one_line(error)}\n".encode())


class CommandParser(argparse.ArgumentParser):
    """``argparse`` whose usage error is one line naming the command and where the options are listed (exit 2);
    with ``--traceback`` argparse's own report (the usage, then the error)."""

    def error(self, message: str):
        if traceback_requested():
            super().error(message)
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")
