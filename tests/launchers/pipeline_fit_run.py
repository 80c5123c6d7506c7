"""One ``fit`` of configs/tiny-fsdp.yaml's model and data under ``MoEFSDPStrategy`` (2 gloo processes, expert
parallelism off) at a pipeline size, for tests/parallel/test_pipeline.py: the same global batch at any size
(``--batch`` per data-parallel replica: 8 sequences a step), optionally resumed from a checkpoint. The
probe (tests/launchers/ep_fit_probe.py) records each step's world-mean loss, the bytes each rank holds, and saves
checkpoints at ``--save-at``. Run under ``torch.distributed.run``."""

import argparse
from pathlib import Path

import lightning as L
import torch
import yaml

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import WarmupCosineLR
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.launchers.ep_fit_probe import EPFitProbe

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-fsdp.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--batch", type=int, required=True, help="data.batch_size (per data-parallel replica)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-at", type=int, nargs="*", default=[])
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--clip", type=float, default=None, help="trainer.gradient_clip_val")
    args = parser.parse_args()
    shape = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["config"]
    L.seed_everything(0)
    model = MoELanguageModel(MoEConfig(**shape),
                             optimizer=lambda groups: torch.optim.AdamW(groups, lr=0.003, betas=(0.9, 0.95)),
                             lr_scheduler=lambda opt: WarmupCosineLR(opt, warmup_steps=30))
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=args.batch, max_tokens=40000)
    strategy = MoEFSDPStrategy(pipeline_parallel_size=args.pp, pipeline_microbatches=args.microbatches,
                               stall_timeout=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=1,
                        val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        gradient_clip_val=args.clip,
                        callbacks=[EPFitProbe(args.out, save_at_steps=args.save_at)])
    trainer.fit(model, data, ckpt_path=args.ckpt)
    if trainer.is_global_zero and "val/loss" in trainer.callback_metrics:
        print("val/loss", float(trainer.callback_metrics["val/loss"]))


if __name__ == "__main__":
    main()
