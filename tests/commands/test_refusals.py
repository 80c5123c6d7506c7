"""Issue 33, item 6: every refusal a user can cause ends in one line on stderr, exit status 2 (1 for a busy folder),
on every command, through the console entry point (``commands.main.main``; one case as a real ``python -m
moe_lightning`` process); with ``--traceback`` or ``MOE_LIGHTNING_TRACEBACK=1`` the stack shows. Before: ``fit``,
``convert``, ``export``, ``generate`` printed a full traceback before their last line (exit 1)."""

import json
import logging
import subprocess
import sys

import pytest

from moe_lightning.commands.main import main
from moe_lightning.hf.mapping import HFFormatError
from moe_lightning.model.config import MoEConfig
from moe_lightning.run.refusals import TRACEBACK_ENV
from tests.run.test_locks import hold, stop
from tests.support.distributed import REPO_ROOT, clean_env

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")
# Lightning's own start-up lines, on stderr before a refusal raised once the classes are built (not ours to drop)
LIGHTNING_INFO = ("Seed set to", "GPU available", "TPU available", "precision: ", "removed ")


@pytest.fixture(autouse=True)
def lightning_console_on_this_tests_stderr(monkeypatch):
    """Lightning's console handler writes to this test's stderr (it kept the stream of whichever test imported
    Lightning first). (tests/conftest.py clears MOE_LIGHTNING_TRACEBACK for every test.)"""
    loggers = [logger for name, logger in logging.root.manager.loggerDict.items()
               if name.split(".")[0] == "lightning" and isinstance(logger, logging.Logger)]
    for handler in (handler for logger in loggers for handler in logger.handlers):
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", sys.stderr)


def refused(capfd, words: list[str]) -> tuple[int, list[str]]:
    """Run ``moe-lightning WORDS`` as the console script does; its exit status and stderr lines."""
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(words)
    return exit_.value.code, capfd.readouterr().err.splitlines()


def hf_folder_of_unknown_architecture(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def missing(tmp_path, name: str) -> str:
    return str(tmp_path / name)


# (command words, the one line's start): each input is wrong in one way a user could get wrong
CASES = {
    "convert": (lambda t: ["convert", str(hf_folder_of_unknown_architecture(t)), "--out", "x.pt"],
                "moe-lightning convert: error: "),
    "convert usage": (lambda t: ["convert"], "moe-lightning convert: error: the following arguments are required"),
    "export": (lambda t: ["export", missing(t, "run.ckpt"), "--out", "x.pt"],
               "moe-lightning export: error: "),
    "export --hf": (lambda t: ["export", missing(t, "run.ckpt"), "--hf", "--out", "hf"],
                    "moe-lightning export: error: "),
    "generate": (lambda t: ["generate", missing(t, "run.ckpt"), "--prompt", "hi"], "moe-lightning generate: error: "),
    "tokenize": (lambda t: ["tokenize", missing(t, "corpus"), "--out", "shards"],
                 "moe-lightning tokenize: error: data.source="),
    "validate": (lambda t: ["validate", "--config", TINY, "--trainer.max_stepz=1"],
                 "moe-lightning validate: error: unrecognized arguments: --trainer.max_stepz=1"),
    "fit bad config": (lambda t: ["fit", "--config", TINY, "--model.init_args.config.top_kk=2"],
                       "moe-lightning fit: error: model.config: Option 'top_kk' is not accepted"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_is_one_line_on_stderr_and_exit_status_2(tmp_path, monkeypatch, capfd, case):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ipykernel_launcher.py", "-f", "kernel.json"])  # a host's own command line
    words, start = CASES[case]
    status, lines = refused(capfd, words(tmp_path))
    assert status == 2 and len(lines) == 1 and lines[0].startswith(start), lines


def test_the_console_script_itself_answers_in_one_line(tmp_path):
    """The real entry point, as a user runs it."""
    result = subprocess.run([sys.executable, "-m", "moe_lightning", "convert",
                             str(hf_folder_of_unknown_architecture(tmp_path)), "--out", "x.pt"],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr[-3000:]
    assert result.stderr.startswith("moe-lightning convert: error: ")


@pytest.mark.parametrize("words, said", [
    (["fit", "--config", TINY, "--model.init_args.config.top_k=9"],
     "moe-lightning fit: error: MoEConfig.top_k=9 exceeds num_experts=8: lower top_k or add experts."),
    (["test", "--config", TINY, "--ckpt_path=gone.ckpt"],
     "moe-lightning test: error: ckpt_path='gone.ckpt': no such checkpoint file or folder; pass a saved checkpoint"),
    (["predict", "--config", TINY, "--prompts", "gone.jsonl"],
     "moe-lightning predict: error: --prompts='gone.jsonl': no such file"),
])
def test_a_trainer_commands_refusal_after_its_classes_are_built_is_its_one_line(tmp_path, monkeypatch, capfd,
                                                                                words, said):
    """Raised once the model and data are built (after Lightning's own start-up lines, which are not errors):
    the refusal is still the one line of ours, last, with no traceback, before any data is read."""
    monkeypatch.chdir(tmp_path)
    status, lines = refused(capfd, words)
    ours = [line for line in lines if not line.startswith(LIGHTNING_INFO)]
    assert status == 2 and ours == [lines[-1]] and lines[-1].startswith(said), lines
    assert not any(line.startswith("tokenize:") for line in lines)  # refused before the corpus is read


def test_a_folder_in_use_is_one_line_and_exit_status_1(tmp_path, monkeypatch, capfd):
    """The state of the machine, not bad input: a requeue script may try again later."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ck"
    holder = hold(folder, "0/1")  # another process's run
    try:
        status, lines = refused(capfd, ["fit", "--config", TINY, "--trainer.max_steps=1",
                                        "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={folder}"])
    finally:
        stop(holder)
    assert status == 1 and lines[-1].startswith(f"moe-lightning fit: error: {folder} is in use by another run (host ")
    assert [line for line in lines if not line.startswith(LIGHTNING_INFO)] == [lines[-1]]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_traceback_flag_or_environment_shows_the_stack(tmp_path, monkeypatch, capfd, how):
    """The exception itself goes up (Python prints its stack), nothing of the one-line report is said."""
    words = ["convert", str(hf_folder_of_unknown_architecture(tmp_path)), "--out", str(tmp_path / "x.pt")]
    if how == "environment":
        monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(HFFormatError):
        main([*words, "--traceback"] if how == "flag" else words)
    assert "error" not in capfd.readouterr().err


def test_plan_refusal_is_one_line(tmp_path, capfd):
    """Was: plan's argparse printed its usage above the error line."""
    status, lines = refused(capfd, ["plan", "--config", str(tmp_path / "gone.yaml")])
    assert status == 2 and len(lines) == 1 and lines[0].startswith("moe-lightning plan: error: ")
    assert "gone.yaml" in lines[0]


@pytest.mark.parametrize("world_size, status, group, kept", [(2, "RUNNING", True, True), (2, "RUNNING", False, False),
                                                             (2, "INITIALIZING", True, False), (1, "RUNNING", True, False)])
def test_an_error_inside_a_multi_process_trainer_run_keeps_its_traceback(monkeypatch, world_size, status, group, kept):
    """Raised once a trainer of several ranks is running and its process group exists (not in the checks before
    it): the stack is shown. A refusal raised in the run before the process group exists (the layout checks) stays
    one line."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.trainer.states import TrainerStatus

    from moe_lightning.commands.cli import MoECLI
    from moe_lightning.run.refusals import is_refusal

    def fails(self, subcommand):
        MoEConfig(num_experts=4, top_k=5)  # a check of the package's: a refusal, unless raised inside such a run

    monkeypatch.setattr(LightningCLI, "_run_subcommand", fails)
    monkeypatch.setattr(dist, "is_initialized", lambda: group)
    trainer = SimpleNamespace(fast_dev_run=True, checkpoint_callbacks=[], callbacks=[], world_size=world_size,
                              state=SimpleNamespace(status=getattr(TrainerStatus, status)))
    cli = MoECLI.__new__(MoECLI)  # only what _run_subcommand reads: its trainer
    cli.trainer = trainer
    with pytest.raises(ValueError) as raised:
        cli._run_subcommand("fit")
    assert is_refusal(raised.value) != kept


@pytest.mark.parametrize("shared, rank, said", [(True, 0, "error: MoEConfig.top_k=5"), (True, 1, None),
                                                 (False, 1, "error: rank 1: cannot write")])
def test_a_pre_group_refusal_is_said_by_rank_0_only_when_every_rank_made_it(monkeypatch, capfd, shared, rank, said):
    """Before: every refusal before the process group existed was silent on ranks other than 0, so one node's
    unwritable folder (a PermissionError there alone) left rank 0 waiting in the rendezvous and nobody said why."""
    from moe_lightning.run import refusals

    monkeypatch.setattr(refusals, "_process_group_exists", lambda: False)
    try:
        MoEConfig(num_experts=4, top_k=5)  # a check of the package's, as the layout's are
    except ValueError as refusal:
        layout_refusal = refusal
    error = refusals.same_on_every_rank(layout_refusal) if shared else PermissionError("cannot write")
    refusals.in_multi_process_run(error, rank)
    refusals.say_refusal("fit", error)
    err = capfd.readouterr().err.strip()
    assert (err == "") if said is None else (said in err and len(err.splitlines()) == 1)
