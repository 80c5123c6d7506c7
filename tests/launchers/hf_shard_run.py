"""Load a Hugging Face directory under MoEFSDPStrategy (launched as real ranks by tests/hf/test_mapping.py).

Each rank writes JSON: whether every parameter it holds (gathered to global tensors) equals a one-process
``hf.from_pretrained``, their names, the bytes it read per checkpoint key; then a sharded checkpoint of the loaded
model is saved. ``--pp 2``: each rank holds a pipeline stage.
"""

import argparse
import json
import os
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule, hf
from moe_lightning.hf import files
from moe_lightning.checkpoint import sharded as ckpt
from moe_lightning.training.strategy import MoEFSDPStrategy

READS: dict[str, int] = {}


class CountingSlice:
    """Records the bytes each ``get_slice(key)[region]`` returns."""

    def __init__(self, key, inner):
        self.key, self.inner = key, inner

    def __getitem__(self, index):
        tensor = self.inner[index]
        READS[self.key] = READS.get(self.key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def get_shape(self):
        return self.inner.get_shape()


original_get = files.SafetensorsDir.get
files.SafetensorsDir.get = lambda self, key: CountingSlice(key, original_get(self, key))


class Compare(Callback):
    def __init__(self, reference: dict[str, torch.Tensor], out: Path):
        self.reference, self.out = reference, out

    def on_fit_start(self, trainer, pl_module):
        mismatched = []
        names = ckpt.expert_parameter_names(pl_module)
        with ckpt.global_expert_views(pl_module.state_dict(), names, trainer.strategy.parallel.expert) as state:  # [E, ...]
            for name, tensor in state.items():
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if not torch.equal(full.cpu(), self.reference[name[len("model."):]]):
                    mismatched.append(name)
        self.out.write_text(json.dumps({"mismatched": mismatched, "compared": len(state), "names": sorted(state),
                                        "reads": READS}))
        trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, help="strategy.pipeline_parallel_size")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True, help="sharded checkpoint written after loading")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    reference = hf.from_pretrained(args.pretrained, torch.float32).state_dict()
    READS.clear()  # count only the strategy's reads
    rank = int(os.environ.get("RANK", "0"))
    strategy = MoEFSDPStrategy(expert_parallel_size=args.ep, pipeline_parallel_size=args.pp)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                        strategy=strategy, max_steps=1, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, precision="32-true",
                        callbacks=[Compare(reference, Path(f"{args.out}.{rank}"))])
    # lr 0 and no bias updates: the checkpoint written after fit must hold exactly the loaded weights
    model = MoELanguageModel(MoEConfig(bias_update_rate=0.0), pretrained=args.pretrained,
                             optimizer=partial(torch.optim.AdamW, lr=0.0))
    trainer.fit(model, TextDataModule(source=os.__file__, seq_len=16, batch_size=2, val_fraction=0.05))
    trainer.save_checkpoint(args.ckpt)


if __name__ == "__main__":
    main()
