"""Every fit that ends keeps its final weights (FinalCheckpoint), and a short run resumes from them."""

import os
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.commands.main import run

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = dict(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, ffn_hidden=64,
             num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=0)


def _tiny(tmp_path: Path, name: str, max_steps: int, *extra: str):
    """The README's tiny command, cut to a small batch; validation (every 100 steps) never runs."""
    return run(["fit", "--config", str(TINY), f"--trainer.max_steps={max_steps}",
                f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.logger.init_args.name={name}",
                "--data.init_args.batch_size=2", "--data.init_args.max_tokens=100000",
                "--trainer.enable_progress_bar=false", "--model.init_args.lr_scheduler.init_args.total_steps=24",
                *extra])


@pytest.mark.extended
def test_a_20_step_run_keeps_its_weights_and_resumes_from_them(tmp_path, lightning_log):
    short = _tiny(tmp_path, "short", 20)
    saved = sorted(p for p in Path(short.trainer.log_dir, "checkpoints").iterdir() if p.suffix == ".ckpt")
    assert [p.name for p in saved] == ["epoch=0-step=20.ckpt"]  # no validation ran, yet the weights are kept
    assert any(f"final weights: {saved[0]}" in m for m in lightning_log)
    on_disk = torch.load(saved[0], weights_only=False)["state_dict"]
    assert all(torch.equal(t, short.model.state_dict()[k]) for k, t in on_disk.items())

    with warnings.catch_warnings(record=True) as caught:
        resumed = _tiny(tmp_path, "resumed", 24, f"--ckpt_path={saved[0]}")
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]  # resuming into a new run folder
    straight = _tiny(tmp_path, "straight", 24)
    assert resumed.trainer.global_step == straight.trainer.global_step == 24
    assert resumed.model.tokens_seen == straight.model.tokens_seen  # restored from step 20, not restarted
    for key, tensor in straight.model.state_dict().items():  # 20 + 4 steps equal 24 uninterrupted ones
        torch.testing.assert_close(resumed.model.state_dict()[key], tensor, rtol=0, atol=1e-6, msg=key)
    assert [p.name for p in Path(resumed.trainer.log_dir, "checkpoints").glob("*.ckpt")] == ["epoch=0-step=24.ckpt"]


def _module_and_data():
    L.seed_everything(0)
    return (MoELanguageModel(MoEConfig(**SMALL), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3)),
            TextDataModule("stdlib", seq_len=32, batch_size=2, max_tokens=50_000))


class CtrlCAt(Callback):
    """Sends this process a real SIGINT after micro-batch ``batch_idx``."""

    def __init__(self, batch_idx: int):
        self.batch_idx = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_finishes_the_optimizer_step_saves_and_exits_130(tmp_path, capfd):
    """Ctrl-C goes through Preemption, as SIGTERM does (a plain Trainer: the module adds it)."""
    module, data = _module_and_data()
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under a background shell
    # With 2 micro-batches per step, Ctrl-C after micro-batch 4 (the first of step 3) lands mid-step.
    trainer = L.Trainer(max_steps=50, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                        enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path,
                        callbacks=[CtrlCAt(batch_idx=4)], enable_model_summary=False)
    with pytest.raises(SystemExit) as exit_info:
        trainer.fit(module, data)
    saved = tmp_path / "checkpoints" / "last.ckpt"
    assert exit_info.value.code == 128 + signal.SIGINT
    assert trainer.global_step == 3  # the step was finished, no further one started
    assert torch.load(saved, weights_only=False)["global_step"] == 3
    assert capfd.readouterr().err.strip().endswith(f"interrupted at step 3, checkpoint at {saved}")
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_a_stop_from_a_callback_is_saved_and_checkpointing_off_is_said(tmp_path):
    class StopAt2(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = trainer.global_step >= 2

    module, data = _module_and_data()
    trainer = L.Trainer(max_steps=50, accelerator="cpu", logger=False, enable_progress_bar=False,
                        limit_val_batches=0, default_root_dir=tmp_path / "on", callbacks=[StopAt2()],
                        enable_model_summary=False)
    trainer.fit(module, data)
    assert [p.name for p in (tmp_path / "on" / "checkpoints").glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]

    module, data = _module_and_data()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        limit_val_batches=0, default_root_dir=tmp_path / "off", enable_checkpointing=False,
                        enable_model_summary=False)
    with pytest.warns(UserWarning, match="checkpointing is off .* weights of step 2 were not saved"):
        trainer.fit(module, data)
    assert not (tmp_path / "off").exists() or not list((tmp_path / "off").rglob("*.ckpt"))
