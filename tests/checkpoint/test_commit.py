"""Unfinished saves (``checkpoint/commit.py``): clean-up settles only the ``*.partial`` folders this package
marked as its own, and a save never writes over a partial folder it did not create."""

import pytest
import torch

from moe_lightning.checkpoint.commit import MARKER_FILE, remove_unfinished_saves
from moe_lightning.checkpoint.discovery import newest_checkpoint
from moe_lightning.checkpoint.safe_load import CheckpointError
from moe_lightning.checkpoint.sharded import ShardedCheckpointer


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
