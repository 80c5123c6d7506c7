"""One ``fit`` of configs/tiny-fsdp.yaml's model and data under ``MoEFSDPStrategy`` (``--devices`` gloo processes,
2 by default; ``--ep`` and ``--cp`` within a stage) at a pipeline size, for tests/parallel/test_pipeline.py: the
same global batch at any size (``--batch`` per data-parallel replica: 8 sequences a step), optionally resumed
from a checkpoint. The probe (tests/launchers/ep_fit_probe.py) records each step's world-mean loss, the bytes each
rank holds, and saves checkpoints at ``--save-at``. Run under ``torch.distributed.run``."""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import yaml

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import WarmupCosineLR
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.launchers.ep_fit_probe import EPFitProbe
from tests.launchers.offload_probe import OffloadProbe
from tests.launchers.stage_metrics_probe import StageMetricsProbe
from tests.launchers.expert_bias_probe import ExpertBiasProbe

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
    parser.add_argument("--devices", type=int, default=2, help="gloo processes (trainer.devices)")
    parser.add_argument("--ep", type=int, default=1, help="strategy.expert_parallel_size")
    parser.add_argument("--cp", type=int, default=1, help="strategy.context_parallel_size")
    parser.add_argument("--biases", default=None, help="ExpertBiasProbe's output: every layer's bias each step")
    parser.add_argument("--schedule", default="1F1B", help="strategy.pipeline_schedule")
    parser.add_argument("--stages-per-rank", type=int, default=None, help="strategy.pipeline_stages_per_rank")
    parser.add_argument("--n-layers", type=int, default=None, help="the model's n_layers (default: the config's)")
    parser.add_argument("--model-json", default="{}", help='config fields over the yaml\'s: {"mtp_layers": 1}')
    parser.add_argument("--offload", action="store_true",
                        help="ActivationOffload(min_offload_bytes=0); OffloadProbe's offload.rank<r>.json by --out")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--adamw-patterns", nargs="*", default=None, help="Muon's: names sent to AdamW")
    parser.add_argument("--qk-clip", type=float, default=None, help="QKClip's threshold")
    parser.add_argument("--expert-load", action="store_true", help="ExpertLoadMonitor every step, heatmap each 2")
    parser.add_argument("--aux-loss-coef", type=float, default=0.0)
    parser.add_argument("--log-every", type=int, default=50, help="trainer.log_every_n_steps")
    parser.add_argument("--record", default=None, help="StageMetricsProbe's output (one file per rank)")
    parser.add_argument("--async-checkpoint", action="store_true", help="strategy.async_checkpoint")
    args = parser.parse_args()
    from moe_lightning.optim import Muon
    from moe_lightning.training.callbacks import ActivationOffload, ExpertLoadMonitor, QKClip
    extra = ([QKClip(args.qk_clip)] if args.qk_clip else []) + (
        [ExpertLoadMonitor(log_every_n_steps=1, image_every_n_steps=2)] if args.expert_load else []) + (
        [StageMetricsProbe(args.record)] if args.record else []) + (
        [ActivationOffload(min_offload_bytes=0), OffloadProbe(Path(args.out).with_name("offload"))]
        if args.offload else [])
    optimizer = (lambda groups: Muon(groups, lr=0.003, adamw_lr=0.003, adamw_betas=(0.9, 0.95), ns_dtype="float32",
                                     adamw_patterns=args.adamw_patterns)) if args.optimizer == "muon" else \
        (lambda groups: torch.optim.AdamW(groups, lr=0.003, betas=(0.9, 0.95)))
    shape = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["config"]
    shape["aux_loss_coef"] = args.aux_loss_coef
    shape["n_layers"] = args.n_layers or shape["n_layers"]
    shape.update(json.loads(args.model_json))
    L.seed_everything(0)
    model = MoELanguageModel(MoEConfig(**shape),
                             optimizer=optimizer,
                             lr_scheduler=lambda opt: WarmupCosineLR(opt, warmup_steps=30))
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=args.batch, max_tokens=40000)
    strategy = MoEFSDPStrategy(pipeline_parallel_size=args.pp, pipeline_microbatches=args.microbatches,
                               expert_parallel_size=args.ep, context_parallel_size=args.cp,
                               pipeline_schedule=args.schedule, pipeline_stages_per_rank=args.stages_per_rank,
                               async_checkpoint=args.async_checkpoint, stall_timeout=0)
    norms = []  # each step's gradient norm before clipping (over every stage: the same on every rank)
    clip = strategy.clip_grad_by_norm
    strategy.clip_grad_by_norm = lambda optimizer, max_norm: norms.append(float(n := clip(optimizer, max_norm))) or n
    saves = []  # each sharded save's background flag (--async-checkpoint: staged, then written by a thread)
    save = strategy.checkpointer.save
    strategy.checkpointer.save = lambda *given, **named: saves.append(named["background"]) or save(*given, **named)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=1,
                        val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        gradient_clip_val=args.clip, log_every_n_steps=args.log_every,
                        default_root_dir=Path(args.out).parent,
                        callbacks=[*extra, EPFitProbe(args.out, save_at_steps=args.save_at),
                                   *([ExpertBiasProbe(args.biases)] if args.biases else [])])
    trainer.fit(model, data, ckpt_path=args.ckpt)
    if trainer.is_global_zero:
        Path(args.out).with_name("norms.json").write_text(json.dumps(norms))
        Path(args.out).with_name("saves.json").write_text(json.dumps(saves))
    if trainer.is_global_zero and "val/loss" in trainer.callback_metrics:
        print("val/loss", float(trainer.callback_metrics["val/loss"]))


if __name__ == "__main__":
    main()
