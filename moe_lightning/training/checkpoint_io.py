"""Lightning's face of the checkpoint layer's single-file writer (apart, so that ``generate``/``export`` reading
``parallel.checkpoint`` never import Lightning)."""

from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from moe_lightning.checkpoint.sharded import remove, save_file


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
