"""The README's paths as a new user runs them: start from a released model with a shipped config, export and
read back the byte tokenizer, one set of sampling flags for generate and predict, load_model as documented."""

import logging
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from moe_lightning import cli, hf  # noqa: E402

from .test_hf import build_reference  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture
def lightning_log():
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_readme_fit_from_a_released_model_with_the_tiny_config(family, tmp_path, lightning_log):
    """``moe-lightning fit --config configs/tiny.yaml --model.init_args.pretrained <HF folder>``: tiny.yaml sizes a
    GQA model of dim 128; the folder's shape (dim 32, and MLA for DeepSeek-V3) replaces it, tiny's training
    settings (max_seq_len 128) stay, and the log names every replaced field."""
    path = tmp_path / family
    build_reference(family).save_pretrained(path)
    run = cli.run(["fit", "--config", str(CONFIGS / "tiny.yaml"), "--model.init_args.pretrained", str(path),
                   "--trainer.max_steps=2", f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--data.init_args.batch_size=2", "--data.init_args.max_tokens=50000",
                   "--trainer.enable_progress_bar=false"])
    assert run.trainer.global_step == 2
    assert run.model.config.max_seq_len == 128  # tiny's training setting
    shape = hf.load_config(path)
    assert run.model.config.dim == shape.dim == 32 and run.model.config.attention == shape.attention
    assert run.model.config == shape.__class__(**{**shape.__dict__, "max_seq_len": 128})
    replaced = next(m for m in lightning_log if "gives the model's shape; replaced from the config" in m)
    assert "dim=128 -> 32" in replaced and "ffn_hidden=384 -> 48" in replaced and "max_seq_len" not in replaced
