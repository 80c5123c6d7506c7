"""Sharded checkpoint directories: ``ShardedCheckpointer`` writes them (in the foreground or the background, committed
atomically with the ranks agreeing on the outcome) and reads them into a sharded model; one process reads their
model tensors by name (``sharded_model_index``, ``read_sharded_tensors``: ``loading.py``'s reader).

With expert parallelism each rank's FSDP DTensor for an expert stack only covers its ``E / ep``
experts, so two ``ep`` ranks would write different data under the same name. Before saving (and
loading), those tensors are re-described, without copying, as DTensors on the full expert mesh
with the ``ep`` split included: the checkpoint always holds global ``[E, ...]`` stacks and can be
loaded at any world size or ``ep``.
"""

import io
import shutil
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch import nn

from moe_lightning.checkpoint.commit import (MARKER_FILE, METADATA_FILE, PARTIAL_SUFFIX, commit_directory, is_disk_full,
                                             remove, written_by_us)
from moe_lightning.checkpoint.safe_load import CheckpointError, SafeReader, load_metadata, load_sharded
from moe_lightning.model import GroupedExperts
from moe_lightning.run import durable

def expert_parameter_names(module: nn.Module) -> set[str]:
    return {f"{name}.{p}" if name else p for name, m in module.named_modules() if isinstance(m, GroupedExperts)
            for p, _ in m.named_parameters(recurse=False)}


def global_expert_view(tensor: DTensor, expert_mesh: DeviceMesh) -> DTensor:
    """The same local shard, described on the expert mesh with experts split by its expert-parallel dimension
    first. The mesh's dimensions, in order: replicas, expert-parallel ranks, expert-shard ranks (placements are
    positional, so the order is the contract; ``parallel/mesh.py`` builds the mesh that way).

    Built like FSDP builds its own DTensors (no ``from_local``), so a shard kept in host memory (CPU
    offload, ``cpu_offload`` state dicts) is neither copied to the accelerator nor detached from the original.
    """
    if expert_mesh.ndim != 3:
        raise ValueError(f"global_expert_view needs the 3-D expert mesh (replicas, expert-parallel, expert-shard), "
                         f"got {expert_mesh.ndim} dimensions {expert_mesh.mesh_dim_names}.")
    ep = expert_mesh.size(1)
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


def _describe(error: BaseException) -> str:
    """One line for a failed write; DCP's exception lists each rank's error with its frames: keep the errors."""
    if isinstance(error, dcp.api.CheckpointException):
        return "; ".join(f"rank {rank}: {failure!r}" for rank, (failure, _) in sorted(error.failures.items()))
    return repr(error)


def local_part(full: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """The part of the global tensor ``full`` that ``like`` (a DTensor, e.g. a global expert view, or a plain
    tensor) holds on this rank."""
    if full.shape != like.shape:
        raise CheckpointError(f"{name}: the checkpoint holds shape {tuple(full.shape)}, the model {tuple(like.shape)}.")
    if not isinstance(like, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


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


class _ProgressingFileSystem(FileSystem):
    """DCP's file system whose written files report each write to the heartbeat (``durable.ProgressingFile``)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            yield durable.ProgressingFile(stream) if "w" in mode else stream


class _HostCopyWriter(FileSystemWriter):
    """Stages for ``async_save`` by copying every tensor into new host memory. (Older torch staged with
    ``.to("cpu")``, which leaves a tensor already in host memory shared with training while it is written.) Its
    files tell the heartbeat of every write: a long save is progress, not a stall."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ProgressingFileSystem()

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

    def use_groups(self, agree: dist.ProcessGroup | None, writer: dist.ProcessGroup | None) -> None:
        """The two gloo world groups (the strategy's side channels): outcomes and polls, and the background writer's.
        Without them (one process) every agreement is local."""
        self._agree_group, self._group = agree, writer

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
        if self._agree_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("ShardedCheckpointer.save on several processes needs its side channels first: call "
                               "use_groups() with two gloo world groups (MoEFSDPStrategy does; "
                               "parallel.mesh.world_side_channel makes one), else the ranks cannot agree on a save.")
        self.wait()
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
                raise durable.disk_full_error(path, _local_bytes(state)) from None
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
                error = durable.disk_full_error(path)
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
        return durable.disk_full_error(path, needed)

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
