"""In-process runs of MoEFSDPStrategy (one rank) leave torch.distributed initialised, as Lightning does; a later
test that checks "nothing was set up" or sets up its own group would then see the leftover. Tear it down."""

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
