"""What the tiny ``fit`` launchers in tests/launchers/ share: the common flags of their command line, one thread and
seed 0 in every rank, the world size from the launching environment, and a CPU Trainer with only training on."""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from moe_lightning.training.strategy import MoEFSDPStrategy


def fit_arguments(max_steps: int | None = None, checkpoints: bool = False) -> argparse.ArgumentParser:
    """``--out`` (the JSON a launcher writes); ``--max-steps`` with this default when given one; ``--ckpt-dir``
    and ``--resume`` with ``checkpoints``. The launcher adds its own flags."""
    parser = argparse.ArgumentParser()
    if max_steps is not None:
        parser.add_argument("--max-steps", type=int, default=max_steps)
    if checkpoints:
        parser.add_argument("--ckpt-dir", default=None)
        parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, then one thread and seed 0: every rank, and the one-process reference, start alike."""
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    return args


def world_size() -> int:
    """Processes in the run, as the launcher (tests/support/distributed.py, torchrun) set ``WORLD_SIZE``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_or_single(single: bool, **strategy_arguments) -> MoEFSDPStrategy | str:
    """``MoEFSDPStrategy(**strategy_arguments)``, or Lightning's default single-device strategy for the one-process
    reference a distributed run is compared with."""
    return "auto" if single else MoEFSDPStrategy(**strategy_arguments)


def cpu_trainer(strategy: MoEFSDPStrategy | str, callbacks: list[Callback], max_steps: int, ckpt_dir: str | None = None,
                every: int = 2, save_last: bool | None = None, **options) -> L.Trainer:
    """fp32 on CPU over ``world_size()`` processes, training only (no validation, logger, progress bar or summary);
    with ``ckpt_dir``, a checkpoint every ``every`` steps, all kept. ``options`` go to the Trainer."""
    if ckpt_dir:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=every,
                                                 save_top_k=-1, save_last=save_last)]
    return L.Trainer(accelerator="cpu", devices=world_size(), strategy=strategy, max_steps=max_steps,
                     limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                     precision="32-true", **options)
