"""Any checkpoint the package writes → weights, config and tokenizer: the one reader for ``generate``, ``export``
and ``convert``, and the one ``.pt`` format.

Kinds, told apart by what is on disk:
- a sharded directory written by ``MoEFSDPStrategy`` (``meta.pt`` + DCP shards), read in one process;
- a single-file Lightning ``.ckpt`` (``state_dict`` with ``model.`` keys, ``hyper_parameters``);
- the package's ``.pt`` (``write_model_file``: written by ``export`` and ``convert``);
- a Hugging Face directory (``config.json`` + safetensors), through ``moe_lightning.hf.from_pretrained``.

Every file is unpickled by ``safe_load.load_metadata`` (plain data only), memory-mapped: what is not read (a
``.ckpt``'s optimizer state) costs no memory. The tokenizer comes from the checkpoint itself:
``TextDataModule.state_dict`` records it on every save.
"""

import dataclasses
import io
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_lightning.hf import from_pretrained
from moe_lightning.hf.files import read_config
from moe_lightning.hf.pretrained import kept_keys
from moe_lightning.hf.mapping import refuse_non_finite
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.checkpoint.commit import METADATA_FILE, is_disk_full, resolve_checkpoint, save_file
from moe_lightning.run import durable
from moe_lightning.checkpoint.discovery import checkpoint_metadata
from moe_lightning.checkpoint.safe_load import load_metadata, single_process_dcp
from moe_lightning.checkpoint.sharded import read_sharded_tensors, sharded_model_index
from moe_lightning.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_spec

MODEL_PREFIX = "model."  # MoELanguageModel holds the transformer as ``self.model``


def _payload(config: dict, state_dict: dict[str, torch.Tensor], tokenizer: dict | None,
             stored_dtypes: dict[str, torch.dtype] | None, hf_kept: dict | None) -> dict:
    payload = {"config": config, "state_dict": state_dict, "tokenizer": tokenizer}
    if stored_dtypes:
        payload["stored_dtypes"] = {name: str(dtype).removeprefix("torch.") for name, dtype in stored_dtypes.items()}
    if hf_kept:
        payload["hf_kept"] = hf_kept
    return payload


def write_model_file(path: str | Path, config: dict, state_dict: dict[str, torch.Tensor], tokenizer: dict | None,
                     stored_dtypes: dict[str, torch.dtype] | None = None, hf_kept: dict | None = None) -> Path:
    """The package's one ``.pt`` format, plain data (it loads with ``torch.load(..., weights_only=True)``):
    ``config`` (``MoEConfig`` fields), ``state_dict`` (``MoETransformer`` names), ``tokenizer`` (the spec the run
    recorded; ``None``: none recorded, e.g. converted from Hugging Face) and, optionally, ``stored_dtypes``
    (name -> dtype name of tensors held wider than the source stored them, so converting back is bit-identical)
    and ``hf_kept`` (``hf.kept_keys`` of the Hugging Face folder it came from: its ``model_type``, ``auto_map`` and
    the text of the code ``auto_map`` names).
    Streamed to disk atomically (``commit.save_file``)."""
    save_file(_payload(config, state_dict, tokenizer, stored_dtypes, hf_kept), Path(path))
    return Path(path)


def stream_model_file(path: str | Path, config: dict, skeleton: dict[str, torch.Tensor],
                      read: Callable[[str], torch.Tensor], tokenizer: dict | None,
                      stored_dtypes: dict[str, torch.dtype] | None = None, hf_kept: dict | None = None) -> Path:
    """``write_model_file``'s format with one tensor in memory at a time. ``skeleton``: uninitialised tensors of the
    final shapes and dtypes (a tied head the embedding's own object), whose pages are never touched. They are saved
    with their bytes skipped (``torch.serialization.skip_data`` reserves each storage's record), then each record is
    filled from ``read(name)`` (``os.pwrite``), at the offset the file itself gives (``_records``), and its CRC-32
    (written at save time for the skipped bytes) set to the bytes written, so the zip checks as intact."""
    path = Path(path)

    def write(file) -> None:
        with torch.serialization.skip_data():
            torch.save(_payload(config, skeleton, tokenizer, stored_dtypes, hf_kept), file)
        file.flush()
        for name, record in _records(file, list(skeleton)).items():
            tensor = read(name)
            if tensor.shape != skeleton[name].shape or tensor.dtype != skeleton[name].dtype:
                raise ValueError(f"{name}: read {tuple(tensor.shape)} {tensor.dtype}, but the file reserved "
                                 f"{tuple(skeleton[name].shape)} {skeleton[name].dtype}.")
            crc = struct.pack("<I", _write_at(file.fileno(), tensor, record.data_offset))
            for crc_offset in record.crc_offsets:
                os.pwrite(file.fileno(), crc, crc_offset)
            del tensor
    try:
        durable.write_with(path, write)
    except Exception as error:
        if is_disk_full(error):
            raise durable.disk_full_error(path) from None
        raise
    return path


def _write_at(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Writes ``tensor``'s bytes at ``offset`` (``pwrite`` may write less than asked: about 2 GiB at most on Linux);
    returns their CRC-32."""
    data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return zlib.crc32(data)


class _StorageKeys(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` with each tensor replaced by its storage's record key (nothing else is built:
    only plain containers, storage types and the tensor rebuild function are resolved)."""

    def persistent_load(self, pid):
        return pid[2]  # ("storage", storage type, key, location, numel)

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name.startswith("_rebuild_tensor"):  # its first argument is the storage
            return lambda key, *rest: key
        storage = module in ("torch", "torch.storage") and name.endswith("Storage")
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if storage or dtype or (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a file just written")


@dataclass(frozen=True)
class _Record:
    """Where a stored (uncompressed) zip record's bytes start, and where its CRC-32 is written: in its central
    directory entry (byte 16) and in its local header (byte 14) or, when the header defers it (flag bit 3, as
    torch's writer does), in the data descriptor after the bytes (after its optional ``PK\\x07\\x08``)."""
    data_offset: int
    crc_offsets: tuple[int, int]


def _records(file, names: list[str]) -> dict[str, _Record]:
    """Where in ``file`` (a torch.save zip, flushed, readable) each name's storage record lies, from the zip
    directory, the records' local headers and ``data.pkl`` (which record each tensor is); one name per storage."""
    archive = zipfile.ZipFile(file)
    pickled = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    keys = _StorageKeys(io.BytesIO(archive.read(pickled))).load()["state_dict"]
    central = _central_entries(file, archive.start_dir, len(archive.infolist()))
    records = {}
    for info in archive.infolist():
        if match := re.fullmatch(r"[^/]+/data/(\d+)", info.filename):
            file.seek(info.header_offset)
            flags, name_length, extra_length = struct.unpack("<6xH18x2H", file.read(30))
            data_offset = info.header_offset + 30 + name_length + extra_length
            local_crc = info.header_offset + 14
            if flags & 0x08:
                file.seek(local_crc := data_offset + info.file_size)
                local_crc += 4 if file.read(4) == b"PK\x07\x08" else 0
            records[match[1]] = _Record(data_offset, (local_crc, central[info.filename] + 16))
    first = {}
    for name in names:
        first.setdefault(keys[name], name)
    return {name: records[key] for key, name in first.items()}


def _central_entries(file, start: int, count: int) -> dict[str, int]:
    """Each file name's central directory entry offset (46 fixed bytes, then name, extra field and comment)."""
    entries, offset = {}, start
    for _ in range(count):
        file.seek(offset)
        signature, name_length, extra_length, comment_length = struct.unpack("<4s24x3H12x", file.read(46))
        if signature != b"PK\x01\x02":
            raise ValueError(f"no zip central directory entry at byte {offset} of a file just written")
        entries[file.read(name_length).decode()] = offset
        offset += 46 + name_length + extra_length + comment_length
    return entries


@dataclass
class Checkpoint:
    """What every kind reduces to: a plain config dict, transformer weights and the tokenizer spec."""

    kind: str
    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: dict


@dataclass
class OpenCheckpoint:
    """A checkpoint opened without reading its tensors: ``read(names)`` reads those model tensors only."""

    kind: str  # "sharded", "lightning" or "export" (the .pt)
    config: dict
    names: list[str]
    read: Callable[[list[str]], dict[str, torch.Tensor]]
    tokenizer: dict | None  # None: the checkpoint records none (a file converted from Hugging Face)
    stored_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    hf_kept: dict | None = None  # hf.kept_keys of the Hugging Face folder the model came from

    def get(self, name: str) -> torch.Tensor:
        return self.read([name])[name]


def folder_kind(path: Path) -> str:
    if (path / METADATA_FILE).is_file():
        return "sharded"
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"checkpoint={str(path)!r}: a folder, but neither a sharded checkpoint ({METADATA_FILE}) "
                     "nor a Hugging Face model (config.json).")


def recorded_tokenizer(metadata: dict) -> dict | None:
    """The spec a DataModule's ``state_dict`` (or ``export``) put in the checkpoint; bytes for our checkpoints
    older than that; ``None`` for a ``.pt`` that records none (converted from a Hugging Face folder)."""
    if "hyper_parameters" not in metadata:  # the .pt format
        return metadata.get("tokenizer")
    for value in metadata.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict) and "kind" in value["tokenizer"]:
            return value["tokenizer"]
    return ByteTokenizer().spec()


def pretrained_kept(metadata: dict) -> dict | None:
    """``hf.kept_keys`` of the Hugging Face folder a run started from (``model.pretrained``), when it is still
    there to read."""
    pretrained = (metadata.get("hyper_parameters") or {}).get("pretrained")
    if not pretrained or not (Path(pretrained) / "config.json").is_file():
        return None
    return kept_keys(read_config(pretrained), pretrained)


def tokenizer_spec(checkpoint: str | Path) -> dict | None:
    """``recorded_tokenizer`` of any of our checkpoint kinds (tensors memory-mapped, not read)."""
    return recorded_tokenizer(checkpoint_metadata(checkpoint))


def checkpoint_tokenizer(checkpoint: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a checkpoint recorded, bytes when it recorded none."""
    return tokenizer_from_spec(tokenizer_spec(checkpoint) or ByteTokenizer().spec())


def _plain_config(config, path: Path) -> dict:
    if config is None:
        raise ValueError(f"checkpoint={str(path)!r} has no model config (hyper_parameters['config']): it was not "
                         "written by MoELanguageModel, `moe-lightning export` or `convert`.")
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)


def _dtype(name: str, path: Path) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint={str(path)!r}: stored_dtypes names {name!r}, which is not a torch dtype.")
    return dtype


def open_checkpoint(checkpoint: str | Path) -> OpenCheckpoint:
    """The one reader of our checkpoints (sharded directory, Lightning ``.ckpt``, ``.pt``): config, tokenizer and a
    reader of model tensors by name. Nothing but the metadata is read until ``read`` asks."""
    path = resolve_checkpoint(Path(checkpoint))
    if path.is_dir():
        if folder_kind(path) == "hf":
            raise ValueError(f"checkpoint={str(path)!r} is a Hugging Face folder: load it with load_model.")
        metadata = load_metadata(path / METADATA_FILE, mmap=True)  # refuses an unsafe file before any tensor
        config = _plain_config(metadata.get("hyper_parameters", {}).get("config"), path)
        index = sharded_model_index(path)

        def read_sharded(names: list[str]) -> dict[str, torch.Tensor]:
            with single_process_dcp():
                return read_sharded_tensors(path, index, names)
        return OpenCheckpoint("sharded", config, list(index), read_sharded, recorded_tokenizer(metadata),
                              hf_kept=pretrained_kept(metadata))
    payload = load_metadata(path, mmap=True)  # mapped: an optimizer state beside the weights is never read
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise ValueError(f"checkpoint={str(path)!r}: neither a Lightning checkpoint nor a .pt of this package "
                         "(no 'state_dict').")
    state = payload["state_dict"]
    if "hyper_parameters" not in payload:  # the .pt format
        stored = {name: _dtype(value, path) for name, value in payload.get("stored_dtypes", {}).items()}
        return OpenCheckpoint("export", _plain_config(payload.get("config"), path), list(state),
                              lambda names: {name: state[name] for name in names}, recorded_tokenizer(payload), stored,
                              payload.get("hf_kept"))
    names = [key[len(MODEL_PREFIX):] for key in state if key.startswith(MODEL_PREFIX)]
    return OpenCheckpoint("lightning", _plain_config(payload["hyper_parameters"].get("config"), path), names,
                          lambda names: {name: state[MODEL_PREFIX + name] for name in names},
                          recorded_tokenizer(payload), hf_kept=pretrained_kept(payload))


def read_checkpoint(checkpoint: str | Path) -> Checkpoint:
    """Weights (all of them, on CPU; a single file's stay memory-mapped), config and tokenizer of any of ours."""
    opened = open_checkpoint(checkpoint)
    return Checkpoint(opened.kind, opened.config, opened.read(opened.names),
                      opened.tokenizer or ByteTokenizer().spec())


@dataclass
class Loaded:
    """The model (eval mode), its run's tokenizer and the checkpoint kind; unpacks as ``model, tokenizer``."""

    model: MoETransformer
    tokenizer: ByteTokenizer | HFTokenizer
    kind: str

    def __iter__(self):
        return iter((self.model, self.tokenizer))


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Loaded:
    """A ready-to-sample model (eval mode) and the tokenizer its run used."""
    path = Path(checkpoint)
    if path.is_dir() and folder_kind(path) == "hf":
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"checkpoint={str(path)!r}: a Hugging Face folder without tokenizer.json; copy "
                                    "the model's tokenizer.json (and tokenizer_config.json) into it.")
        model = from_pretrained(path, dtype=dtype).to(device).eval()
        return Loaded(model, HFTokenizer(str(path / "tokenizer.json")), "hf")
    ckpt = read_checkpoint(path)
    with torch.device(device):
        model = MoETransformer(MoEConfig(**ckpt.config))
    model.load_state_dict(ckpt.state_dict, strict=True)
    return Loaded(model.to(dtype=dtype).eval(), tokenizer_from_spec(ckpt.tokenizer), ckpt.kind)


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                      overwrite: bool = False) -> Path:
    """Write any checkpoint's model as the package's ``.pt`` (``write_model_file``); a tensor holding inf or NaN is
    refused, naming it, before anything is written."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"out={str(out)!r} exists; choose another path or pass --overwrite.")
    ckpt = read_checkpoint(checkpoint)
    weights = {key: refuse_non_finite(t.to(dtype) if dtype is not None and t.is_floating_point() else t, key)
               for key, t in ckpt.state_dict.items()}
    return write_model_file(out, ckpt.config, weights, ckpt.tokenizer)
