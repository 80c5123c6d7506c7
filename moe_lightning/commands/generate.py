"""``moe-lightning generate CKPT --prompt TEXT``: continue a prompt from any checkpoint kind, streaming the text.

The model and tokenizer come from ``loading.load_model`` (the tokenizer the run recorded). ``predict``
(``MoELanguageModel.predict_step``) samples through the same ``stream``.
"""

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from moe_lightning.dtypes import DTYPES
from moe_lightning.model.sampling import Sampling, stream
from moe_lightning.run.refusals import CommandParser


def add_sampling_arguments(parser) -> list[str]:
    """The sampling flags of ``generate`` and ``predict``, spelled and defaulted once (``parser``: argparse's or
    jsonargparse's); returns their destinations, the keyword arguments of ``sampling_from``."""
    default = Sampling()
    parser.add_argument("--max-new-tokens", type=int, default=default.max_new_tokens, help="tokens to sample")
    parser.add_argument("--temperature", type=float, default=default.temperature, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=default.top_k, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=default.top_p,
                        help="nucleus sampling: sample among the most likely tokens holding this probability mass")
    parser.add_argument("--stop", action=argparse.BooleanOptionalAction, default=default.stop_at_eod,
                        help="end a sample at the end-of-document token (--no-stop: always max-new-tokens)")
    parser.add_argument("--seed", type=int, default=default.seed, help="sampling seed (sample or prompt i: seed + i)")
    return ["max_new_tokens", "temperature", "top_k", "top_p", "stop", "seed"]


def sampling_from(stop: bool = Sampling.stop_at_eod, **flags) -> Sampling:
    """``Sampling`` from the parsed flags of ``add_sampling_arguments`` (those not given keep their defaults)."""
    return Sampling(stop_at_eod=stop, **flags)


def encode_prompt(tokenizer, text: str, device: torch.device | str) -> torch.Tensor:
    """``[1, S]``: end-of-document first, as every training document follows one (an empty prompt works too)."""
    ids = [tokenizer.eos_id, *tokenizer.encode(text).tolist()]
    return torch.tensor([ids], dtype=torch.long, device=device)


def stream_text(tokens: Iterator[int], tokenizer) -> Iterator[str]:
    """Text pieces as tokens arrive; a multi-byte character is held back until its last byte arrives."""
    ids: list[int] = []
    shown = 0
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids)
        stable = len(text.rstrip("\ufffd"))
        if stable > shown:
            yield text[shown:stable]
            shown = stable
    text = tokenizer.decode(ids)
    if len(text) > shown:
        yield text[shown:]


def default_dtype(device: str) -> str:
    """bf16 on CUDA (where the experts take the grouped-mm path only in bf16), fp32 elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def read_prompt_file(path: str, flag: str = "--prompt-file") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{flag}={path!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                         f"offset {error.start}); save it as UTF-8.") from None


def read_prompts(path: str) -> list[dict]:
    """``predict``'s JSONL prompts, every record checked before anything is loaded or written."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompts={path!r}: no such file; pass a JSONL file with a 'prompt' field per line.")
    records = []
    for line_no, line in enumerate(read_prompt_file(path, "--prompts").split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_no}: not a JSON record ({error.msg}); each line is one JSON object "
                             "with a text field 'prompt'.") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{line_no}: each record needs a text field 'prompt'.")
        records.append(record)
    if not records:
        raise ValueError(f"--prompts={path!r} holds no prompt: write one JSON record per line, e.g. "
                         '{"prompt": "Once upon a time"}.')
    return records


def warn_long_prompts(lengths: list[int], max_seq_len: int, where: str) -> None:
    """The model sees at most ``max_seq_len`` tokens (``MoETransformer.generate_stream`` keeps the newest): say
    which prompts lose their beginning rather than continue them silently from a cut text."""
    long = [(i, n) for i, n in enumerate(lengths) if n > max_seq_len]
    if long:
        shown = ", ".join(f"prompt {i + 1} ({n} tokens)" for i, n in long[:5]) + (" ..." if len(long) > 5 else "")
        warnings.warn(f"{where}: {len(long)} prompt(s) longer than model.config.max_seq_len={max_seq_len} tokens "
                      f"(with the end-of-document token that starts each): {shown}; the model continues only their "
                      f"last {max_seq_len} tokens.", stacklevel=2)


def main(argv: list[str] | None = None) -> None:
    """Continue a prompt with a trained model (any checkpoint: .ckpt, sharded folder, exported .pt, HF folder)."""
    parser = CommandParser(prog="moe-lightning generate", description=main.__doc__)
    parser.add_argument("checkpoint", help="checkpoint file or folder written by moe-lightning")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="text to continue (default: start a new document)")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    sampling_keys = add_sampling_arguments(parser)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype or default_dtype(args.device)]
    sampling = sampling_from(**{key: getattr(args, key) for key in sampling_keys})
    if args.num_samples < 1:
        parser.error(f"--num-samples={args.num_samples}: must be >= 1.")
    prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt or ""

    from moe_lightning.commands.loading import load_model  # after argument checks: loading a checkpoint is the slow part

    loaded = load_model(args.checkpoint, device=args.device, dtype=dtype)
    prompt_1S = encode_prompt(loaded.tokenizer, prompt, args.device)
    warn_long_prompts([prompt_1S.shape[1]], loaded.model.config.max_seq_len, "generate")
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"\n--- sample {i + 1}/{args.num_samples} ---", flush=True)
        sys.stdout.write(prompt)
        sample = dataclasses.replace(sampling, seed=sampling.seed + i)
        for piece in stream_text(stream(loaded.model, prompt_1S, sample, loaded.tokenizer.eos_id), loaded.tokenizer):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
