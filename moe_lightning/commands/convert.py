"""``moe-lightning convert`` (HF directory <-> single-file ``.pt``) and ``moe-lightning export --hf``.

Our checkpoints are read one tensor at a time (a sharded checkpoint through DCP, a single file memory-mapped),
so writing a Hugging Face directory never holds more than one shard of it.
"""

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from moe_lightning.dtypes import DTYPES
from moe_lightning.commands.loading import export_checkpoint, open_checkpoint, stream_model_file
from moe_lightning.model import MoEConfig
import moe_lightning.hf.fp8 as fp8
from moe_lightning.hf.mapping import refuse_non_finite
from moe_lightning.hf.pretrained import FAMILIES, OpenPretrained, kept_keys, stored_dtype_getter, write_pretrained
from moe_lightning.hf.tokenizer_files import tokenizer_files
from moe_lightning.run.refusals import CommandParser



def _cast(get: Callable[[str], torch.Tensor], dtype: torch.dtype | None,
          fp8_blocks: bool = False) -> Callable[[str], torch.Tensor]:
    if dtype is None:
        return get

    def cast(name: str) -> torch.Tensor:
        tensor = get(name)  # the balancing bias stays float32, as the router computes in float32
        if fp8_blocks and fp8.quantized(name):
            return tensor  # quantised from the values as trained: a cast first would round them twice
        return tensor.to(dtype) if tensor.is_floating_point() and not name.endswith("expert_bias") else tensor
    return cast


def export_hf(checkpoint: str | Path, out: str | Path, architecture: str | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30, fp8_blocks: bool = False) -> Path:
    """Any of our checkpoints (sharded or single-file) as a Hugging Face directory, tensor by tensor, with the
    ``tokenizer.json`` and ``tokenizer_config.json`` of the tokenizer the run recorded (the byte tokenizer too).
    ``fp8_blocks``: the attention and FFN weights as 128 x 128 FP8 blocks (the DeepSeek-V3 / Kimi K2 release
    format); ``dtype`` then casts the other tensors. A model that came from a Hugging Face folder keeps that folder's
    ``model_type`` and ``auto_map`` (a Kimi K2 stays ``kimi_k2``)."""
    opened = open_checkpoint(checkpoint)  # tokenizer None: a file converted from Hugging Face records none
    config = MoEConfig(**opened.config)
    files = tokenizer_files(opened.tokenizer, config.max_seq_len) if opened.tokenizer is not None else None
    get = stored_dtype_getter(opened.get, opened.stored_dtypes)
    return write_pretrained(config, _cast(get, dtype, fp8_blocks), out, architecture, max_shard_bytes, files,
                            fp8_blocks, opened.hf_kept)


def hf_to_file(src: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A Hugging Face directory as the package's ``.pt`` (``loading.stream_model_file``), one tensor in memory at a
    time: each stored dtype kept (the balancing bias read in float32, its stored dtype recorded, so converting back
    is bit-identical), block-FP8 weights dequantised to float32 (``--fp8-blocks`` then writes the same blocks and
    scales back), ``dtype`` casting everything; the folder's ``model_type`` and ``auto_map`` kept for the way
    back. A tensor holding inf or NaN is refused, naming it."""
    opened = OpenPretrained(src, dtype, fp8_dtype=torch.float32)
    skeleton = {}
    for name in opened.names:  # uninitialised: no page is touched until a tensor's bytes are written to the file
        skeleton[name] = torch.empty(opened.shape(name), dtype=opened.dtype(name))
    if opened.config.tie_embeddings:
        skeleton["output.weight"] = skeleton["tok_embeddings.weight"]
    return stream_model_file(out, dataclasses.asdict(opened.config), skeleton,
                             lambda name: refuse_non_finite(opened.read(name), name), None, opened.widened,
                             kept_keys(opened.hf, src))


def _hf_options(parser: argparse.ArgumentParser) -> None:
    """What only writing a Hugging Face directory takes."""
    parser.add_argument("--architecture", choices=sorted(FAMILIES), default=None,
                        help="Hugging Face target when the model could be several (default: the one that fits)")
    parser.add_argument("--shard-gb", type=float, default=None, help="largest safetensors shard, GiB (default 5)")
    parser.add_argument("--fp8-blocks", action="store_true", default=None,
                        help="write attention and FFN weights as float8_e4m3fn 128 x 128 blocks with *_scale_inv "
                             "(the DeepSeek-V3 / Kimi K2 release format); --dtype then casts the other tensors")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="cast floating-point weights (default: keep the saved dtype)")
    parser.add_argument("--overwrite", action="store_true")
    _hf_options(parser)


def _refuse_hf_options(parser: argparse.ArgumentParser, args: argparse.Namespace, why: str) -> None:
    for flag, value in (("--architecture", args.architecture), ("--shard-gb", args.shard_gb),
                        ("--fp8-blocks", args.fp8_blocks)):
        if value is not None:
            parser.error(f"{flag} only applies when writing a Hugging Face directory, but {why}: drop {flag}.")


def _shard_bytes(args: argparse.Namespace) -> int:
    return int((5.0 if args.shard_gb is None else args.shard_gb) * 2**30)


def _refuse_existing(out: str, overwrite: bool) -> None:
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"--out {out!r} exists; choose another path or pass --overwrite.")


def convert_main(argv: list[str] | None = None) -> None:
    """``moe-lightning convert SRC --out DST``: a Hugging Face directory to a ``.pt`` file, or any of our
    checkpoints (``.pt``, ``.ckpt``, sharded directory) to a Hugging Face directory."""
    parser = CommandParser(prog="moe-lightning convert", description=convert_main.__doc__)
    parser.add_argument("src", help="Hugging Face directory (with config.json), or one of our checkpoints")
    _common(parser)
    args = parser.parse_args(argv)
    _refuse_existing(args.out, args.overwrite)
    dtype = DTYPES.get(args.dtype)
    if (Path(args.src) / "config.json").is_file():
        _refuse_hf_options(parser, args, f"{args.src!r} is one (it is converted to the .pt file {args.out!r})")
        out = hf_to_file(args.src, args.out, dtype)
    else:
        out = export_hf(args.src, args.out, args.architecture, dtype, _shard_bytes(args), bool(args.fp8_blocks))
    print(f"wrote {out}")


def export_main(argv: list[str] | None = None) -> None:
    """``moe-lightning export CKPT --out FILE`` writes any checkpoint (sharded folder, .ckpt, .pt) as one inference
    file that records its tokenizer; with ``--hf``, a Hugging Face directory (and its tokenizer files). A
    checkpoint holding inf or NaN is refused, naming the tensor."""
    parser = CommandParser(prog="moe-lightning export", description=export_main.__doc__)
    parser.add_argument("checkpoint", help="sharded checkpoint directory, Lightning .ckpt or .pt file")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face directory (config.json, safetensors, tokenizer) instead of a .pt")
    _common(parser)
    args = parser.parse_args(argv)
    if not args.hf:
        _refuse_hf_options(parser, args, f"without --hf {args.out!r} is a .pt file")
        out = export_checkpoint(args.checkpoint, args.out, DTYPES.get(args.dtype), args.overwrite)
    else:
        _refuse_existing(args.out, args.overwrite)
        out = export_hf(args.checkpoint, args.out, args.architecture, DTYPES.get(args.dtype), _shard_bytes(args),
                        bool(args.fp8_blocks))
    print(f"wrote {out}")
