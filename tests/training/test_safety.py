"""No silent failures: diverging runs stop, resumes refuse another model, errors read as ours, nothing is left half done."""

import csv
import dataclasses
import math
import subprocess
import sys
import traceback
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.callbacks import FinalCheckpoint, NonFiniteGuard, NonFiniteLossError
from moe_lightning.run.locks import LOCK_FILE
from moe_lightning.training.callbacks.preemption import Preemption
from moe_lightning.commands.cli import default_precision
from moe_lightning.commands.main import run
from moe_lightning.model.config import ConfigError
from moe_lightning.checkpoint.commit import MARKER_FILE
from moe_lightning.checkpoint.compat import ResumeMismatchError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny.yaml"
SMALL = dict(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, ffn_hidden=64,
             num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=0)


def quick(tmp_path, *extra: str) -> list[str]:
    """Arguments for a few-second CLI run of the tiny config with its logs under ``tmp_path``."""
    return ["fit", "--config", str(TINY), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--data.init_args.max_tokens=30000",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.limit_val_batches=0", "--data.init_args.batch_size=4", *extra]


def last_lines(error: BaseException, n: int = 3) -> str:
    """What the user reads at the bottom of the traceback Python prints for ``error``."""
    lines = [line for line in "".join(traceback.format_exception(error)).splitlines() if line.strip()]
    return "\n".join(lines[-n:])


# ---- 1. diverging runs ------------------------------------------------------------------------

def diverging_fit(tmp_path, callbacks, lr=1e6, max_steps=12):
    L.seed_everything(0)
    module = MoELanguageModel(MoEConfig(**SMALL, init_std=0.3),
                              optimizer=partial(torch.optim.AdamW, lr=lr), lr_scheduler=partial(
                                  torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 1.0))
    data = TextDataModule("stdlib", seq_len=32, batch_size=4, max_tokens=20000)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, log_every_n_steps=1, limit_val_batches=0,
                        logger=CSVLogger(tmp_path, name="run", version=0), callbacks=callbacks,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(NonFiniteLossError) as error:
        trainer.fit(module, data)
    return str(error.value), trainer


class RecordLosses(Callback):
    """An independent record: each micro-batch's loss by the optimizer steps taken before it."""

    def __init__(self):
        self.losses = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[self.step] = outputs["loss"].item()


def test_diverging_run_stops_at_the_next_check_naming_the_first_nonfinite_step(tmp_path):
    """lr=1e6 used to train to the end and exit 0. The guard reads its on-device count every 4 steps only."""
    record = RecordLosses()
    message, trainer = diverging_fit(tmp_path, [record, NonFiniteGuard(check_every_n_steps=4)])
    losses = record.losses
    first_bad = min(step for step, loss in losses.items() if not math.isfinite(loss))
    assert all(math.isfinite(losses[s]) for s in losses if s < first_bad)
    assert f"at step {first_bad} " in message
    assert trainer.global_step == 4 * math.ceil((first_bad + 1) / 4)  # stopped at the first check after it
    assert trainer.global_step < 12
    for fix in ("learning rate", "gradient_clip_val", "bf16-mixed"):
        assert fix in message


def test_no_checkpoint_with_a_nonfinite_tensor_is_written_and_earlier_ones_stay(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    message, trainer = diverging_fit(tmp_path, [saver])  # the guard comes from MoELanguageModel itself
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert saved, "the steps before divergence were checkpointed"
    for path in saved:
        checkpoint = torch.load(path, weights_only=False)  # our own file; its hparams pickle MoEConfig
        tensors = list(checkpoint["state_dict"].values()) + [
            t for state in checkpoint["optimizer_states"][0]["state"].values() for t in state.values()]
        assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point()), path
    last = max(int(p.stem.split("=")[1]) for p in saved)
    assert f"up to step {last}" in message
    assert trainer.global_step == last + 1  # the step whose save was refused


def test_model_adds_the_guard_once():
    module = MoELanguageModel(MoEConfig(**SMALL))
    assert [type(c) for c in module.configure_callbacks()] == [NonFiniteGuard, Preemption, FinalCheckpoint]
    trainer = L.Trainer(accelerator="cpu", callbacks=[NonFiniteGuard(check_every_n_steps=1)], logger=False)
    module.trainer = trainer
    assert [type(c) for c in module.configure_callbacks()] == [Preemption, FinalCheckpoint]  # the config's guard


# ---- 2. resuming a different model ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    cli = run(quick(folder, "--trainer.max_steps=1"))
    path = folder / "tiny.ckpt"
    cli.trainer.save_checkpoint(path)
    return path


def test_resume_of_another_shape_is_refused_listing_each_field(tiny_checkpoint, tmp_path):
    with pytest.raises(ResumeMismatchError) as error:
        run(quick(tmp_path, "--trainer.max_steps=2", f"--ckpt_path={tiny_checkpoint}",
                  "--model.init_args.config.dim=64", "--model.init_args.config.num_experts=4"))
    message = str(error.value)
    assert "model.init_args.config.dim: checkpoint 128, requested 64" in message
    assert "model.init_args.config.num_experts: checkpoint 8, requested 4" in message
    assert "head_dim: checkpoint 32, requested 16" in message  # derived fields compared too
    assert "--config" in message
    assert not list(tmp_path.glob("tiny/version_*"))  # refused before anything ran


def test_resume_takes_the_command_lines_coefficients_and_says_so(tiny_checkpoint, tmp_path, lightning_log):
    """LightningCLI used to re-parse the checkpoint's hyperparameters over these (aux_loss_coef back to 0)."""
    cli = run(quick(tmp_path, "--trainer.max_steps=2", f"--ckpt_path={tiny_checkpoint}",
                    "--model.init_args.config.aux_loss_coef=0.01", "--model.init_args.weight_decay=0.05",
                    "--model.init_args.optimizer.init_args.lr=0.006"))
    assert cli.model.config.aux_loss_coef == 0.01 and cli.model.weight_decay == 0.05
    assert cli.trainer.global_step == 2  # resumed at step 1
    # The restored optimizer state carried lr 0.003 and weight decay 0.1; the requested values win, and the LR
    # keeps its place in the schedule: after 2 steps of 30-step warmup it is 0.006 * 3/30.
    groups = {g["role"]: g for g in cli.trainer.optimizers[0].param_groups}
    assert groups["hidden_matrix"]["weight_decay"] == 0.05 and groups["norm"]["weight_decay"] == 0.0
    assert groups["hidden_matrix"]["lr"] == pytest.approx(0.006 * 3 / 30, rel=1e-9)
    assert any("optimizer initial_lr: checkpoint 0.003, requested 0.006" in m for m in lightning_log)
    assert ("resume: model.init_args.config.aux_loss_coef: checkpoint 0.0, requested 0.01 "
            "(using the requested value)") in lightning_log
    assert any("model.init_args.weight_decay: checkpoint 0.1, requested 0.05" in m for m in lightning_log)


def test_every_resume_path_checks_the_model_before_loading_weights():
    """``--ckpt_path best``, remote files and ``Trainer.fit(ckpt_path=...)`` from Python never reach the CLI's
    early check: the module checks the checkpoint's config when Lightning hands it over, before any weight is
    loaded; a default-config run records its config too."""
    saved = MoELanguageModel()  # config=None: the default MoEConfig
    checkpoint = {"hyper_parameters": dict(saved.hparams)}
    saved.on_save_checkpoint(checkpoint)
    assert checkpoint["hyper_parameters"]["config"]["dim"] == MoEConfig().dim
    wider = MoELanguageModel(MoEConfig(dim=2 * MoEConfig().dim))
    with pytest.raises(ResumeMismatchError, match=r"the checkpoint being restored holds a different model(.|\n)*"
                                                  r"config.dim: checkpoint 256, requested 512"):
        wider.on_load_checkpoint(checkpoint)
    MoELanguageModel().on_load_checkpoint(checkpoint)  # the same model resumes


def test_python_fit_from_a_checkpoint_of_another_function_is_refused_before_weights_load(tiny_checkpoint, tmp_path):
    """Same shapes, other rope_theta: the weights would load and mean something else."""
    tiny = yaml.safe_load(TINY.read_text())
    other = MoELanguageModel(MoEConfig(**{**tiny["model"]["init_args"]["config"], "rope_theta": 1234.0}))
    data = TextDataModule(**{**tiny["data"]["init_args"], "max_tokens": 30000, "batch_size": 4})
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ResumeMismatchError, match="config.rope_theta: checkpoint 10000.0, requested 1234.0"):
        trainer.fit(other, data, ckpt_path=tiny_checkpoint)
    assert trainer.global_step == 0


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict-config", "dataclass-config"])
def test_sharded_checkpoint_of_another_shape_is_refused_before_loading(tmp_path, as_dict):
    """A sharded checkpoint is a folder with meta.pt; its tensors are never touched (a shape mismatch used to
    surface as a tensor-size error from inside DCP)."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    config = MoEConfig(**{**yaml.safe_load(TINY.read_text())["model"]["init_args"]["config"], "n_layers": 6})
    torch.save({"hyper_parameters": {"config": dataclasses.asdict(config) if as_dict else config,
                                     "weight_decay": 0.1}}, folder / "meta.pt")
    with pytest.raises(ResumeMismatchError, match="config.n_layers: checkpoint 6, requested 4"):
        run(quick(tmp_path, f"--ckpt_path={folder}"))


def test_cli_resume_checks_text_data_from_the_runs_tokenized_folder(tmp_path, monkeypatch):
    """Was: the data check set the data up before the trainer was attached, so every rank tokenized the whole
    text corpus in memory at every resume (and the run kept that copy)."""
    import os
    import moe_lightning.data.module as data_module
    text = os.path.dirname(os.__file__) + "/json"
    args = [a for a in quick(tmp_path, f"--data.init_args.source={text}") if "max_tokens" not in a]
    first = run([*args, "--trainer.max_steps=1"])
    first.trainer.save_checkpoint(tmp_path / "one.ckpt")
    [folder] = (tmp_path / "tiny" / "tokenized").iterdir()
    assert (folder / "manifest.json").is_file()

    def in_memory(*args, **kwargs):
        raise AssertionError("tokenized in memory")
    monkeypatch.setattr(data_module, "open_tokens", in_memory)
    assert run([*args, "--trainer.max_steps=2", f"--ckpt_path={tmp_path / 'one.ckpt'}"]).trainer.global_step == 2
    with pytest.raises(ResumeMismatchError, match="data shuffle_seed: checkpoint 0, requested 1"):
        run([*args, "--trainer.max_steps=2", f"--ckpt_path={tmp_path / 'one.ckpt'}", "--data.init_args.shuffle_seed=1"])


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluating_ckpt_path_last_is_refused_in_one_line(tmp_path, subcommand):
    """Lightning only warns that "last" found nothing and evaluates untrained weights."""
    args = [subcommand, "--config", str(TINY), f"--trainer.logger.init_args.save_dir={tmp_path}", "--ckpt_path=last"]
    with pytest.raises(ValueError, match=r"^--ckpt_path last is for fit .*pass --ckpt_path=<checkpoint file>"):
        run(args + ([f"--prompts={tmp_path / 'p.jsonl'}"] if subcommand == "predict" else []))


def test_resume_check_without_a_config_compares_with_the_default_model():
    """``config=None`` builds ``MoEConfig()``; a checkpoint saved before a field existed takes its default."""
    from moe_lightning.checkpoint.compat import check_resume
    saved = {k: v for k, v in dataclasses.asdict(MoEConfig(dim=128, n_heads=4)).items() if k != "init_std"}
    with pytest.raises(ResumeMismatchError, match="config.dim: checkpoint 128, requested 256"):
        check_resume({"config": saved}, {"config": None}, "x.ckpt")
    assert check_resume({"config": dataclasses.asdict(MoEConfig())}, {"config": MoEConfig(z_loss_coef=0.1)},
                        "x.ckpt") == ["resume: model.init_args.config.z_loss_coef: checkpoint 0.0, requested 0.1 "
                                      "(using the requested value)"]


# ---- 4. readable errors -----------------------------------------------------------------------

def test_invalid_config_value_ends_with_our_message_not_a_namespace_dump(tmp_path):
    with pytest.raises(ConfigError) as error:
        run(quick(tmp_path, "--model.init_args.config.top_k=9"))
    bottom = last_lines(error.value)
    assert bottom.endswith("MoEConfig.top_k=9 exceeds num_experts=8: lower top_k or add experts.")
    assert "Union subtypes" not in bottom and "Namespace(" not in "".join(traceback.format_exception(error.value))


def test_parse_error_ends_with_a_one_line_summary_naming_the_key(tmp_path, capfd, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        run(quick(tmp_path, "--model.init_args.config.top_k=abc"))
    assert exit_info.value.code == 2
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines == ["moe-lightning fit: error: model.config.top_k: Expected a <class 'int'>. Got value: abc "
                     "(see moe-lightning fit --help)"]


def test_invalid_data_value_ends_with_our_message(tmp_path):
    with pytest.raises(ValueError) as error:
        run(quick(tmp_path, "--data.init_args.val_fraction=0.9"))
    assert last_lines(error.value, 1).endswith("data.val_fraction=0.9 must be in (0, 0.5].")


def test_seq_len_beyond_the_model_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len=256 exceeds model.config.max_seq_len=128"):
        run(quick(tmp_path, "--data.init_args.seq_len=256", "--trainer.fast_dev_run=true"))


# ---- 5. the logged training loss is the whole batch's -----------------------------------------

def step0_loss(tmp_path: Path, *extra: str) -> float:
    from tests.support.distributed import clean_env, free_port

    tmp_path.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "moe_lightning", "fit", "--config", str(CONFIGS / "tiny-fsdp.yaml"),
         "--trainer.max_steps=1", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
         "--trainer.callbacks=[]", "--data.init_args.max_tokens=30000", "--trainer.enable_progress_bar=false",
         f"--trainer.logger.init_args.save_dir={tmp_path}", *extra],
        env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), cwd=tmp_path,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.glob("tiny-fsdp/version_0/metrics.csv")))))
    return float(next(r["train/loss"] for r in rows if r["step"] == "0" and r.get("train/loss")))


@pytest.mark.slow  # multi-process; .ci/run runs it after the main suite
def test_two_processes_log_the_loss_of_the_global_batch(tmp_path):
    """Same seed, same global batch of 16: 2 ranks x 8 under MoEFSDPStrategy (ep=2) and 1 process x 16.
    The step-0 losses are means over the same 16 sequences with the same weights (fp32; 1e-5 covers summation
    order). Before, rank 0 logged its own 8 sequences' loss."""
    two = step0_loss(tmp_path / "two")
    one = step0_loss(tmp_path / "one", "--trainer.devices=1", "--trainer.strategy=auto",
                     "--data.init_args.batch_size=16")
    assert two == pytest.approx(one, abs=1e-5)


def test_logged_loss_under_accumulation_is_the_mean_of_the_steps_micro_batches(tmp_path):
    record = RecordMicroBatchLosses()
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=3, log_every_n_steps=1,
                        limit_val_batches=0, logger=CSVLogger(tmp_path, name="run", version=0), callbacks=[record],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MoELanguageModel(MoEConfig(**SMALL, init_std=0.3)),
                TextDataModule("stdlib", seq_len=32, batch_size=2, max_tokens=20000))
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    assert len(record.losses) == 3
    # Lightning hands callbacks each micro-batch's loss / accumulate_grad_batches, so their sum is the mean.
    assert float(rows[0]["train/loss"]) == pytest.approx(sum(record.losses), rel=1e-6)  # fp32 sum of 3


class RecordMicroBatchLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


# ---- 7. configs that extend configs; one weight decay -----------------------------------------

def printed_config(*args: str, capsys) -> dict:
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(TINY), *args, "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def test_second_config_appends_callbacks_with_plus_and_replaces_without(tmp_path, capsys):
    extra = {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"}
    (tmp_path / "append.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks+": [extra]}}))
    (tmp_path / "replace.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [extra]}}))
    appended = printed_config("--config", str(tmp_path / "append.yaml"), capsys=capsys)["trainer"]["callbacks"]
    replaced = printed_config("--config", str(tmp_path / "replace.yaml"), capsys=capsys)["trainer"]["callbacks"]
    first = [c["class_path"] for c in yaml.safe_load(TINY.read_text())["trainer"]["callbacks"]]
    assert [c["class_path"] for c in appended] == first + [extra["class_path"]] and len(first) >= 3
    assert [c["class_path"] for c in replaced] == [extra["class_path"]]


def test_optimizer_weight_decay_conflicting_with_the_models_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"optimizer.init_args.weight_decay=0.05 conflicts with "
                                         r"model.init_args.weight_decay=0.1.*Set model.init_args.weight_decay=0.05"):
        run(quick(tmp_path, "--model.init_args.optimizer.init_args.weight_decay=0.05"))


def test_agreeing_weight_decays_train_with_that_value(tmp_path):
    cli = run(quick(tmp_path, "--model.init_args.optimizer.init_args.weight_decay=0.05",
                    "--model.init_args.weight_decay=0.05", "--trainer.fast_dev_run=true"))
    decay = {g["role"]: g["weight_decay"] for g in cli.trainer.optimizers[0].param_groups}
    assert decay["hidden_matrix"] == decay["expert_stack"] == 0.05 and decay["norm"] == decay["embedding"] == 0.0


# ---- 8. nothing half done is left behind ------------------------------------------------------

def test_a_new_run_folder_is_not_called_a_previous_runs_whose_logs_will_be_deleted(tmp_path):
    """Every fit warned "version_0 exists and is not empty. Previous log files in this directory will be deleted":
    what the logger found there was this run's own lock and config."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(quick(tmp_path, "--trainer.max_steps=1"))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)], [str(w.message) for w in caught]


def test_failed_run_leaves_no_empty_version_folder(tmp_path):
    with pytest.raises(ValueError, match="make no batch"):
        run(quick(tmp_path, "--data.init_args.batch_size=100000", "--trainer.max_steps=1"))
    assert not list((tmp_path / "tiny").glob("version_*"))
    run(quick(tmp_path, "--trainer.max_steps=1"))  # a run that works keeps its folder
    assert [p.name for p in (tmp_path / "tiny").glob("version_*")] == ["version_0"]


def test_partial_checkpoints_of_a_crashed_run_are_removed_by_the_next_run(tmp_path, lightning_log):
    folder = tmp_path / "ckpt"
    (folder / "step=50.ckpt.partial").mkdir(parents=True)
    (folder / "step=50.ckpt.partial" / "__0_0.distcp").write_bytes(b"half")
    (folder / "step=50.ckpt.partial" / MARKER_FILE).write_bytes(b"")  # what our checkpointer writes first
    (folder / "step=25.ckpt").write_bytes(b"kept")
    (folder / "notes.partial").write_text("the user's")  # not ours: stays (tests/run/test_folders.py has more)
    run(quick(tmp_path, "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={folder}",
              "--trainer.fast_dev_run=true"))
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE, "notes.partial", "step=25.ckpt"]  # lock: stays
    assert any("step=50.ckpt.partial: an unfinished checkpoint" in m for m in lightning_log)


# ---- 9 (issue 9, defect 6). bf16 on GPUs by default -------------------------------------------

@pytest.mark.parametrize("accelerator, cuda, bf16, expected", [
    ("auto", True, True, "bf16-mixed"), ("gpu", True, True, "bf16-mixed"), ("cuda", True, True, "bf16-mixed"),
    ("auto", True, False, "32-true"),  # pre-Ampere: no bf16
    ("auto", False, False, "32-true"), ("cpu", True, True, "32-true"), ("gpu", False, False, "32-true"),
])
def test_default_precision_is_bf16_on_gpus_only(accelerator, cuda, bf16, expected):
    assert default_precision(accelerator, cuda, bf16) == expected


def test_cpu_run_logs_the_precision_it_ran(tmp_path, lightning_log):
    cli = run(quick(tmp_path, "--trainer.fast_dev_run=true"))
    assert cli.trainer.precision == "32-true"
    assert "precision: 32-true (the default on this accelerator; set trainer.precision to change it)" in lightning_log
