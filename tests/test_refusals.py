"""Values accepted silently before issue 18 (item 7, and item 6's directory ``--ckpt_path``): refused or warned,
naming the field, before anything is built."""

from pathlib import Path

import pytest

from moe_lightning.cli import run
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


def test_plan_composes_several_configs_as_fit_does(tmp_path, capsys):
    """Before: ``plan --config a.yaml --config b.yaml`` planned b.yaml alone (argparse kept the last value)."""
    import json

    import yaml

    override = {"model": {"init_args": {"config": {"n_layers": 2}}}, "data": {"init_args": {"batch_size": 4}}}
    (tmp_path / "override.yaml").write_text(yaml.safe_dump(override))
    merged = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())  # the composition written out by hand
    merged["model"]["init_args"]["config"]["n_layers"] = 2
    merged["data"]["init_args"]["batch_size"] = 4
    (tmp_path / "merged.yaml").write_text(yaml.safe_dump(merged))

    def plan(*configs):
        run(["plan", *[w for c in configs for w in ("--config", str(c))], "--json"])
        result = json.loads(capsys.readouterr().out)
        return result["parameters"], result["inputs"]["micro_batch"], result["memory"]

    composed = plan(CONFIGS / "tiny.yaml", tmp_path / "override.yaml")
    assert composed == plan(tmp_path / "merged.yaml")
    assert composed[1] == [4, "config"] and composed[0] != plan(CONFIGS / "tiny.yaml")[0]


@pytest.fixture
def read_only_cwd(tmp_path, monkeypatch):
    """The working directory on a read-only file system (a tmpfs mounted read-only: needs root, else skipped;
    permission bits alone do not stop root)."""
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here (needs root)")
    monkeypatch.chdir(folder)
    yield folder
    monkeypatch.chdir(tmp_path)
    subprocess.run(["umount", str(folder)], check=True)


def test_fit_from_a_read_only_working_directory_names_the_folder_and_the_setting(read_only_cwd, tmp_path):
    """Before: a 36-line ``OSError: [Errno 30] Read-only file system: 'lightning_logs'`` traceback."""
    argv = [a for a in quick(tmp_path, "--trainer.max_steps=1") if not a.startswith("--trainer.logger.init_args")]
    with pytest.raises(PermissionError) as error:
        run(argv)
    assert str(error.value) == (
        f"cannot create the run's log folder {read_only_cwd / 'lightning_logs'} (Read-only file system): set "
        "trainer.logger.init_args.save_dir to a writable folder (e.g. --trainer.logger.init_args.save_dir="
        "$SCRATCH/logs).")
