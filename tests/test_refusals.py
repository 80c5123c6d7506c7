"""Values accepted silently before issue 18 (item 7, and item 6's directory ``--ckpt_path``): refused or warned,
naming the field, before anything is built."""

from pathlib import Path

import pytest

from moe_lightning.commands import run
from moe_lightning.model.config import ConfigError, MoEConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def quick(tmp_path, *extra: str) -> list[str]:
    return ["fit", "--config", str(CONFIGS / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.max_tokens=30000",
            "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]", "--trainer.enable_model_summary=false",
            "--trainer.limit_val_batches=0", "--data.init_args.batch_size=2", "--model.init_args.config.n_layers=1",
            *extra]


def nothing_ran(tmp_path) -> bool:
    return not list(tmp_path.glob("tiny/version_*"))


@pytest.mark.parametrize("value", [0, -64])
def test_head_dim_must_be_positive(value):
    """Before: head_dim=0 passed (0 is even) and the model had empty attention heads."""
    with pytest.raises(ConfigError, match=rf"MoEConfig.head_dim={value}: must be a positive even integer, or null"):
        MoEConfig(head_dim=value)


def test_mla_warns_about_the_gqa_widths_it_ignores():
    with pytest.warns(UserWarning, match=r"MoEConfig.n_kv_heads=8 and head_dim=64: ignored with attention='mla'"):
        MoEConfig(attention="mla", n_kv_heads=8, head_dim=64)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoEConfig(attention="mla")  # the defaults, and n_kv_heads = n_heads as the DeepSeek import writes it
        MoEConfig(attention="mla", n_heads=8, n_kv_heads=8)


def test_negative_gradient_clip_val_is_refused_before_the_run(tmp_path):
    """Before: accepted, and clipping multiplied every gradient by min(1, -1 / norm) < 0: training went uphill."""
    with pytest.raises(ValueError, match=r"trainer.gradient_clip_val=-1: must be >= 0"):
        run(quick(tmp_path, "--trainer.gradient_clip_val=-1"))
    assert nothing_ran(tmp_path)


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory", "0"], "--gpu-memory=0 must be > 0 (GiB per GPU)."),
    (["--gpu-memory", "-80"], "--gpu-memory=-80 must be > 0 (GiB per GPU)."),
    (["--seq-len", "4096"], "--seq-len=4096 exceeds model.init_args.config.max_seq_len=128: the model cannot "
                            "train on longer sequences; lower it or raise max_seq_len."),
])
def test_plan_refuses_impossible_hardware_and_sequences(flags, message, capsys):
    with pytest.raises(SystemExit):
        run(["plan", "--config", str(CONFIGS / "tiny.yaml"), *flags])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_a_directory_that_is_not_a_checkpoint_is_refused_before_the_model_is_built(tmp_path):
    """Before: a raw IsADirectoryError after the model was built."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "epoch=0-step=5.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"checkpoints' is a directory but not a checkpoint .* It holds "
                                         r"epoch=0-step=5.ckpt: pass one of those."):
        run(quick(tmp_path, f"--ckpt_path={folder}"))
    assert nothing_ran(tmp_path)


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bytes")
    path = folder / "one.ckpt"
    run(quick(folder, "--trainer.max_steps=1", "--trainer.logger=false")).trainer.save_checkpoint(path)
    return path


def word_level_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_a_tokenizer_other_than_the_checkpoints_is_refused_for_fit_and_predict(byte_checkpoint, tmp_path):
    """Before: fit resumed a byte-level model on another tokenizer's ids (predict silently used the recorded one)."""
    other = word_level_tokenizer(tmp_path / "tokenizer.json")
    expected = (rf"data.init_args.tokenizer='{other}' is not the tokenizer ckpt_path='{byte_checkpoint}' was trained "
                r"with \(the byte-level tokenizer\): .* leave data.init_args.tokenizer unset.")
    with pytest.raises(ValueError, match=expected):
        run(quick(tmp_path, "--trainer.max_steps=2", f"--ckpt_path={byte_checkpoint}",
                  f"--data.init_args.tokenizer={other}"))
    assert nothing_ran(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=expected):
        run(["predict", "--config", str(CONFIGS / "tiny.yaml"), "--trainer.logger=false", "--model.init_args.config.n_layers=1",
             f"--ckpt_path={byte_checkpoint}", f"--data.init_args.tokenizer={other}", f"--prompts={prompts}",
             f"--out={tmp_path / 'out.jsonl'}"])
    assert not (tmp_path / "out.jsonl").exists()
