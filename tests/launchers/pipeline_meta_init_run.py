"""A meta-device build at 2 pipeline stages (``MoEFSDPStrategy(meta_init=True, pipeline_parallel_size=2)``, MTP on
so the last stage holds a copy of the embedding), for tests/parallel/test_pipeline.py. Each rank prints one JSON
line: the weights it initialised (before any step: its embedding, if any, and each block's query projection), and
the two steps' losses. Launched as 2 ranks by ``run_ranks``."""

import json
import os

import lightning as L
import torch
import torch.distributed as dist

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.support.pipeline_model import SHAPE


class InitialWeights(L.Callback):
    def __init__(self):
        self.weights: dict[str, list] = {}
        self.losses: list[float] = []

    def on_fit_start(self, trainer, pl_module):
        for name, p in pl_module.model.named_parameters():
            if name == "tok_embeddings.weight" or name.endswith("attention.wq.weight"):
                self.weights[name] = p.full_tensor().tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    record = InitialWeights()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=2, logger=False,
                        strategy=MoEFSDPStrategy(meta_init=True, pipeline_parallel_size=2, expert_parallel_size=1,
                                                 stall_timeout=0),
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[record])
    model = MoELanguageModel(MoEConfig(**{**SHAPE, "vocab_size": 256, "max_seq_len": 32, "mtp_layers": 1}))
    trainer.fit(model, TextDataModule(source="stdlib", seq_len=32, batch_size=4, max_tokens=20000))
    print(json.dumps({"rank": dist.get_rank(), "weights": record.weights, "losses": record.losses}), flush=True)


if __name__ == "__main__":
    main()
