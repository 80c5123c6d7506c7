"""Commands that do not train never import Lightning (seconds of start-up); ``--help`` imports not even torch."""

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule

from tests.support.distributed import REPO_ROOT, clean_env

PROBE = """
import json, sys
from moe_lightning.commands.main import run
ckpt, repo = sys.argv[1], sys.argv[2]
run(["--help"])
after_help = sorted(m.split(".")[0] for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
run(["plan", "--config", repo + "/configs/16b.yaml"])
run(["export", ckpt, "--out", "model.pt"])
run(["export", ckpt, "--hf", "--out", "hf"])
run(["convert", "hf", "--out", "back.pt"])
run(["generate", "model.pt", "--prompt", "def ", "--max-new-tokens", "3"])
import moe_lightning.data.tokenize.command  # the tokenize command's module
heavy = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")
print(json.dumps({"after_help": sorted(set(after_help)),
                  "imported": sorted(m for m in sys.modules if m.split(".")[0] in heavy)}))
"""


def byte_run_checkpoint(tmp_path: Path) -> Path:
    """A Lightning checkpoint of a 3-step byte-tokenizer run whose model Mixtral can hold (for export --hf)."""
    L.seed_everything(0)
    config = MoEConfig(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, ffn_hidden=64,
                       num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=0, n_dense_layers=0,
                       bias_update_rate=0.0)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=0,
                        default_root_dir=tmp_path, enable_model_summary=False)
    trainer.fit(MoELanguageModel(config, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2)),
                TextDataModule("stdlib", seq_len=32, batch_size=2, max_tokens=20_000))
    return next((tmp_path / "checkpoints").glob("*.ckpt"))


def test_commands_that_do_not_train_never_import_lightning(tmp_path):
    ckpt = byte_run_checkpoint(tmp_path)
    result = subprocess.run([sys.executable, "-c", PROBE, str(ckpt), str(REPO_ROOT)], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["after_help"] == []  # --help: the command table only
    assert report["imported"] == []
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "back.pt").is_file()
