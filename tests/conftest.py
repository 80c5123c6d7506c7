"""Process-wide state a test may leave behind, torn down after each: in-process runs of MoEFSDPStrategy (one rank)
leave torch.distributed initialised, as Lightning does, and ``--traceback`` sets ``MOE_LIGHTNING_TRACEBACK`` for
the whole process (a later test's refusal would then raise instead of printing its one line)."""

import logging
import os
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_traceback_variable(monkeypatch):
    """Each test starts without the variable (a developer's exported one would turn the one-line refusals the
    tests read into tracebacks), and its value before the test comes back after it, whatever the test set:
    ``setenv`` records it (``delenv`` of an absent variable records nothing)."""
    monkeypatch.setenv("MOE_LIGHTNING_TRACEBACK", "")
    monkeypatch.delenv("MOE_LIGHTNING_TRACEBACK")


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, for code that needs ``torch.distributed`` without launching ranks."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def lightning_log():
    """Messages Lightning's logger emits (it does not propagate to the root logger, so caplog misses them)."""
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


@pytest.fixture
def durability_log(monkeypatch):
    """What a save makes durable, in order: ``("fsync", path synced)`` and ``("replace", name renamed to)``."""
    real_fsync, real_replace, events = os.fsync, os.replace, []

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events
