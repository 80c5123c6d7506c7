"""Run folders (``run/folders.py``, and the logger pinned to them: ``training/callbacks/run_folders.py``):
allocated atomically, and removed only when this run created them and left nothing."""

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from moe_lightning.checkpoint.discovery import newest_checkpoint
from moe_lightning.checkpoint.commit import METADATA_FILE
from moe_lightning.run.folders import create_version_folder
from moe_lightning.training.callbacks.run_folders import allocate_run_folder
from tests.training.test_preemption import finish, fit_command, launch, losses


def test_version_folders_are_created_exclusively(tmp_path, monkeypatch):
    """Two jobs listed the folder before either created its version: both chose version_0."""
    first = CSVLogger(tmp_path, name="run")
    assert allocate_run_folder(first) == tmp_path / "run" / "version_0" and first.version == 0
    second = CSVLogger(tmp_path, name="run")
    monkeypatch.setattr(second, "_get_next_version", lambda: 0)  # its listing predates the first's mkdir
    assert allocate_run_folder(second) == tmp_path / "run" / "version_1" and second.version == 1
    fixed = CSVLogger(tmp_path, name="run", version="mine")
    assert allocate_run_folder(fixed) == tmp_path / "run" / "mine"
    assert allocate_run_folder(CSVLogger(tmp_path, name="run", version="mine")) is None  # existed: not ours
    (tmp_path / "other" / "version_3").mkdir(parents=True)  # the mechanism alone: the first free from the one asked
    assert create_version_folder(tmp_path / "other", 2) == (tmp_path / "other" / "version_2", 2)
    assert create_version_folder(tmp_path / "other", 2) == (tmp_path / "other" / "version_4", 4)


def test_newest_checkpoint_takes_the_highest_step_across_versions_and_skips_unfinished(tmp_path):
    for version, step in (("version_0", 7), ("version_1", 4)):
        folder = tmp_path / version / "checkpoints"
        folder.mkdir(parents=True)
        torch.save({"global_step": step}, folder / "last.ckpt")
    unfinished = tmp_path / "version_1" / "checkpoints" / "last.ckpt.partial"
    unfinished.mkdir()
    torch.save({"global_step": 9}, unfinished / METADATA_FILE)
    folders = sorted(tmp_path.glob("*/checkpoints"))
    assert newest_checkpoint(folders) == (tmp_path / "version_0" / "checkpoints" / "last.ckpt", 7)
    assert newest_checkpoint([tmp_path / "missing"]) is None

@pytest.mark.slow
def test_two_fits_started_together_in_one_folder_get_different_versions_and_both_finish(tmp_path):
    """Before: both took version_0, the loser's clean-up deleted the winner's folder, both died."""
    command = fit_command("tiny.yaml", tmp_path, "--trainer.max_steps=3", "--data.init_args.batch_size=4")
    procs = [launch(command, tmp_path) for _ in range(2)]
    outs = [finish(p) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    versions = sorted(p.name for p in (tmp_path / "tiny").iterdir())
    assert versions == ["version_0", "version_1"]
    for version in versions:
        assert (tmp_path / "tiny" / version / "config.yaml").is_file()
        assert sorted(losses(tmp_path / "tiny" / version, "metrics.csv")) == [0, 1, 2]

