"""Values accepted silently before issue 18 (item 7, and item 6's directory ``--ckpt_path``): refused or warned,
naming the field, before anything is built."""

from pathlib import Path

import pytest

from moe_lightning.commands.main import run
from moe_lightning.model.config import ConfigError, MoEConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
    (["--ib-gbps", "0"], "--ib-gbps=0 must be > 0 (GB/s per GPU per direction)."),  # was: silently the default
    (["--nvlink-gbps", "-450"], "--nvlink-gbps=-450 must be > 0 (GB/s per GPU per direction)."),  # was: negative s
    (["--peak-tflops", "-989"], "--peak-tflops=-989 must be > 0 (dense bf16 TFLOP/s per GPU)."),  # was: negative MFU
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

    override = {"model": {"init_args": {"config": {"n_layers": 2}}}, "data": {"init_args": {"batch_size": 4}},
                "ckpt_path": None}  # a fit-only key, as in a run's saved config.yaml
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


# ---- resuming on other data or another model: refused before the model is built (issue 26, item 14) ----------

@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A 2-step fit on one plain (non-mixture) source; its final checkpoint holds a training position."""
    root = tmp_path_factory.mktemp("plain")
    cli = run(quick(root, "--trainer.max_steps=2"))
    return root, next(Path(cli.trainer.log_dir, "checkpoints").glob("*.ckpt"))


def versions(root) -> list[str]:
    return sorted(p.name for p in root.glob("tiny/version_*"))


@pytest.mark.parametrize("flags, differs", [
    (["--data.init_args.seq_len=64"], "data seq_len: checkpoint 128, requested 64"),
    (["--data.init_args.max_tokens=20000"], "data train_sequences: checkpoint"),  # other data: fewer sequences
    (["--data.init_args.shuffle_seed=1"], "data shuffle_seed: checkpoint 0, requested 1"),
])
def test_resuming_a_plain_run_on_other_data_is_refused_before_anything_is_built(plain_run, flags, differs,
                                                                               lightning_log):
    """Before: the old position was applied to the new windows silently (only a mixture was compared, and only
    once the model was built and the checkpoint being restored)."""
    root, saved = plain_run
    before = versions(root)
    with pytest.raises(ValueError, match="was trained on other data") as error:
        run(quick(root, "--trainer.max_steps=4", f"--ckpt_path={saved}", *flags))
    assert differs in str(error.value)
    assert versions(root) == before  # no config-only version_N left behind
    assert not any("Restoring states" in line for line in lightning_log)  # Lightning never started restoring


def test_resuming_other_text_of_the_same_size_is_refused(plain_run, tmp_path):
    """The same number of sequences of other text: told apart by the tokens of the first and last sequence."""
    root, saved = plain_run
    text = Path(__file__).read_text()
    (tmp_path / "other.txt").write_text((text * (40000 // len(text) + 1))[:40000])
    with pytest.raises(ValueError, match="data fingerprint: checkpoint"):
        run(quick(root, "--trainer.max_steps=4", f"--ckpt_path={saved}",
                  f"--data.init_args.source={tmp_path / 'other.txt'}", "--data.init_args.max_tokens=30000"))


def test_ckpt_path_last_of_another_model_is_refused_before_the_model_is_built(plain_run, lightning_log):
    """``last`` is resolved by the CLI, then checked like an explicit path (before: only when Lightning handed the
    checkpoint to the already built module)."""
    root, _ = plain_run
    before = versions(root)
    with pytest.raises(ValueError, match="model.init_args.config.n_layers: checkpoint 1, requested 2"):
        run(quick(root, "--trainer.max_steps=4", "--ckpt_path=last", "--model.init_args.config.n_layers=2"))
    assert versions(root) == before
    assert not any("Restoring states" in line for line in lightning_log)


def test_the_same_data_resumes(plain_run, lightning_log):
    root, saved = plain_run
    cli = run(quick(root, "--trainer.max_steps=3", f"--ckpt_path={saved}"))
    assert cli.trainer.global_step == 3


def test_a_default_config_run_records_its_config_for_the_resume_check():
    """``config=None`` builds the default ``MoEConfig``; its checkpoint records that config, so a wider model is
    refused against it."""
    import dataclasses

    from moe_lightning import MoELanguageModel
    from moe_lightning.checkpoint.compat import ResumeMismatchError, check_resume

    saved = MoELanguageModel()
    checkpoint = {"hyper_parameters": dict(saved.hparams)}
    saved.on_save_checkpoint(checkpoint)
    assert checkpoint["hyper_parameters"]["config"] == dataclasses.asdict(MoEConfig())
    with pytest.raises(ResumeMismatchError, match=r"config.dim: checkpoint 256, requested 512"):
        check_resume(checkpoint["hyper_parameters"], {"config": MoEConfig(dim=512)}, "x.ckpt")
    assert check_resume(checkpoint["hyper_parameters"], {"config": None}, "x.ckpt") == []
