"""Full disks and broken paths when saving and resuming (issue 18, item 6).

A full disk is simulated: ``os.write`` on a checkpoint's ``.partial`` file (single-file saves) or DCP's file
stream (sharded saves) raises ``OSError(ENOSPC)`` after part of the data, as a real full disk does.
"""

import errno
import os
import traceback
from pathlib import Path

import pytest
import torch

from moe_lightning.commands.main import run
from moe_lightning.checkpoint import commit as ckpt
from moe_lightning.checkpoint.safe_load import CheckpointError, load_metadata
from moe_lightning.checkpoint.sharded import ShardedCheckpointer, _HostCopyWriter
from moe_lightning.run.durable import DiskFullError
from moe_lightning.run.locks import LOCK_FILE

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def quick(tmp_path, *extra: str) -> list[str]:
    return ["fit", "--config", str(TINY), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--data.init_args.max_tokens=30000", "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]",
            "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0", "--data.init_args.batch_size=2",
            "--model.init_args.config.n_layers=1", *extra]


def last_line(error: BaseException) -> str:
    return [line for line in "".join(traceback.format_exception(error)).splitlines() if line.strip()][-1]


@pytest.fixture
def disk_full_after(monkeypatch):
    """``disk_full_after(n)``: the disk fills up while the ``n + 1``-th ``.partial`` file is written (its first
    4 KiB are written, then ENOSPC)."""
    real_fdopen = os.fdopen
    files: list[str] = []

    def arm(n: int):
        def fdopen(fd, *args, **kwargs):
            file = real_fdopen(fd, *args, **kwargs)
            name = os.readlink(f"/proc/self/fd/{fd}")
            if not name.endswith(ckpt.PARTIAL_SUFFIX):
                return file
            files.append(name)
            return file if len(files) <= n else _Filling(file)
        monkeypatch.setattr(os, "fdopen", fdopen)
        return files
    return arm


def test_disk_full_during_a_single_file_save_leaves_the_previous_checkpoint_and_no_truncated_file(
        tmp_path, disk_full_after):
    """Before: a truncated ``epoch=0-step=2.ckpt`` under its final name, and resume failed in the zip reader."""
    folder = tmp_path / "ckpt"
    disk_full_after(2)  # the folder lock's holder record and step 1 are written; step 2 fills the disk
    with pytest.raises(DiskFullError) as error:
        run(quick(tmp_path, "--trainer.max_steps=3", "--trainer.callbacks+=ModelCheckpoint",
                  f"--trainer.callbacks.dirpath={folder}", "--trainer.callbacks.every_n_train_steps=1",
                  "--trainer.callbacks.save_top_k=-1"))
    line = last_line(error.value)
    assert f"{folder / 'epoch=0-step=2.ckpt'} was not written: the disk is full (" in line
    assert "What was there before is intact" in line
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE, "epoch=0-step=1.ckpt"]  # the lock file stays
    assert torch.load(folder / "epoch=0-step=1.ckpt", weights_only=True)["global_step"] == 1


def test_a_single_file_save_replaces_the_old_file_only_when_complete(tmp_path, disk_full_after):
    path = tmp_path / "last.ckpt"
    ckpt.save_file({"step": 1, "w": torch.ones(3)}, path)
    disk_full_after(0)
    with pytest.raises(DiskFullError, match=r"last.ckpt was not written: the disk is full \(\d[\d,]* bytes free"):
        ckpt.save_file({"step": 2, "w": torch.zeros(100_000)}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_single_file_save_never_touches_a_sharded_partial_folder_or_a_file_of_that_name(tmp_path):
    """Before: the temporary file was ``<name>.partial``: a sharded save's ``<name>.partial`` folder made the
    open fail with EISDIR and was then deleted (rmtree), and a file of that name was truncated and moved."""
    folder = tmp_path / ("a.ckpt" + ckpt.PARTIAL_SUFFIX)
    folder.mkdir()
    (folder / "shard").write_bytes(b"sharded")
    ckpt.save_file({"step": 1}, tmp_path / "a.ckpt")
    assert (folder / "shard").read_bytes() == b"sharded"
    user_file = tmp_path / ("b.ckpt" + ckpt.PARTIAL_SUFFIX)
    user_file.write_bytes(b"mine")
    ckpt.save_file({"step": 2}, tmp_path / "b.ckpt")
    assert user_file.read_bytes() == b"mine"
    assert torch.load(tmp_path / "a.ckpt", weights_only=True) == {"step": 1}
    assert torch.load(tmp_path / "b.ckpt", weights_only=True) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", folder.name, "b.ckpt", user_file.name]


def test_a_single_file_save_syncs_the_folder_after_the_rename(tmp_path, durability_log):
    """The rename is durable: the parent folder is fsync'ed after ``os.replace`` (before: never)."""
    ckpt.save_file({"step": 1}, tmp_path / "last.ckpt")
    described = [(kind, what if kind == "replace" else "folder" if what == tmp_path else "file")
                 for kind, what in durability_log]
    assert described == [("fsync", "file"), ("replace", "last.ckpt"), ("fsync", "folder")]


class FillingWriter(_HostCopyWriter):
    """DCP's writer on a disk that fills up: every file it opens raises ENOSPC after 4 KiB."""

    def __init__(self, path):
        super().__init__(path)
        create_stream = self.fs.create_stream

        def filling(path, mode):
            stream = create_stream(path, mode)
            if "w" not in mode:
                return stream
            return _Filling(stream)
        self.fs.create_stream = filling


class _Filling:
    def __init__(self, inner):
        self.inner, self.written = inner, 0

    def __enter__(self):
        self.file = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def write(self, data):
        if self.written + len(data) > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_disk_full_during_a_sharded_save_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    """Before: "enforce fail at inline_container.cc:672 ... unexpected pos", and the ``.partial`` stayed."""
    path = tmp_path / "last.ckpt"
    saver = ShardedCheckpointer()
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, path, set(), None)
    saver.storage_writer = FillingWriter
    state = {"w": torch.randn(300_000)}
    with pytest.raises(DiskFullError) as error:
        saver.save(state, {"global_step": 2}, path, set(), None)
    line = last_line(error.value)
    assert f"{path} was not written: the disk is full (1,200,000 bytes needed, " in line, line
    assert "What was there before is intact" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no .partial left taking space
    assert load_metadata(path / ckpt.METADATA_FILE)["global_step"] == 1


def test_disk_full_during_a_background_sharded_save_removes_its_partial_folder(tmp_path):
    """Before: ``wait`` raised the disk-full error but left ``last.ckpt.partial`` taking the space (the
    foreground path removed it)."""
    path = tmp_path / "last.ckpt"
    saver = ShardedCheckpointer()
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, path, set(), None)
    saver.storage_writer = FillingWriter
    saver.save({"w": torch.randn(300_000)}, {"global_step": 2}, path, set(), None, background=True)
    with pytest.raises(DiskFullError, match=r"last.ckpt was not written: the disk is full"):
        saver.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert load_metadata(path / ckpt.METADATA_FILE)["global_step"] == 1


@pytest.mark.slow
def test_a_single_file_checkpoint_resumes_under_moe_fsdp_strategy_at_ep_1_and_2(tmp_path):
    """Before: "The size of tensor a (128) must match the size of tensor b (64)" (Lightning keyed the optimizer
    state by ``model.parameters()`` order, not the optimizer's) and, with ep=2, experts split by ``ep``. A one-process
    run writes single files; 1 process under MoEFSDPStrategy (ep=1) and 2 (ep=2) resume from its step-2 file and
    must continue as it did (batches 4-7; RTOL as in test_strategy: reduction order differs, ~1e-7 seen)."""
    from tests.training.test_strategy import RTOL, launch, losses

    single = launch(tmp_path, "single", 1, "--strategy", "single", "--batch-size", "4",
                    "--ckpt-dir", str(tmp_path / "ckpt"))
    step2 = tmp_path / "ckpt" / "step=2.ckpt"
    assert step2.is_file()
    ep1 = launch(tmp_path, "ep1", 1, "--batch-size", "4", "--resume", str(step2))
    ep2 = launch(tmp_path, "ep2", 2, "--ep", "2", "--resume", str(step2))
    for resumed in (ep1, ep2):
        assert [r["batch"] for r in resumed["batches"]] == [4, 5, 6, 7]
        assert losses(resumed) == pytest.approx(losses(single, 4), rel=RTOL)


def test_a_url_checkpoint_path_is_saved_by_lightnings_fsspec_writer_not_as_a_local_folder(tmp_path, monkeypatch):
    """Before: ``Path("memory://bucket/x.ckpt")`` wrote the local file ``memory:/bucket/x.ckpt`` (an ``s3://``
    checkpoint ended up on local disk under ``s3:/``)."""
    import fsspec
    from moe_lightning.training.checkpoint_io import FileCheckpointIO

    monkeypatch.chdir(tmp_path)
    FileCheckpointIO().save_checkpoint({"step": 3}, "memory://bucket/x.ckpt")
    assert list(tmp_path.iterdir()) == []
    with fsspec.open("memory://bucket/x.ckpt", "rb") as file:
        assert torch.load(file, weights_only=True) == {"step": 3}
    fsspec.filesystem("memory").rm("memory://bucket", recursive=True)


def _single_file_strategy(tmp_path, strict: bool, saved_state: dict, saved_names: list[str] | None = None):
    """A one-process ``MoEFSDPStrategy`` holding a plain two-layer module (no process group, nothing sharded),
    and a single-file checkpoint ``saved_state`` (optimizer state saved under ``saved_names``) to resume."""
    import lightning as L
    from moe_lightning.training.strategy import MoEFSDPStrategy

    module = L.LightningModule()
    module.a, module.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    module.strict_loading = strict
    optimizer = torch.optim.AdamW(module.named_parameters())
    strategy = MoEFSDPStrategy()
    strategy._lightning_module, strategy.model, strategy.optimizers = module, module, [optimizer]
    names = saved_names or [name for name, _ in module.named_parameters()]
    optimizer_state = {"state": {}, "param_groups": [{**optimizer.param_groups[0], "params": list(range(len(names))),
                                                      "param_names": names}]}
    path = tmp_path / "one.ckpt"
    ckpt.save_file({"state_dict": saved_state, "optimizer_states": [optimizer_state]}, path)
    return strategy, module, path


def test_a_single_file_resume_under_strict_loading_names_missing_and_unexpected_keys(tmp_path):
    """Before: keys missing from the file or unexpected in it were silently skipped even with strict loading."""
    saved = {"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2), "c.weight": torch.ones(2, 2)}
    strategy, module, path = _single_file_strategy(tmp_path, True, saved)
    with pytest.raises(CheckpointError) as error:
        strategy.load_model_state_dict(strategy.load_checkpoint(path))
    line = last_line(error.value)
    assert "2 keys missing from it ['b.weight', 'b.bias'], 1 unexpected in it ['c.weight']" in line, line
    assert "strict_loading = False" in line
    assert not torch.equal(module.a.weight, torch.ones(2, 2))  # refused before copying anything

    strategy, module, path = _single_file_strategy(tmp_path, False, saved)
    strategy.load_model_state_dict(strategy.load_checkpoint(path))  # non-strict: the matching keys load
    assert torch.equal(module.a.weight, torch.ones(2, 2))


def test_a_single_file_resume_with_a_renamed_parameter_names_it(tmp_path):
    """Before: a bare ``KeyError: 'b.bias'`` from the optimizer state's name lookup."""
    module_keys = ["a.weight", "a.bias", "b.weight", "b.bias"]
    saved = {key: torch.ones(2, 2) if key.endswith("weight") else torch.ones(2) for key in module_keys}
    strategy, _, path = _single_file_strategy(tmp_path, True, saved, ["a.weight", "a.bias", "b.weight", "b.bias_old"])
    with pytest.raises(CheckpointError, match=r"one.ckpt: its optimizer state has no parameter 'b.bias' \(1 missing"):
        strategy.load_model_state_dict(strategy.load_checkpoint(path))
