"""In-process runs of MoEFSDPStrategy (one rank) leave torch.distributed initialised, as Lightning does; a later
test that checks "nothing was set up" or sets up its own group would then see the leftover. Tear it down."""

import logging

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
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
