"""Eager, then compiled: the same tiny fit under MoEFSDPStrategy + ActivationOffload (launched as real processes).

Rank 0 writes JSON: each run's per-step losses (world mean), the block classes and the bytes offloaded.
Compiles with ``aot_eager`` (see ``tests/parallel/test_compile.py``).
"""

import argparse
import dataclasses
import json
import os
from functools import partial
from pathlib import Path
from unittest import mock

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoELanguageModel, TextDataModule
from moe_lightning.parallel import parallelize as parallelize_lib
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.parallel.compile import compile_blocks
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.parallel.test_compile import CONFIG


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def fit(compile: bool, ep: int) -> tuple[list[float], list[str], int]:
    L.seed_everything(0, verbose=False)
    losses, offload = Losses(), ActivationOffload(prefetch=1, min_offload_bytes=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEFSDPStrategy(expert_parallel_size=ep), max_steps=2,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[losses, offload])
    model = MoELanguageModel(dataclasses.replace(CONFIG, vocab_size=320), compile=compile,
                             optimizer=partial(torch.optim.AdamW, lr=1e-2))
    data = TextDataModule(source=os.__file__, seq_len=16, batch_size=2, val_fraction=0.05)
    trainer.fit(model, data)
    return losses.losses, [type(block).__name__ for block in model.model.layers], offload.bytes_offloaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    eager, _, _ = fit(False, args.ep)
    with mock.patch.object(parallelize_lib, "compile_blocks", partial(compile_blocks, backend="aot_eager")):
        compiled, classes, offloaded = fit(True, args.ep)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps({"eager": eager, "compiled": compiled, "compiled_classes": classes,
                                              "offloaded": offloaded}))


if __name__ == "__main__":
    main()
