"""A test-only callback for tests/launchers/pipeline_fit_run.py (``--offload``): what ``ActivationOffload`` did on
each rank in each optimizer step. Every rank writes ``<out>.rank<r>.json``: per step the callback's counters (reset
at each batch start, so summed over the step's micro-batches) and, from its ``order`` (the last micro-batch's
forward onwards), the names of the blocks whose inputs it offloaded and of those it kept on the device."""

import json
from pathlib import Path

import lightning as L
import torch.distributed as dist

from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.training.callbacks.activation_offload import find_blocks, find_mtp_blocks


class OffloadProbe(L.Callback):
    def __init__(self, out: str | Path):
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        offload = next(c for c in trainer.callbacks if isinstance(c, ActivationOffload))
        # the callback's block positions: the rank's blocks (keys are the whole model's indices), then MTP's
        names = [f"layers.{key}" for key in find_blocks(pl_module)._modules] + \
            [f"mtp.{k}.block" for k in range(len(find_mtp_blocks(pl_module)))]
        self.rows.append({"step": trainer.global_step, "bytes": offload.bytes_offloaded,
                          "out": offload.tensors_offloaded, "in": offload.tensors_copied_in,
                          "offloaded": sorted({names[i] for kind, i in offload.order if kind == "offload"}),
                          "kept": sorted({names[i] for kind, i in offload.order if kind == "keep"})})
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.out.with_name(f"{self.out.name}.rank{rank}.json").write_text(json.dumps(self.rows))
