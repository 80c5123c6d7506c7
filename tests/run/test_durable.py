"""The one file writer: a failure never leaves a partial file under the final name nor replaces the old one."""

import errno
import os

import pytest

from moe_lightning.run import durable


def test_a_write_replaces_the_file_and_leaves_nothing_beside(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    durable.write_bytes(target, b"first")
    durable.write_text(target, "second")
    assert target.read_text() == "second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.bin"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)


def test_an_exception_in_the_writer_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def fails(file):
        file.write(b"half")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        durable.write_with(target, fails)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(durable.DiskFullError) as raised:
        durable.write_bytes(target, b"new")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert str(raised.value).startswith(f"{target} was not written: the disk is full")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_partial_file_of_another_writer_is_never_touched(tmp_path):
    other = tmp_path / "out.bin.other.partial"
    other.write_bytes(b"someone else's")
    durable.write_bytes(tmp_path / "out.bin", b"mine")
    assert other.read_bytes() == b"someone else's"


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_0644(tmp_path):
    """Before: every write chmodded the result to 0644, so a file the user had made private became readable."""
    private = tmp_path / "private.yaml"
    private.write_text("old")
    os.chmod(private, 0o600)
    durable.write_text(private, "new")
    assert private.read_text() == "new" and private.stat().st_mode & 0o777 == 0o600
    durable.write_text(tmp_path / "new.yaml", "x")
    assert (tmp_path / "new.yaml").stat().st_mode & 0o777 == 0o644
