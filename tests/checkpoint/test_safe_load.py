"""Opening a checkpoint never runs code from it (issue 18, item 4).

DCP's own reader unpickles ``.metadata`` without limits and its default planner reads non-tensor items with
``torch.load(weights_only=False)``. Each test plants a payload whose unpickling creates a marker file, opens the
checkpoint the way one command does, and checks the refusal names the file and the marker never appears.
"""

import dataclasses
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from moe_lightning import MoEConfig, MoETransformer
from moe_lightning.commands.main import run
from moe_lightning.commands.generate import main as generate_main
from moe_lightning.commands.loading import load_model
from moe_lightning.checkpoint.safe_load import CheckpointError, SafeReader, load_sharded
from tests.support.distributed import REPO_ROOT, clean_env, free_port

SMALL = dict(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, ffn_hidden=64,
             num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=0, init_std=0.3)
BYTE_ITEM = "optimizer_0.param_groups.0.lr"  # a non-tensor item every sharded checkpoint with an optimizer has


class Payload:
    """Unpickling this creates ``marker``: what a crafted file would do with ``os.system`` instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def write_sharded(folder: Path) -> MoETransformer:
    """A sharded checkpoint as ``MoEFSDPStrategy`` lays it out (``meta.pt`` + DCP ``state_dict``/``optimizer_0``),
    written in one process."""
    torch.manual_seed(0)
    config = MoEConfig(**SMALL)
    model = MoETransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 260, (1, 8)))[0].float().pow(2).mean().backward()
    optimizer.step()
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
             "optimizer_0": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"hyper_parameters": {"config": dataclasses.asdict(config)}, "global_step": 1}, folder / "meta.pt")
    return model


def plant_metadata(folder: Path, marker: Path) -> Path:
    """``.metadata`` that still describes the checkpoint, with a payload riding along in ``planner_data``."""
    metadata = FileSystemReader(folder).read_metadata()
    metadata.planner_data = Payload(marker)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return folder / ".metadata"


def plant_byte_item(folder: Path, marker: Path, key: str = BYTE_ITEM) -> Path:
    """The byte item ``key`` pointed at a new data file holding a ``torch.save``d payload."""
    evil = folder / "__9_0.distcp"
    torch.save(Payload(marker), evil)
    metadata = FileSystemReader(folder).read_metadata()
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(evil.name, 0, evil.stat().st_size)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return evil


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded") / "last.ckpt"
    model = write_sharded(folder)
    return folder, model


@pytest.fixture(params=["metadata", "byte_item"])
def crafted(request, clean_checkpoint, tmp_path):
    folder = tmp_path / "crafted.ckpt"
    shutil.copytree(clean_checkpoint[0], folder)
    marker = tmp_path / "code_ran"
    file = (plant_metadata if request.param == "metadata" else plant_byte_item)(folder, marker)
    return folder, marker, file


def test_the_payload_would_run_through_dcps_own_reader(crafted):
    """The planted files are real threats: DCP's defaults execute them."""
    folder, marker, file = crafted
    state = {BYTE_ITEM: None}
    try:
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    except BaseException:
        pass
    assert marker.exists()


OPENERS = {
    "generate": lambda folder, tmp: generate_main([str(folder), "--prompt", "a", "--max-new-tokens", "2"]),
    "export": lambda folder, tmp: run(["export", str(folder), "--out", str(tmp / "out.pt")]),
    "export --hf": lambda folder, tmp: run(["export", str(folder), "--hf", "--out", str(tmp / "hf")]),
    "convert": lambda folder, tmp: run(["convert", str(folder), "--out", str(tmp / "hf")]),
    "load_model": lambda folder, tmp: load_model(folder),
}


@pytest.mark.parametrize("command", list(OPENERS))
def test_every_command_refuses_a_crafted_checkpoint_naming_the_file(crafted, command, tmp_path):
    folder, marker, file = crafted
    with pytest.raises(CheckpointError) as error:
        OPENERS[command](folder, tmp_path)
    assert f"Refusing to load {file}" in str(error.value) and "it names io.open" in str(error.value)
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "hf").exists()


def test_the_safe_reader_loads_what_dcp_wrote_bit_for_bit(clean_checkpoint):
    """Every class of a real ``.metadata`` is admitted; tensors and plain items arrive unchanged."""
    folder, model = clean_checkpoint
    assert SafeReader(folder).read_metadata().state_dict_metadata.keys() == \
        FileSystemReader(folder).read_metadata().state_dict_metadata.keys()
    loaded = load_model(folder).model.state_dict()
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    plain = {BYTE_ITEM: None, "optimizer_0.param_groups.0.betas": None}
    load_sharded(plain, folder, no_dist=True)
    assert plain == {BYTE_ITEM: 1e-3, "optimizer_0.param_groups.0.betas": (0.9, 0.999)}


def test_a_damaged_metadata_file_is_refused_naming_it(clean_checkpoint, tmp_path):
    folder = tmp_path / "cut.ckpt"
    shutil.copytree(clean_checkpoint[0], folder)
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{folder / '.metadata'} is not a readable DCP metadata file"):
        load_model(folder)


@pytest.mark.slow
def test_fit_ckpt_path_refuses_crafted_sharded_checkpoints(tmp_path):
    """``fit --ckpt_path`` under MoEFSDPStrategy (a real checkpoint of a real run, then tampered with): refused in
    the strategy's load, naming the file, with no marker."""
    def fit(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "moe_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "tiny-fsdp.yaml"),
             "--trainer.devices=1", "--trainer.strategy.init_args.expert_parallel_size=1", "--trainer.max_steps=1",
             "--trainer.limit_val_batches=0", "--data.init_args.max_tokens=30000", "--trainer.enable_progress_bar=false",
             "--model.init_args.config.n_layers=2", *extra],
            env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), cwd=tmp_path,
            capture_output=True, text=True, timeout=600)

    result = fit()
    assert result.returncode == 0, result.stderr[-3000:]
    saved = tmp_path / "lightning_logs" / "tiny-fsdp" / "version_0" / "checkpoints" / "last.ckpt"
    for plant in (plant_metadata, plant_byte_item):
        folder, marker = tmp_path / f"{plant.__name__}.ckpt", tmp_path / f"{plant.__name__}.ran"
        shutil.copytree(saved, folder)
        file = plant(folder, marker)
        result = fit("--trainer.max_steps=2", f"--ckpt_path={folder}")
        assert result.returncode == 2 and not marker.exists()  # a refusal: one line, no traceback
        last = [line for line in result.stderr.splitlines() if line.strip()][-1]
        assert last.startswith(f"moe-lightning fit: error: Refusing to load {file}"), last
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
