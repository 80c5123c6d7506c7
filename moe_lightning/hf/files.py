"""Safetensors directories: read tensors (or slices of them) from one file or an indexed set of shards, and
write shards plus ``model.safetensors.index.json`` one tensor at a time. Only JSON and safetensors are read:
nothing on disk is ever executed or unpickled."""

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from moe_lightning.run import durable
from moe_lightning.checkpoint import commit as ckpt
from moe_lightning.hf.mapping import HFFormatError

INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F32": torch.float32, "F64": torch.float64}


class SafetensorsDir:
    """Every tensor of a Hugging Face directory, opened lazily; ``get(key)[slices]`` reads only that region."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[str, object] = {}
        index = self.path / INDEX
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise HFFormatError(f"{str(self.path)!r} has no *.safetensors files (and no {INDEX}): save the model "
                                    f"with safe_serialization (pickled *.bin weights are never loaded).")
            self.weight_map = {key: f.name for f in files for key in self._open(f.name).keys()}

    def _open(self, name: str):
        if name not in self._handles:
            self._handles[name] = safe_open(self.path / name, framework="pt")
        return self._handles[name]

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def get(self, key: str):
        return self._open(self.weight_map[key]).get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.get(key).get_shape())

    def dtype(self, key: str) -> torch.dtype | str:
        """The stored dtype (safetensors' name where torch has none), read from the header only."""
        name = self._open(self.weight_map[key]).get_slice(key).get_dtype()
        return SAFETENSORS_DTYPES.get(name, name)


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFFormatError(f"{str(path)!r} has no config.json: pass a Hugging Face model directory.")
    return json.loads(file.read_text())


def write_directory(path: str | Path, hf_config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                    max_shard_bytes: int = 5 * 2**30, files: dict[str, str] | None = None) -> Path:
    """``config.json`` plus shards ``model-0000i-of-0000N.safetensors`` and their index, holding one shard in memory,
    and ``files`` (name -> text: the tokenizer's, say).

    Everything is written (``durable``: each file synced) to a sibling ``*.partial`` directory carrying the
    checkpoint marker, and the directory's other files (a tokenizer, say) are copied there; only then does it
    replace ``path`` (``checkpoint.commit_directory``), so a failure part-way (I/O, a refusal raised by
    ``tensors``) leaves the previous directory as it was.
    """
    path = Path(path)
    partial = path.with_name(path.name + ckpt.PARTIAL_SUFFIX)
    if partial.exists():
        if not ckpt.written_by_us(partial):
            raise FileExistsError(f"{partial} exists and was not written by moe_lightning: move it away (writing "
                                  f"{path} needs that name).")
        shutil.rmtree(partial)  # left by an interrupted save of ours
    partial.mkdir(parents=True)
    try:
        durable.write_bytes(partial / ckpt.MARKER_FILE, b"")
        _write_shards(partial, hf_config, tensors, max_shard_bytes)
        for name, text in (files or {}).items():
            durable.write_text(partial / name, text)
        for entry in path.iterdir() if path.is_dir() else []:
            if entry.name in ("config.json", INDEX, *(files or {})) or re.fullmatch(r"model.*\.safetensors", entry.name):
                continue  # a previous save's weights (or files replaced now) would otherwise mix with these
            if entry.is_dir():
                shutil.copytree(entry, partial / entry.name)
            elif entry.name != ckpt.MARKER_FILE:
                with entry.open("rb") as source:
                    durable.write_with(partial / entry.name, lambda file: shutil.copyfileobj(source, file))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    ckpt.commit_directory(partial, path)
    (path / ckpt.MARKER_FILE).unlink()  # marks the folder only while unfinished: a model folder to share is clean
    return path


def _write_shards(path: Path, hf_config: dict, tensors: Iterable[tuple[str, torch.Tensor]],
                  max_shard_bytes: int) -> None:
    shard, shard_bytes, names, weight_map, total, dtype = {}, 0, [], {}, 0, None

    def flush():
        name = f"part-{len(names):05d}.safetensors"
        durable.write_bytes(path / name, save(shard, metadata={"format": "pt"}))  # held twice while written: safetensors cannot stream
        names.append(name)
        weight_map.update({key: name for key in shard})

    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard[key] = tensor.detach().to("cpu").clone().contiguous()  # own storage: safetensors refuses shared views
        shard_bytes += nbytes
        total += nbytes
        if tensor.is_floating_point() and dtype is None and tensor.ndim == 2:
            dtype = tensor.dtype
    if shard or not names:
        flush()
    final = {n: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, n in enumerate(names)}
    for temp, name in final.items():
        os.replace(path / temp, path / name)
    index = {"metadata": {"total_size": total},
             "weight_map": {key: final[name] for key, name in sorted(weight_map.items())}}
    durable.write_text(path / INDEX, json.dumps(index, indent=2) + "\n")
    hf_config = {**hf_config, "torch_dtype": re.sub("^torch\\.", "", str(dtype or torch.float32))}
    durable.write_text(path / "config.json", json.dumps(hf_config, indent=2) + "\n")
