"""Two gloo ranks, three failures the ranks must agree on (issue 23, defects 2, 4, 5). Run by
tests/checkpoint/test_sharded.py through tests/distributed.run_ranks: ``python tests/launchers/checkpoint_ranks_run.py FOLDER``.

Each scenario prints ``<scenario> <rank> <step or -> <exception class>: <message>`` and then meets the other rank
at a barrier, as training would at its next collective: a rank left behind shows up as a timeout, not a pass.
"""

import errno
import io
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lightning.training.callbacks.resume import agree_on_resume
from moe_lightning.checkpoint import discovery
from moe_lightning.checkpoint import sharded as ckpt
from moe_lightning.checkpoint.commit import METADATA_FILE, save_file
from moe_lightning.checkpoint.safe_load import CheckpointError
from moe_lightning.parallel.mesh import world_side_channel


def checkpointer() -> ckpt.ShardedCheckpointer:
    """As the strategy sets it up: its agreements and background writes on gloo side channels of their own."""
    saver = ckpt.ShardedCheckpointer()
    saver.use_groups(world_side_channel(), world_side_channel())
    return saver


def say(scenario: str, step, error: BaseException | None) -> None:
    what = "ok" if error is None else f"{type(error).__name__}: {str(error).splitlines()[-1]}"
    print(f"{scenario} {dist.get_rank()} {step} {what}", flush=True)


def disk_full_in_meta(folder: Path) -> None:
    """Rank 0 runs out of disk while writing ``meta.pt``: every rank must raise, none may wait."""
    path = folder / "meta" / "last.ckpt"
    saver = checkpointer()
    saver.save({"w": torch.ones(4) * dist.get_rank()}, {"global_step": 1}, path, set(), None)
    real_open = io.open

    def full(file, mode="r", *args, **kwargs):  # what a full disk does to whoever writes meta.pt, however
        opened = real_open(file, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else str(file)
        return _Full(opened) if "w" in mode and Path(name).name.startswith(METADATA_FILE) else opened

    if dist.get_rank() == 0:
        io.open = full
    error = None
    try:
        saver.save({"w": torch.ones(4) * 2}, {"global_step": 2}, path, set(), None)
    except Exception as failure:
        error = failure
    io.open = real_open
    say("meta", "-", error)
    dist.barrier()


class _Full:
    def __init__(self, file):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)


class FailingWriter(ckpt._HostCopyWriter):
    """Rank 1's background write fails a second after it starts (an I/O error on its file system)."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            time.sleep(1.0)
            raise OSError(errno.EIO, "Input/output error")
        return super().write_data(plan, planner)


def async_failure(folder: Path) -> None:
    """The background write fails; rank 0 looks only once its own write has ended, rank 1 at once: both must raise
    at the same step."""
    saver = checkpointer()
    saver.storage_writer = FailingWriter
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, folder / "async" / "step=1.ckpt", set(), None,
               background=True)
    if dist.get_rank() == 0:
        while not saver._pending[0].done():
            time.sleep(0.05)
    for step in range(60):
        try:
            saver.poll()
        except CheckpointError as error:
            say("async", step, error)
            break
        time.sleep(0.1)
    else:
        say("async", "never", None)
    dist.barrier()


def disagreeing_last(folder: Path) -> None:
    """Rank 1 cannot read the newest checkpoint (EIO): it is skipped there, said, and the ranks refuse together."""
    root = folder / "last"
    if dist.get_rank() == 0:
        root.mkdir()
        save_file({"global_step": 1}, root / "step=1.ckpt")
        save_file({"global_step": 2}, root / "step=2.ckpt")
    dist.barrier()
    real = discovery.load_metadata

    def eio(path, *args, **kwargs):  # the read of the newest file fails on rank 1 only
        if Path(path).name == "step=2.ckpt":
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *args, **kwargs)

    if dist.get_rank() == 1:
        discovery.load_metadata = eio
    error = None
    try:
        newest = discovery.newest_checkpoint([root])
        agree_on_resume(str(newest[0]) if newest else None)
    except Exception as failure:
        error = failure
    say("last", "-", error)
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    out = Path(sys.argv[1])
    for scenario in (disk_full_in_meta, async_failure, disagreeing_last):
        scenario(out)
    dist.destroy_process_group()
