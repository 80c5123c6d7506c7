"""Lightning's face of the checkpoint layer (``checkpoint/``, which never imports Lightning, so that ``generate`` and
``export`` do not): the single-file writer and the strategy's checkpoint hooks."""

from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from moe_lightning.checkpoint.commit import remove, resolve_checkpoint, save_file
from moe_lightning.checkpoint.discovery import checkpoint_metadata
from moe_lightning.checkpoint.safe_load import CheckpointError
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.checkpoint.state import load_state, save_state
from moe_lightning.run.durable import DiskFullError


class FileCheckpointIO(TorchCheckpointIO):
    """Lightning's single-file checkpoint I/O, except that the file is written through ``save_file`` (streamed,
    beside, synced, renamed) and a removal never follows a symlink (``save_last="link"``). A URL
    (``s3://...``) is not a local path: Lightning's own fsspec writer saves and removes it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        save_file(checkpoint, Path(path))

    def remove_checkpoint(self, path: str | Path) -> None:
        if "://" in str(path):
            return super().remove_checkpoint(path)
        remove(Path(path))


class CheckpointHooks:
    """``MoEFSDPStrategy``'s checkpoint methods, each delegated to ``checkpoint/``: sharded saves and loads written at
    any world size or ``ep`` (``checkpoint/state.py``), Lightning's top-k rotation, and the lifecycle of background
    saves (``ShardedCheckpointer``: committed at a batch boundary, waited for when fit ends, finished after an
    exception). A mixin of the strategy: it reads the strategy's ``checkpointer``, ``parallel`` (its expert mesh),
    ``lightning_module``, ``model``, ``optimizers`` and ``async_checkpoint``."""

    checkpointer: ShardedCheckpointer
    _fitting: bool = False  # background saves only inside fit
    _restoring: Path | None = None  # the checkpoint whose plain data load_checkpoint returned

    @property
    def _expert_mesh(self):
        """The expert mesh of expert parallelism (checkpoints hold global expert views), None without it or before
        the layout is built (a single-file restore in one process)."""
        return None if self.parallel is None else self.parallel.expert

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """A sharded directory, visible only once complete (see ``ShardedCheckpointer``)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        save_state(self.checkpointer, checkpoint, Path(self.broadcast(str(filepath))), self.lightning_module,
                   self._expert_mesh, background=self.async_checkpoint and self._fitting)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The plain data of a sharded directory or a single file, read as data only (never code). Its tensors load in
        ``load_model_state_dict``, which Lightning calls after ``LightningModule.on_load_checkpoint`` checked it."""
        self._restoring = resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        return checkpoint_metadata(self._restoring)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """The model's and the optimizers' shards (the optimizers exist: the strategy restores after its setup)."""
        path, self._restoring = self._restoring, None
        load_state(self.checkpointer, path, checkpoint, self.lightning_module, self.model, self.optimizers,
                   self._expert_mesh, strict, flatten_optimizer=getattr(self, "pipeline", None) is not None)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Lightning's top-k rotation removes the previous checkpoint as a new save starts: while that save is written
        in the background, the removal waits for its commit (the previous one is the only complete copy)."""
        if not self.checkpointer.remove_after_commit(Path(filepath)):
            super().remove_checkpoint(filepath)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._fitting = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.checkpointer.poll()  # commit a finished background save, or raise its error

    def on_train_end(self) -> None:
        super().on_train_end()
        self._fitting = False
        self.checkpointer.wait()
        self.barrier()  # the last checkpoint is visible to every rank when fit returns

    def on_exception(self, exception: BaseException) -> None:
        try:  # a save started before the failure holds a consistent state: finish it (the other ranks may be
            self.checkpointer.wait(agree=False)  # elsewhere: no collective of ours)
        except (CheckpointError, DiskFullError) as error:
            rank_zero_warn(str(error))
        super().on_exception(exception)

    def teardown(self) -> None:
        self.checkpointer.wait(agree=False)
        super().teardown()
