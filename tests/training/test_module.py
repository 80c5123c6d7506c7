"""``MoELanguageModel`` across Lightning's entry points in one process (the default strategy, not ours)."""

import os
from functools import partial

import lightning as L
import pytest
import torch

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.optim import WarmupCosineLR


def module() -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoEConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, init_std=0.3)
    return MoELanguageModel(config, optimizer=partial(torch.optim.AdamW, lr=3e-3),
                            lr_scheduler=partial(WarmupCosineLR, warmup_steps=1))


@pytest.mark.parametrize("first", ["test", "validate"])
def test_an_evaluation_then_fit_on_one_trainer_with_the_default_strategy(first, tmp_path):
    """Issue 33 (1): a standalone test/validate runs under ``torch.inference_mode`` with Lightning's own strategy, so
    the held-out metric's state became inference tensors and fit's validation failed updating them in place. The
    metric's state is made afresh when each evaluation epoch starts; the validation inside fit gives the loss a
    standalone validation of the same weights gives."""
    data = TextDataModule(os.__file__, seq_len=32, batch_size=4, val_fraction=0.05)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=2, val_check_interval=2, limit_val_batches=2, limit_test_batches=2,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    model = module()
    assert trainer.test_loop.inference_mode  # the mode under which the failure happened
    getattr(trainer, first)(model, data, verbose=False)
    trainer.fit(model, data)
    assert trainer.global_step == 2
    fitted = trainer.callback_metrics["val/loss"].item()
    again = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2, default_root_dir=tmp_path).validate(model, data, verbose=False)[0]
    assert 0 < fitted < 10 and again["val/loss"] == pytest.approx(fitted, rel=1e-6)
