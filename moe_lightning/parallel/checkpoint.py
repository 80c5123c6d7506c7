"""Sharded checkpoints: atomic directory commits, expert-parallel global views, reading one in one process.

With expert parallelism each rank's FSDP DTensor for an expert stack only covers its ``E / ep``
experts, so two ``ep`` ranks would write different data under the same name. Before saving (and
loading), those tensors are re-described, without copying, as DTensors on the full expert mesh
with the ``ep`` split included: the checkpoint always holds global ``[E, ...]`` stacks and can be
loaded at any world size or ``ep``.
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch import nn

from ..model import GroupedExperts

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"


def expert_parameter_names(module: nn.Module) -> set[str]:
    return {f"{name}.{p}" if name else p for name, m in module.named_modules() if isinstance(m, GroupedExperts)
            for p, _ in m.named_parameters(recurse=False)}


def _global_expert_view(tensor: DTensor, expert_mesh: DeviceMesh) -> DTensor:
    """The same local shard, described on ``(replicate, ep, efsdp)`` with experts split by ``ep`` first.

    Built like FSDP builds its own DTensors (no ``from_local``), so a shard kept in host memory (CPU
    offload, ``cpu_offload`` state dicts) is neither copied to the accelerator nor detached from the original.
    """
    ep = expert_mesh["ep"].size()
    shape = torch.Size((tensor.shape[0] * ep, *tensor.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(expert_mesh, (Replicate(), Shard(0), tensor.placements[-1]),
                       tensor_meta=TensorMeta(shape, stride, tensor.dtype))
    local = tensor.to_local()
    return DTensor(local, spec, requires_grad=local.requires_grad)


@contextmanager
def global_expert_views(state: dict[str, Any], names: set[str], expert_mesh: DeviceMesh | None):
    """Within the block, the expert DTensors of a model/optimizer state dict are global views (in place).

    The views share storage with the originals, so a DCP load into them fills the originals; the
    non-tensor entries (e.g. optimizer hyperparameters) DCP loads into the same containers.
    """
    swapped = []

    def visit(container, in_expert: bool) -> None:
        for key, value in list(container.items() if isinstance(container, dict) else enumerate(container)):
            expert = in_expert or key in names
            if isinstance(value, (dict, list)):
                visit(value, expert)
            elif expert and isinstance(value, DTensor) and value.ndim == 3:
                swapped.append((container, key, value))
                container[key] = _global_expert_view(value, expert_mesh)

    if expert_mesh is not None:
        visit(state, False)
    try:
        yield state
    finally:
        for container, key, value in swapped:
            container[key] = value


def commit_directory(partial: Path, path: Path) -> None:
    """Replace ``path`` by the fully written ``partial``; a crash at any point leaves a loadable checkpoint."""
    old = path.with_name(path.name + OLD_SUFFIX)
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or its previous version if a crash fell between the two renames of a commit."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if not path.exists() and old.exists():
        return old
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist.")
    return path


def read_sharded_weights(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A sharded checkpoint's ``MoETransformer`` state dict (global tensors) and its metadata, read in one
    process without GPUs or a process group (``moe_lightning.loading`` turns them into a model or an export)."""
    src = resolve_checkpoint(Path(checkpoint))
    if not (src / METADATA_FILE).is_file():
        raise ValueError(f"checkpoint={str(src)!r} is not a sharded checkpoint directory (no {METADATA_FILE}).")
    prefix = "state_dict.model."
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in FileSystemReader(src).read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    state = {"state_dict": {key[len("state_dict."):]: t for key, t in tensors.items()}}
    dcp.load(state, checkpoint_id=src, no_dist=True)
    weights = {key[len("model."):]: t for key, t in state["state_dict"].items()}
    return weights, torch.load(src / METADATA_FILE, weights_only=False)
