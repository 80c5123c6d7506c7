"""A few Muon training steps through Lightning (one process, or MoEFSDPStrategy ranks); rank 0 writes the
world-mean loss of every step as JSON. Launched by tests/optim/test_flexshard.py."""

import argparse
import json
import os
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import Muon, WarmupCosineLR
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.launchers.strategy_run import TINY


class Losses(Callback):
    def __init__(self, out: Path):
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item())
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"losses": self.losses, "start": trainer.global_step - len(self.losses)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=0, help="0: one process without a strategy")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = MoEFSDPStrategy(expert_parallel_size=args.ep) if args.ep else "auto"
    callbacks = [Losses(Path(args.out))]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=2,
                                         save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.max_steps,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks,
                        precision="32-true")
    model = MoELanguageModel(MoEConfig(**TINY), optimizer=partial(Muon, lr=1e-2),
                             lr_scheduler=partial(WarmupCosineLR, warmup_steps=2))
    data = TextDataModule(source=os.__file__, seq_len=32, batch_size=4 // world, val_fraction=0.05)
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
