"""Callbacks the stall tests add from the command line: one rank stops itself (SIGSTOP) at a chosen point.

Each prints ``stopping rank R pid P at WHERE`` on stdout first, so the test knows which pid the report must name
and when the stop began. With ``seconds`` a detached ``sleep; kill -CONT`` resumes the rank (a slow rank, not a
stalled one)."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from moe_lightning.parallel import expert_parallel


def stop_here(rank: int, where: str, seconds: float | None, pid: int | None = None) -> None:
    pid = pid or os.getpid()
    print(f"stopping rank {rank} pid {pid} at {where}", flush=True)
    time.sleep(2)  # here (inside the collective, if one was entered) long enough for the watchdog to publish it
    if seconds is not None:
        subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {pid}"], start_new_session=True)
    os.kill(pid, signal.SIGSTOP)


def children() -> list[int]:
    pids = [int(p) for task in Path("/proc/self/task").iterdir() for p in (task / "children").read_text().split()]
    if not pids:
        raise RuntimeError("no data-loader worker to stop: set --data.init_args.num_workers=1")
    return pids


class StopAtStep(Callback):
    """Rank ``rank`` stops itself when optimizer step ``step`` reaches ``where``: ``batch_start`` (the forward's
    start), ``all_to_all`` (its first expert all-to-all of the step), ``reduce_scatter`` (its first FSDP gradient
    reduce-scatter), ``save`` (inside the checkpoint save, after its state is gathered), or ``data_worker`` (its
    data-loader worker is stopped instead, the rank itself runs on)."""

    def __init__(self, step: int = 3, rank: int = 1, where: str = "batch_start", seconds: float | None = None):
        self.step, self.rank, self.where, self.seconds = step, rank, where, seconds
        self.armed = True

    def _mine(self, trainer) -> bool:
        return self.armed and trainer.global_rank == self.rank and trainer.global_step >= self.step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self._mine(trainer):
            return
        if self.where == "batch_start":
            self.armed = False
            stop_here(self.rank, "batch_start", self.seconds)
        elif self.where == "all_to_all":
            self.armed = False
            launch = expert_parallel._Exchange.launch

            def launch_then_stop(exchange, *args, **kwargs):  # entered (recorded), never completed by this rank
                expert_parallel._Exchange.launch = launch
                launch(exchange, *args, **kwargs)
                stop_here(self.rank, "all_to_all", self.seconds)

            expert_parallel._Exchange.launch = launch_then_stop
        elif self.where == "reduce_scatter":  # FSDP2's gradient reduce-scatter (reduce_scatter_single in 2.13)
            self.armed = False
            name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
            issue = getattr(dist, name)

            def issue_then_stop(*args, **kwargs):
                setattr(dist, name, issue)
                work = issue(*args, **kwargs)
                stop_here(self.rank, "reduce_scatter", self.seconds)
                return work

            setattr(dist, name, issue_then_stop)
        elif self.where == "data_worker":
            self.armed = False
            for pid in children():  # the data-loader workers: this rank's only child processes
                stop_here(self.rank, "data_worker", self.seconds, pid)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.where == "save" and self._mine(trainer):
            self.armed = False
            stop_here(self.rank, "save", self.seconds)



class SlowRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` before every forward from optimizer step ``step`` on: a straggler that keeps
    answering and progressing, which the others wait for in their next collective."""

    def __init__(self, rank: int = 1, seconds: float = 0.5, step: int = 0):
        self.rank, self.seconds, self.step = rank, seconds, step

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank:  # who it really is, for the test to compare with the warning
            print(f"slow rank {self.rank} is host {socket.gethostname()} pid {os.getpid()}", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            time.sleep(self.seconds)
