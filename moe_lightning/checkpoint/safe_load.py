"""The one unpickling rule for the package's checkpoint files, and DCP reads that obey it.

Loading never runs code from a file: metadata is plain data (the model config as a dict) and is read with
``torch.load(weights_only=True)`` (``load_metadata``); DCP's own ``.metadata`` is unpickled admitting only the classes
it is made of (``SafeReader``), and its non-tensor items are read with ``weights_only=True`` (``SafeLoadPlanner``;
DCP's default reader and planner unpickle both without limits). Every sharded read goes through ``load_sharded``.
"""

import io
import pickle
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moe_lightning.model import MoEConfig


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or would not be read safely; the message names the path."""


def load_metadata(path: Path | io.BytesIO, mmap: bool = False) -> dict[str, Any]:
    """The one rule for unpickling any file of ours (a ``.ckpt``, ``meta.pt``, a ``.pt``): plain data only
    (tensors, numbers, strings, containers), plus ``MoEConfig``, which older checkpoints stored as the dataclass
    (restored field by field: no code of the file runs). ``mmap``: tensors are mapped, not read, so a look at
    the step or the config, or reading the model out of a file that also holds optimizer state, costs only
    what it touches."""
    try:
        with torch.serialization.safe_globals([MoEConfig]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise unsafe_file_error(path, error) from None


@contextmanager
def single_process_dcp():
    """DCP warns "torch.distributed is disabled ... assuming the intent is to load in a single process" even when
    told so (``no_dist=True``): it is the intent here (export, generate read a sharded checkpoint in one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def unsafe_file_error(path: Path | io.BytesIO, error: pickle.UnpicklingError, item: str = "") -> CheckpointError:
    """``item``: which entry of the file, where it holds several."""
    return CheckpointError(
        f"Refusing to load {path}{item}: it holds pickled objects other than plain data, and unpickling them could "
        f"run code from the file ({_pickle_reason(error)}). Checkpoints written by moe_lightning hold only plain "
        "data; load only files you trust, and re-save a trusted old one with its objects converted to dicts.")


def _pickle_reason(error: pickle.UnpicklingError) -> str:
    found = re.search(r"GLOBAL (\S+)", str(error))
    return f"it names {found.group(1)}" if found else str(error).strip().split("\n")[0][:200]


# What DCP's ``.metadata`` pickle is made of (torch 2.11 to 2.13), besides torch dtypes: nothing else is unpickled.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a torch.layout from its name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # the checkpoint_id
}
_DCP_METADATA_GLOBALS["pathlib._local"] = _DCP_METADATA_GLOBALS["pathlib"]  # Python >= 3.13


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _DCPMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"GLOBAL {module}.{name} is not a class of DCP metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, except that ``.metadata`` is unpickled admitting only DCP's metadata classes (and read
    once: ``load_sharded`` reads it before ``dcp.load``, which would bury a refusal in its own report)."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None or kwargs.get("rank") is not None:
            self._metadata = self._read_metadata(kwargs.get("rank"))
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_metadata(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = _DCPMetadataUnpickler(file).load()
        except _ForbiddenGlobal as error:
            raise CheckpointError(
                f"Refusing to load {path}: DCP metadata holds only DCP's own metadata classes, and unpickling "
                f"anything else could run code from the file ({_pickle_reason(error)}). Load only checkpoints you "
                "trust.") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{path} is not a readable DCP metadata file ({type(error).__name__}: {error}): "
                                  "the checkpoint is damaged or was not written by DCP.") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__}).")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items are read as plain data only
    (``torch.load(weights_only=True)``, where DCP's own uses ``weights_only=False``)."""

    def __init__(self, reader: SafeReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            where = self.reader.storage_data[read_item.storage_index].relative_path
            raise unsafe_file_error(Path(self.reader.path) / where, error, f" (item {fqn})") from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_sharded(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` through ``SafeReader`` and ``SafeLoadPlanner``; a refusal is raised as itself, not inside
    DCP's per-rank report."""
    reader = SafeReader(path)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except dcp.api.CheckpointException as error:
        refused = [e for e, _ in error.failures.values() if isinstance(e, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise

