"""The README's paths as a new user runs them: start from a released model with a shipped config, export and
read back the byte tokenizer, one set of sampling flags for generate and predict, load_model as documented."""

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from moe_lightning import cli, hf  # noqa: E402

from .test_cli_imports import byte_run_checkpoint  # noqa: E402
from .test_hf import build_reference  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


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


def test_export_hf_of_a_byte_run_reads_back_in_tokenizers_transformers_and_generate(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    ckpt = byte_run_checkpoint(tmp_path)
    cli.run(["export", str(ckpt), "--hf", "--out", str(tmp_path / "hf")])
    text = "héllo wörld\n\tdef f(x):  return x ✓ 日本"
    ids = list(text.encode("utf-8"))  # the byte tokenizer's ids

    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert tok.encode(text).ids == ids and tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == 256 and tok.decode([*ids, 256]) == text

    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto(text)["input_ids"] == ids  # no BOS or other token added
    assert auto.eos_token_id == 256 and auto.decode(ids) == text
    assert auto.decode([*ids[:3], 256], skip_special_tokens=True) == text[:2]  # "h", "é" (2 bytes)

    capsys.readouterr()
    continuations = []
    for source in (ckpt, tmp_path / "hf"):  # the export continues a prompt exactly as the checkpoint does
        cli.run(["generate", str(source), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"])
        continuations.append(capsys.readouterr().out)
    assert continuations[0] == continuations[1] and continuations[0].startswith("def ")


def test_load_model_unpacks_as_the_readme_writes(tmp_path):
    from moe_lightning.loading import load_model

    ckpt = byte_run_checkpoint(tmp_path)
    model, tokenizer = load_model(ckpt)
    loaded = load_model(ckpt)
    assert not model.training and tokenizer.eos_id == 256 and loaded.kind == "lightning"
    assert all(p.equal(q) for p, q in zip(model.parameters(), loaded.model.parameters()))


def test_test_and_predict_do_not_create_training_run_folders(tmp_path):
    """After ``fit`` wrote ``tiny/version_0``, ``test`` logs to ``tiny-test/``: the README's ``version_0`` paths
    keep naming the training run."""
    common = ["--config", str(CONFIGS / "tiny.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}",
              "--data.init_args.batch_size=2", "--data.init_args.max_tokens=50000",
              "--trainer.enable_progress_bar=false"]
    fit = cli.run(["fit", *common, "--trainer.max_steps=1"])
    ckpt = next(Path(fit.trainer.log_dir, "checkpoints").iterdir())
    cli.run(["test", *common, f"--ckpt_path={ckpt}", "--trainer.limit_test_batches=1"])
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["version_0"]
    assert (tmp_path / "tiny-test" / "version_0" / "metrics.csv").is_file()
