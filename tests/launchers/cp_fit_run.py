"""One tiny ``fit`` under ``MoEFSDPStrategy`` for the context-parallel and expert-exchange fit tests (real gloo ranks, or one process as
the CP 1 reference). Rank 0 writes JSON: per micro-batch the world-mean loss (``strategy_run.Record``), per step the
gradient norms, QK-clip's combined per-head maxima and clipped heads, and the routers' balancing biases.

Documents end at the newline byte (``--docs``), so every 32-token sequence holds several document borders.
Launched by tests/training/test_context_parallel_fit.py.
"""

import json
import os
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import Muon, WarmupCosineLR
from moe_lightning.training.callbacks.activation_offload import ActivationOffload
from moe_lightning.training.callbacks.qk_clip import QKClip
from moe_lightning.training.lightning_internals import optimizer_step_ends
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.launchers.strategy_run import TINY, Record
from tests.support.collectives import CollectiveCounter
from tests.support.fit_launcher import cpu_trainer, fit_arguments, parse

# O(1) activations (init 0.2, not 0.02) so attention is far from uniform and the logits clip at the threshold below
SHAPE = {**TINY, "init_std": 0.2, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
         "eod_token_id": 10}
QK_THRESHOLD = 2.0


class StepState(Callback):
    """Per optimizer step (after QK-clip's): its combined maxima and clipped heads, and every router's bias."""

    def __init__(self, qk_clip: QKClip | None):
        self.qk_clip, self.max_logits, self.clipped, self.biases = qk_clip, [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not optimizer_step_ends(trainer):
            return
        if self.qk_clip is not None:
            self.max_logits.append(self.qk_clip.last_max_logits.tolist())
            self.clipped.append(int((self.qk_clip.last_gamma < 1).sum()))
        self.biases.append([moe.router.expert_bias.tolist() for moe in pl_module.model.moe_layers()])


def main() -> None:
    parser = fit_arguments(max_steps=3, checkpoints=True)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=1, help="ep_overlap_chunks")
    parser.add_argument("--dispatch-dtype", default=None, help="MoEFSDPStrategy(dispatch_dtype=...)")
    parser.add_argument("--attention", choices=["mla", "gqa"], default="gqa")
    parser.add_argument("--docs", action="store_true", help="document masking, documents end at a newline")
    parser.add_argument("--muon", action="store_true")
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--offload-activations", action="store_true", help="the ActivationOffload callback")
    parser.add_argument("--cpu-offload", action="store_true", help="cpu_offload=True (FSDP)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per data replica")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--config", default="{}", help="JSON overrides of the model config")
    args = parse(parser)

    strategy = MoEFSDPStrategy(context_parallel_size=args.cp, expert_parallel_size=args.ep,
                               ep_overlap_chunks=args.chunks, dispatch_dtype=args.dispatch_dtype,
                               cpu_offload=args.cpu_offload)
    counter = CollectiveCounter()
    record = Record(counter, 1, Path(args.out))
    qk_clip = QKClip(threshold=QK_THRESHOLD) if args.qk_clip else None
    state = StepState(qk_clip)
    callbacks = [c for c in (qk_clip, record, state) if c is not None]
    if args.offload_activations:
        callbacks.append(ActivationOffload(min_offload_bytes=0))
    trainer = cpu_trainer(strategy, callbacks, args.max_steps, args.ckpt_dir,
                          accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0)
    config = MoEConfig(**{**SHAPE, "attention": args.attention, "document_masking": args.docs,
                          **json.loads(args.config)})
    optimizer = partial(Muon, lr=1e-2, ns_dtype="float32") if args.muon else partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95))
    model = MoELanguageModel(config, optimizer=optimizer, lr_scheduler=partial(WarmupCosineLR, warmup_steps=2))
    data = TextDataModule(source=os.__file__, seq_len=32, batch_size=args.batch_size, val_fraction=0.05)
    with counter.installed():
        trainer.fit(model, data, ckpt_path=args.resume)
    if trainer.is_global_zero:
        out = json.loads(Path(args.out).read_text())
        out.update(max_logits=state.max_logits, clipped_heads=state.clipped, biases=state.biases,
                   tokens_seen=model.tokens_seen)
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
