"""A tiny training run on a data mixture, launched as real processes by test_data_mixture's slow test.

Each rank writes ``<out>.rank<r>.json``: per step the world-mean loss and the sequences this rank trained on.
``--kill-at-step`` ends every rank with SIGKILL after that step (the last checkpoint is the one before it).
"""

import json
import os
import signal
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.support.fit_launcher import cpu_trainer, fit_arguments, parse

TINY = dict(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, n_dense_layers=1,
            num_experts=4, top_k=2, expert_hidden=32, max_seq_len=16)


class Record(Callback):
    def __init__(self, out: Path, kill_at_step: int):
        self.out, self.kill_at_step, self.rows = out, kill_at_step, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
        self.rows.append({"step": trainer.global_step, "loss": loss.item() / trainer.world_size,
                          "sequences": batch.tolist()})
        self.out.write_text(json.dumps(self.rows))
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = fit_arguments(max_steps=6, checkpoints=True)
    parser.add_argument("--source", required=True, help="data.source as JSON")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    args = parse(parser)

    rank = int(os.environ.get("RANK", "0"))
    record = Record(Path(f"{args.out}.rank{rank}.json"), args.kill_at_step)
    trainer = cpu_trainer(MoEFSDPStrategy(), [record], args.max_steps, args.ckpt_dir)
    model = MoELanguageModel(MoEConfig(**TINY), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    data = TextDataModule(json.loads(args.source), seq_len=16, batch_size=args.batch_size, num_workers=args.workers)
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
