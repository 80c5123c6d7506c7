"""The checkpoint layer: every save (single file streamed through ``durable``; sharded, in the foreground or the
background, committed atomically with the ranks agreeing on the outcome), the one unpickling rule
(``load_metadata``), reading a sharded checkpoint in one process, and the cheap completeness check
(``verify_checkpoint``) that choosing ``--ckpt_path last`` relies on. ``loading.py`` reads models through it;
``runs.py`` chooses ``last`` and settles unfinished saves through it.

With expert parallelism each rank's FSDP DTensor for an expert stack only covers its ``E / ep``
experts, so two ``ep`` ranks would write different data under the same name. Before saving (and
loading), those tensors are re-described, without copying, as DTensors on the full expert mesh
with the ``ep`` split included: the checkpoint always holds global ``[E, ...]`` stacks and can be
loaded at any world size or ``ep``.

Loading never runs code from a file: metadata is plain data (the model config as a dict) and is read with
``torch.load(weights_only=True)``; DCP's own ``.metadata`` is unpickled admitting only the classes it is made of
(``SafeReader``), and its non-tensor items are read with ``weights_only=True`` (``SafeLoadPlanner``; DCP's
default reader and planner unpickle both without limits). Every sharded read goes through ``load_sharded``.
"""

import io
import os
import pickle
import re
import shutil
import warnings
import zipfile
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch import nn

from moe_lightning.run import durable
from moe_lightning.model import GroupedExperts, MoEConfig

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
PARTIAL_SUFFIX = durable.PARTIAL_SUFFIX
OLD_SUFFIX = ".old"
MARKER_FILE = ".written-by-moe-lightning"  # in every checkpoint directory we create: clean-up removes only these


def written_by_us(directory: Path) -> bool:
    return (directory / MARKER_FILE).is_file()


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


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The non-tensor state of a single-file or sharded checkpoint (``meta.pt``), tensors mapped, not read."""
    return load_metadata(metadata_file(resolve_checkpoint(Path(path))), mmap=True)


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


def expert_parameter_names(module: nn.Module) -> set[str]:
    return {f"{name}.{p}" if name else p for name, m in module.named_modules() if isinstance(m, GroupedExperts)
            for p, _ in m.named_parameters(recurse=False)}


def global_expert_view(tensor: DTensor, expert_mesh: DeviceMesh) -> DTensor:
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
                container[key] = global_expert_view(value, expert_mesh)

    if expert_mesh is not None:
        visit(state, False)
    try:
        yield state
    finally:
        for container, key, value in swapped:
            container[key] = value


DISK_FULL = durable.DISK_FULL


def disk_full_error(path: Path, needed: int | None) -> CheckpointError:
    """One line for a save the disk had no room for (``needed``: bytes this process writes, when known)."""
    free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    size = f"{needed:,} bytes needed, " if needed is not None else ""
    return CheckpointError(f"Checkpoint {path} was not written: the disk is full ({size}{free:,} bytes free on "
                           f"{path.parent}). Earlier checkpoints are intact; free space or save elsewhere.")


def _describe(error: BaseException) -> str:
    """One line for a failed write; DCP's exception lists each rank's error with its frames: keep the errors."""
    if isinstance(error, dcp.api.CheckpointException):
        return "; ".join(f"rank {rank}: {failure!r}" for rank, (failure, _) in sorted(error.failures.items()))
    return repr(error)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT anywhere in ``error``'s chain or DCP's per-rank failures; torch's zip writer reports a short
    write as "unexpected pos"."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in DISK_FULL or "unexpected pos" in str(error):
            return True
        if isinstance(error, dcp.api.CheckpointException):
            return any(is_disk_full(e) for e, _ in error.failures.values())
        error = error.__cause__ or error.__context__
    return False


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` streamed into ``path`` through ``durable.write_with`` (beside, synced, renamed, folder
    synced): never a truncated file under ``path``, never a whole-checkpoint buffer in memory."""
    try:
        durable.write_with(path, lambda file: torch.save(obj, file))
    except Exception as error:  # torch's zip writer reports a full disk as a RuntimeError ("unexpected pos")
        if is_disk_full(error):
            raise disk_full_error(path, None) from None
        raise


def local_part(full: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """The part of the global tensor ``full`` that ``like`` (a DTensor, e.g. a global expert view, or a plain
    tensor) holds on this rank."""
    if full.shape != like.shape:
        raise CheckpointError(f"{name}: the checkpoint holds shape {tuple(full.shape)}, the model {tuple(like.shape)}.")
    if not isinstance(like, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def commit_directory(partial: Path, path: Path) -> None:
    """Replace ``path`` by the fully written ``partial``; a crash at any point leaves a loadable checkpoint, and
    once this returns the new directory survives a power loss. Its files were synced by their writers
    (``durable``, DCP's ``sync_files``); here its entries and the renames are."""
    durable.fsync_directory(partial)
    old = path.with_name(path.name + OLD_SUFFIX)
    remove(old)
    if os.path.lexists(path):  # a symlink (``save_last="link"``) is moved aside as a link, never followed
        os.replace(path, old)
    os.replace(partial, path)
    durable.fsync_directory(path.parent)
    remove(old)


def remove(path: Path) -> None:
    """Delete a checkpoint file or directory; a symlink is unlinked, never followed (its target is another save)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or its previous version if a crash fell between the two renames of a commit."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if not path.exists() and old.exists():
        return old
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist.")
    return path


def verify_checkpoint(path: Path) -> None:
    """Raise ``CheckpointError`` saying what is wrong unless ``path`` is complete as far as can be checked without
    loading it. A file: its zip directory and every entry's CRC-32 (reads the file once). A sharded directory:
    ``meta.pt`` likewise, DCP's ``.metadata`` readable, and every shard file it names present and at least as long
    as the items it holds there (sizes only: no tensor is read)."""
    if not path.is_dir():
        _verify_zip(path)
        return
    _verify_zip(path / METADATA_FILE)
    needed: dict[str, int] = {}
    for item in SafeReader(path).read_metadata().storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing: its DCP metadata lists it.")
        if (actual := shard.stat().st_size) < size:
            raise CheckpointError(f"{shard} holds {actual:,} bytes; its DCP metadata needs {size:,}: truncated.")


def _verify_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path} is not a complete checkpoint file ({type(error).__name__}: {error}).") from None
    if damaged is not None:
        raise CheckpointError(f"{path}: its entry {damaged} fails its CRC-32 check: the file is damaged.")


def _local_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors this rank writes (its shards), in a nested state dict."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return local.numel() * local.element_size()
    return 0


def metadata_file(path: Path) -> Path:
    """The file holding a checkpoint's non-tensor state: ``path`` itself, or a sharded directory's ``meta.pt``.
    A directory that is no checkpoint is refused here, before anything is built."""
    if not path.is_dir():
        return path
    if not (path / METADATA_FILE).is_file():
        inside = sorted(p.name for p in path.iterdir() if p.name.endswith(".ckpt"))[:3]
        hint = f" It holds {', '.join(inside)}: pass one of those." if inside else ""
        raise ValueError(f"ckpt_path={str(path)!r} is a directory but not a checkpoint (a sharded checkpoint "
                         f"directory holds {METADATA_FILE} and DCP's .metadata).{hint}")
    return path / METADATA_FILE


class _HostCopyWriter(FileSystemWriter):
    """Stages for ``async_save`` by copying every tensor into new host memory. (Older torch staged with
    ``.to("cpu")``, which leaves a tensor already in host memory shared with training while it is written.)"""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, staged, type_check=False)


class ShardedCheckpointer:
    """Writes and reads sharded checkpoint directories; a directory that exists is complete.

    Every rank writes its shards with DCP into ``<path>.partial``, which already holds rank 0's ``meta.pt``;
    rank 0 renames it over ``path`` once its DCP save has returned. That return means every rank's write
    succeeded: DCP's finish step gathers all ranks' write results on rank 0 before writing ``.metadata``, and
    a failure on any rank fails the save on all. A crash at any point leaves the previous checkpoint.

    The ranks agree on the outcome of every step that only rank 0 performs (clearing the folder, ``meta.pt``, the
    commit): a failure flag is all-reduced where a barrier stood, so an exception on rank 0 (a full disk, say)
    is raised on every rank, naming it, instead of leaving the others waiting at a barrier.

    With ``background=True`` the state is copied to host memory and ``save`` returns; a thread writes it,
    coordinating over its own gloo group so that its collectives never interleave with training's. ``poll``
    (every training batch) asks all ranks whether their write has ended (one tiny all-reduce on a second gloo
    group, only while a save is pending): the commit, or the error, comes at the same batch on every rank.
    Checkpoints removed while a save is pending (Lightning's top-k rotation) are removed only once it is
    committed: until then the previous one is the only complete copy. One save at a time.
    """

    def __init__(self):
        self._pending: tuple[Future, Path, Path] | None = None  # (write, partial directory, final path)
        self._group: dist.ProcessGroup | None = None  # the background writer's
        self._agree_group: dist.ProcessGroup | None = None  # outcomes and polls; never used by the writer thread
        self._after_commit: list[Path] = []  # removals waiting for the pending save's commit

    @staticmethod
    def _is_rank_zero() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _make_groups(self) -> None:
        """Every rank calls ``save``/``load`` together, so the groups are created in step."""
        if dist.is_initialized() and self._agree_group is None:
            self._agree_group = dist.new_group(backend="gloo")
            self._group = dist.new_group(backend="gloo")

    def _all(self, value: bool) -> bool:
        if self._agree_group is None:
            return value
        flag = torch.tensor([int(value)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._agree_group)
        return bool(flag.item())

    def _agree(self, error: BaseException | None, path: Path) -> None:
        """Raise on every rank if ``error`` is set on any: the failing rank raises its own, the others one line
        naming the first failing rank and its message."""
        if self._agree_group is not None and not self._all(error is None):
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if error is None else str(error).strip().splitlines()[-1][:500],
                                   group=self._agree_group)
            if error is not None:
                raise error
            rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
            raise CheckpointError(f"Checkpoint {path} was not saved: rank {rank} failed: {message}")
        if error is not None:
            raise error

    def storage_writer(self, partial: Path) -> FileSystemWriter:
        return _HostCopyWriter(partial)

    def save(self, state: dict[str, Any], metadata: dict[str, Any], path: Path, expert_names: set[str],
             expert_mesh: DeviceMesh | None, background: bool = False) -> None:
        """Write ``state`` (DCP, every rank) and ``metadata`` (rank 0, plain data) as the directory ``path``."""
        self.wait()
        self._make_groups()
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        buffer = io.BytesIO()
        torch.save(metadata, buffer)  # small: the tensors are in ``state``
        error = None
        try:  # on every rank (each holds the same metadata): fail now, not at resume days later
            try:
                load_metadata(io.BytesIO(buffer.getvalue()))
            except CheckpointError as unsafe:
                raise CheckpointError(f"Checkpoint metadata for {path} must be plain data (a callback or the "
                                      f"LightningModule stored an object in it): {unsafe}") from None
            if partial.exists() and not written_by_us(partial):  # every rank checks, before rank 0 touches it
                raise CheckpointError(f"Cannot save {path}: {partial} exists and was not written by moe_lightning; "
                                      "move it away (the save would need that name).")
        except CheckpointError as failure:
            error = failure
        self._agree(error, path)
        if self._is_rank_zero():
            try:
                remove(partial)  # left behind by a run killed while writing (it carries our marker)
                partial.mkdir(parents=True)
                durable.write_bytes(partial / MARKER_FILE, b"")
                durable.write_bytes(partial / METADATA_FILE, buffer.getvalue())
            except Exception as failure:
                error = self._failed(failure, partial, path, len(buffer.getvalue()))
        self._agree(error, path)  # nobody writes into the directory before rank 0 has prepared it
        writer = self.storage_writer(partial)
        with global_expert_views(state, expert_names, expert_mesh):
            if background:
                # Returns once the writer has staged (copied) every tensor; the write runs in a thread.
                self._pending = (dcp.async_save(state, storage_writer=writer, process_group=self._group),
                                 partial, path)
                return
            try:
                dcp.save(state, storage_writer=writer)
            except BaseException as failure:  # DCP's CheckpointException is a BaseException
                if not is_disk_full(failure):
                    raise  # every rank has it: DCP gathers the ranks' results
                self._discard(partial)  # every rank's write has failed: give the space back
                raise disk_full_error(path, _local_bytes(state)) from None
        self._commit(partial, path)

    def poll(self) -> None:
        """Commit a background save once every rank's write has ended, or raise its error, at the same batch on
        every rank; never waits for the write."""
        if self._pending is not None and self._all(self._pending[0].done()):
            self.wait()

    def wait(self, agree: bool = True) -> None:
        """Block until the background save (if any) is written, then commit it; raise if it failed.
        ``agree=False`` after an exception, when the other ranks may not be here: no collective but the writer's."""
        if self._pending is None:
            return
        write, partial, path = self._pending
        self._pending = None
        try:
            write.result()
        except (Exception, dcp.api.CheckpointException) as failure:  # the latter is a BaseException
            self._after_commit.clear()  # the checkpoints they name stay: the save that replaced them failed
            if is_disk_full(failure):
                self._discard(partial)  # as for a save in the foreground: the space goes back
                error = disk_full_error(path, None)
            else:
                error = CheckpointError(f"Asynchronous checkpoint {path} failed while writing ({_describe(failure)}): "
                                        f"it was not committed (its files stay in {partial}); earlier checkpoints are "
                                        "intact.")
            error.__cause__ = failure
            if agree:
                self._agree(error, path)
            raise error
        self._commit(partial, path, agree)

    def remove_after_commit(self, path: Path) -> bool:
        """Remove ``path`` once the pending save is committed (``False``: none pending, remove it now)."""
        if self._pending is None:
            return False
        self._after_commit.append(path)
        return True

    @property
    def pending_path(self) -> Path | None:
        return self._pending[2] if self._pending is not None else None

    def _failed(self, failure: BaseException, partial: Path, path: Path, needed: int | None) -> BaseException:
        """What rank 0 reports for a failure of its own step: one line for a full disk, after giving the space back."""
        if not is_disk_full(failure):
            return failure
        self._discard(partial)
        return disk_full_error(path, needed)

    def _discard(self, partial: Path) -> None:
        """Delete a failed save's ``partial`` folder on rank 0, only if it carries the marker ``save`` wrote into it
        first (the one proof clean-up accepts that this package made it)."""
        if self._is_rank_zero() and written_by_us(partial):
            shutil.rmtree(partial)

    def _commit(self, partial: Path, path: Path, agree: bool = True) -> None:
        error, removals, self._after_commit = None, self._after_commit, []
        if self._is_rank_zero():
            try:
                commit_directory(partial, path)
                for old in removals:
                    if old != path:
                        remove(old)
            except Exception as failure:
                error = self._failed(failure, partial, path, None)
        if agree:
            self._agree(error, path)
        elif error is not None:
            raise error

    def load(self, path: Path, state: dict[str, Any], expert_names: set[str], expert_mesh: DeviceMesh | None) -> None:
        """Fill ``state`` in place from the directory ``path`` (read its metadata with ``load_metadata``)."""
        self.wait()
        with global_expert_views(state, expert_names, expert_mesh):
            load_sharded(state, path)


MODEL_KEYS = "state_dict.model."  # where a sharded checkpoint holds the ``MoETransformer`` weights


def sharded_model_index(path: Path) -> dict[str, TensorStorageMetadata]:
    """The model tensors of a sharded checkpoint by ``MoETransformer`` name, read in one process once its DCP
    metadata and every non-tensor item have been read as plain data: a tampered checkpoint is refused whole,
    naming the file, before any tensor is read."""
    entries = SafeReader(path).read_metadata().state_dict_metadata
    plain = {key: None for key, meta in entries.items() if isinstance(meta, BytesStorageMetadata)}
    if plain:
        load_sharded(plain, path, no_dist=True)
    if misplaced := [key for key in plain if key.startswith(MODEL_KEYS)]:
        raise CheckpointError(f"{path / '.metadata'} lists model weights that are not tensors ({misplaced[:3]}): "
                              "the checkpoint is damaged.")
    return {key[len(MODEL_KEYS):]: meta for key, meta in entries.items() if key.startswith(MODEL_KEYS)}


def read_sharded_tensors(path: Path, index: dict[str, TensorStorageMetadata], names: list[str]) -> dict[str, torch.Tensor]:
    """The named model tensors (global, in host memory) of the sharded checkpoint ``path`` indexed by ``index``."""
    state = {"state_dict": {f"model.{name}": torch.empty(index[name].size, dtype=index[name].properties.dtype)
                            for name in names}}
    load_sharded(state, path, no_dist=True)
    return {name: state["state_dict"][f"model.{name}"] for name in names}
