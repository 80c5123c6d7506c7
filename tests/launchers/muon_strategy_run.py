"""A few Muon training steps through Lightning (one process, or MoEFSDPStrategy ranks); rank 0 writes the
world-mean loss of every step as JSON. Launched by tests/optim/test_flexshard.py."""

import json
import os
from functools import partial
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import Muon, WarmupCosineLR
from tests.launchers.strategy_run import TINY
from tests.support.fit_launcher import cpu_trainer, fit_arguments, fsdp_or_single, parse, world_size


class Losses(Callback):
    def __init__(self, out: Path):
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item())
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"losses": self.losses, "start": trainer.global_step - len(self.losses)}))


def main() -> None:
    parser = fit_arguments(max_steps=4, checkpoints=True)
    parser.add_argument("--ep", type=int, default=0, help="0: one process without a strategy")
    args = parse(parser)
    strategy = fsdp_or_single(not args.ep, expert_parallel_size=args.ep)
    trainer = cpu_trainer(strategy, [Losses(Path(args.out))], args.max_steps, args.ckpt_dir)
    model = MoELanguageModel(MoEConfig(**TINY), optimizer=partial(Muon, lr=1e-2),
                             lr_scheduler=partial(WarmupCosineLR, warmup_steps=2))
    data = TextDataModule(source=os.__file__, seq_len=32, batch_size=4 // world_size(), val_fraction=0.05)
    trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
