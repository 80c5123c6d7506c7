"""Any checkpoint the package writes → weights, config and tokenizer: one loader for ``generate`` and ``export``.

Kinds, told apart by what is on disk:
- a sharded directory written by ``MoEFSDPStrategy`` (``meta.pt`` + DCP shards), read in one process;
- a single-file Lightning ``.ckpt`` (``state_dict`` with ``model.`` keys, ``hyper_parameters``);
- an exported ``.pt`` (``{"config", "state_dict", "tokenizer"}``, written by ``export``);
- a Hugging Face directory (``config.json`` + safetensors), through ``moe_lightning.hf.from_pretrained``.

The tokenizer comes from the checkpoint itself: ``TextDataModule.state_dict`` records it on every save.
"""

import argparse
import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .dtypes import DTYPES
from .hf import from_pretrained
from .model import MoEConfig, MoETransformer
from .parallel.checkpoint import (METADATA_FILE, PARTIAL_SUFFIX, load_metadata, metadata_file, read_sharded_weights,
                                  resolve_checkpoint)
from .tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_spec

MODEL_PREFIX = "model."  # MoELanguageModel holds the transformer as ``self.model``


@dataclass
class Checkpoint:
    """What every kind reduces to: a plain config dict, transformer weights and the tokenizer spec."""

    kind: str
    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: dict


@contextlib.contextmanager
def single_process_dcp():
    """DCP warns "torch.distributed is disabled ... assuming the intent is to load in a single process" even when
    told so (``no_dist=True``): it is the intent here (export, generate read a sharded checkpoint in one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def folder_kind(path: Path) -> str:
    if (path / METADATA_FILE).is_file():
        return "sharded"
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"checkpoint={str(path)!r}: a folder, but neither a sharded checkpoint ({METADATA_FILE}) "
                     "nor a Hugging Face model (config.json).")


def recorded_tokenizer(metadata: dict) -> dict | None:
    """The spec a DataModule's ``state_dict`` (or ``export``) put in the checkpoint; bytes for our checkpoints
    older than that; ``None`` for a file converted from a Hugging Face folder, which records none."""
    if "tokenizer" in metadata and "hyper_parameters" not in metadata:  # an export: {"config", "state_dict", ...}
        return metadata["tokenizer"] or ByteTokenizer().spec()
    for value in metadata.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict) and "kind" in value["tokenizer"]:
            return value["tokenizer"]
    return ByteTokenizer().spec() if "hyper_parameters" in metadata else None


def tokenizer_spec(checkpoint: str | Path) -> dict | None:
    """``recorded_tokenizer`` of any of our checkpoint kinds (tensors memory-mapped, not read)."""
    path = resolve_checkpoint(Path(checkpoint))
    return recorded_tokenizer(load_metadata(metadata_file(path), mmap=True))


def checkpoint_tokenizer(checkpoint: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a checkpoint recorded, bytes when it recorded none."""
    return tokenizer_from_spec(tokenizer_spec(checkpoint) or ByteTokenizer().spec())


def _plain_config(hparams: dict, path: Path) -> dict:
    config = hparams.get("config")
    if config is None:
        raise ValueError(f"checkpoint={str(path)!r} has no hyper_parameters['config']: it was not written by "
                         "MoELanguageModel.")
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)


def read_checkpoint(checkpoint: str | Path) -> Checkpoint:
    """Weights, config and tokenizer of a sharded, single-file or exported checkpoint (on CPU)."""
    path = resolve_checkpoint(Path(checkpoint))
    if path.is_dir():
        if folder_kind(path) == "hf":
            raise ValueError(f"checkpoint={str(path)!r} is a Hugging Face folder: load it with load_model.")
        with single_process_dcp():
            weights, metadata = read_sharded_weights(path)
        kind = "sharded"
    else:  # a Lightning checkpoint or an export: plain data either way, never unpickled classes
        metadata = load_metadata(path)
        if not isinstance(metadata, dict) or "state_dict" not in metadata:
            raise ValueError(f"checkpoint={str(path)!r}: neither a Lightning checkpoint nor an export "
                             "(no 'state_dict').")
        if "hyper_parameters" not in metadata:
            return Checkpoint("export", metadata["config"], metadata["state_dict"],
                              metadata.get("tokenizer") or ByteTokenizer().spec())
        weights = {key[len(MODEL_PREFIX):]: t for key, t in metadata.pop("state_dict").items()
                   if key.startswith(MODEL_PREFIX)}
        kind = "lightning"
    return Checkpoint(kind, _plain_config(metadata.get("hyper_parameters", {}), path), weights,
                      recorded_tokenizer(metadata))


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
    """Write any checkpoint's model as one file ``{"config", "state_dict", "tokenizer"}`` (plain data: it loads
    with ``torch.load(..., weights_only=True)``), atomically."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"out={str(out)!r} exists; choose another path or pass --overwrite.")
    ckpt = read_checkpoint(checkpoint)
    weights = {key: t.to(dtype) if dtype is not None and t.is_floating_point() else t
               for key, t in ckpt.state_dict.items()}
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": ckpt.config, "state_dict": weights, "tokenizer": ckpt.tokenizer}, partial)
    os.replace(partial, out)
    return out


def export_main(argv: list[str] | None = None) -> None:
    """Write a checkpoint (sharded folder or single file) as one inference file that records its tokenizer."""
    parser = argparse.ArgumentParser(prog="moe-lightning export", description=export_main.__doc__)
    parser.add_argument("checkpoint", help="sharded checkpoint folder or single-file .ckpt")
    parser.add_argument("--out", required=True, help="output file (torch.save format)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="cast floating-point weights (default: keep the saved dtype)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out, DTYPES.get(args.dtype),
                            args.overwrite)
    print(f"wrote {out}")
