"""Run folders (``run/folders.py``, and the logger pinned to them: ``training/callbacks/run_folders.py``):
allocated atomically, and clean-up removes only what we wrote."""

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from moe_lightning.checkpoint.discovery import newest_checkpoint
from moe_lightning.checkpoint.commit import MARKER_FILE, METADATA_FILE
from moe_lightning.checkpoint.safe_load import CheckpointError
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.run.folders import create_version_folder, remove_unfinished_saves
from moe_lightning.training.callbacks.run_folders import allocate_run_folder
from tests.training.test_preemption import finish, fit_command, launch, losses


def test_clean_up_removes_only_marked_unfinished_saves_never_the_passed_path_or_other_files(tmp_path):
    """Before: `ck/notes.partial` and `ck/download.partial/` were deleted, and so was a `*.partial` ckpt_path."""
    folder = tmp_path / "ck"
    ours = folder / "step=50.ckpt.partial"
    ours.mkdir(parents=True)
    (ours / MARKER_FILE).write_bytes(b"")
    (ours / "__0_0.distcp").write_bytes(b"half")
    (folder / "notes.partial").write_text("mine")
    (folder / "download.partial").mkdir()
    (folder / "download.partial" / "part-1").write_text("mine")
    unmarked = folder / "step=60.ckpt.partial"  # a sharded save by a version without markers: not provably ours
    unmarked.mkdir()
    passed = folder / "step=70.ckpt.partial"
    passed.mkdir()
    (passed / MARKER_FILE).write_bytes(b"")
    (folder / "step=25.ckpt").write_bytes(b"kept")
    said = []
    assert remove_unfinished_saves({folder}, keep=passed, say=said.append) == [ours]
    assert sorted(p.name for p in folder.iterdir()) == ["download.partial", "notes.partial", "step=25.ckpt",
                                                        "step=60.ckpt.partial", "step=70.ckpt.partial"]
    assert (folder / "download.partial" / "part-1").read_text() == "mine"
    assert said == [f"removed {ours}: an unfinished checkpoint of a run stopped while saving"]


def test_sharded_save_refuses_a_partial_name_it_did_not_write(tmp_path):
    (tmp_path / "last.ckpt.partial").mkdir()
    (tmp_path / "last.ckpt.partial" / "data").write_text("mine")
    with pytest.raises(CheckpointError, match=r"last.ckpt.partial exists and was not written by moe_lightning"):
        ShardedCheckpointer().save({"x": torch.zeros(2)}, {"global_step": 1}, tmp_path / "last.ckpt", set(), None)
    assert (tmp_path / "last.ckpt.partial" / "data").read_text() == "mine"
    ShardedCheckpointer().save({"x": torch.zeros(2)}, {"global_step": 1}, tmp_path / "other.ckpt", set(), None)
    assert (tmp_path / "other.ckpt" / MARKER_FILE).is_file() and newest_checkpoint([tmp_path])[1] == 1


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

