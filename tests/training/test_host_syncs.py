"""Every value a training step reads back to the host, counted on CPU, under MoEFSDPStrategy.

On a GPU each ``Tensor.item``/``tolist``/``cpu``/``bool``/``float``/``int`` of a device tensor blocks the host
until the device catches up, and so does the other direction: ``torch.tensor``/``as_tensor`` of a Python number
on the device is a pageable host-to-device copy (Lightning's ``self.log`` of a float does one per value). The
probe patches those methods and functions from the start of one batch to the start of the next (so every hook
of the step is inside) and records the innermost frame of torch.optim, this package or Lightning that called
them. Allowed: AdamW's reads of its step counters (host tensors, no device sync), and, only on steps whose logs
are written, the logged values, the logged counters (tokens seen, offload counts) and the non-finite guard's
one read.
"""

import numbers
import traceback
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import moe_lightning
from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.training.strategy import MoEFSDPStrategy

READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
FROM_NUMBERS = ("tensor", "as_tensor")  # torch functions that copy Python numbers into a (device) tensor
ROOTS = [str(Path(torch.__file__).parent / "optim"), str(Path(moe_lightning.__file__).parent),
         str(Path(L.__file__).parent)]


class HostReads(L.Callback):
    def __init__(self):
        self.steps: list[Counter] = []
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}
        self._factories = {name: getattr(torch, name) for name in FROM_NUMBERS}

    def _site(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if any(frame.filename.startswith(root) for root in ROOTS):
                return f"{Path(frame.filename).name}:{frame.name}"
        return "elsewhere"

    def _patch(self, counter: Counter) -> None:
        for name, original in self._originals.items():
            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                counter[f"{_name} {self._site()}"] += 1
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        for name, original in self._factories.items():
            def from_number(data, *args, _name=name, _original=original, **kwargs):
                numeric = isinstance(data, numbers.Number) or (isinstance(data, (list, tuple)) and data and all(
                    isinstance(x, numbers.Number) for x in data))
                if numeric and kwargs.get("device") is not None:  # without a device: a host tensor, no copy
                    counter[f"{_name}(number) {self._site()}"] += 1
                return _original(data, *args, **kwargs)
            setattr(torch, name, from_number)

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in self._factories.items():
            setattr(torch, name, original)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.restore()
        self.steps.append(Counter())
        self._patch(self.steps[-1])

    def on_train_end(self, trainer, pl_module):
        self.restore()


def test_a_training_step_reads_back_only_what_is_allowed():
    config = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                       num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.01)
    probe = HostReads()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFSDPStrategy(), max_steps=4, log_every_n_steps=2,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        callbacks=[probe, ActivationOffload(min_offload_bytes=0)])
    try:
        trainer.fit(MoELanguageModel(config, loss_chunk_size=8), DataLoader(torch.randint(0, 64, (8, 17)), batch_size=2))
    finally:
        probe.restore()
    n_params = sum(1 for _ in trainer.lightning_module.parameters())
    assert len(probe.steps) == 4
    for step, reads in enumerate(probe.steps):
        reads = Counter(reads)
        assert reads.pop("item optimizer.py:_get_value") == n_params  # AdamW's host-side step counters
        if step == 0:  # AdamW creates its step counters, on the host (``device="cpu"``; torch 2.13, not 2.11)
            assert reads.pop("tensor(number) adam.py:_init_group", n_params) == n_params
        if step < 2:  # Lightning creates its result objects (with device zeros) when a key is first logged
            reads.pop("tensor(number) result.py:__init__", None)
        if (step + 1) % 2 == 0:  # logs written: Lightning turns the logged tensors into numbers, the guard reads once
            assert reads.pop("tolist nonfinite.py:_max_over_ranks") == 1
            reads.pop("item apply_func.py:to_item", None)  # what the loggers receive (none here)
            # tokens seen and the 3 offload counters: logged, as Python numbers, only when they are written
            assert reads.pop("tensor(number) module.py:__to_tensor") == 4
        assert not reads, f"step {step} reads back {dict(reads)}"
