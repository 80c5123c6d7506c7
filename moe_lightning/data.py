"""Text → tokens → fixed-length training sequences, with a deterministic train/validation split.

Sources (``source`` accepts one or a list):
- ``stdlib``: the running interpreter's standard-library ``.py`` files (every machine has them);
- a text file, a folder (searched recursively), or a glob pattern;
- a ``.jsonl`` file whose records carry the text under ``text_field``;
- a ``.npy`` token file written by ``write_token_file`` (memory-mapped, never loaded whole).
"""

import argparse
import glob
import json
import os
import sysconfig
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .tokenizer import load_tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".html", ".tex"}
READ_SUFFIXES = TEXT_SUFFIXES | {".jsonl"}  # what a folder source reads


def stdlib_files() -> list[Path]:
    """The interpreter's own standard library sources, in a stable order (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB: what ``git`` and ``grep`` take for a binary file (text never has one)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def resolve_source(source: str) -> list[Path] | Path:
    """Return the text files a source names, or the path of a ``.npy`` token file; raise if it names nothing.

    A file named directly must be text; folders and globs skip what is not, and say what they skipped.
    """
    if source == "stdlib":
        return stdlib_files()
    path = Path(source).expanduser()
    if path.suffix == ".npy" and path.is_file():
        return path
    if path.is_file():
        if is_binary(path):
            raise ValueError(f"data.source={source!r} is a binary file (it has NUL bytes), not text: pass text files, "
                             "a folder, .jsonl, or a .npy token file written by `moe-lightning tokenize`.")
        return [path]
    if path.is_dir():
        candidates, looked_for = sorted(p for p in path.rglob("*") if p.is_file()), f"{sorted(READ_SUFFIXES)}"
    else:
        candidates = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        looked_for = "text files"
        if not candidates:
            raise FileNotFoundError(f"data.source={source!r}: no such file, folder or glob match. Use 'stdlib' for "
                                    "the built-in corpus, or a path to text, .jsonl or .npy token files.")
    files, skipped = [], []
    for p in candidates:
        if path.is_dir() and p.suffix not in READ_SUFFIXES:
            skipped.append(f"{p.relative_to(path)} (suffix {p.suffix or 'none'!r} not read)")
        elif p.suffix == ".npy":
            skipped.append(f"{p} (token files are read only when named directly)")
        elif is_binary(p):
            skipped.append(f"{p.relative_to(path) if path.is_dir() else p} (binary)")
        else:
            files.append(p)
    if skipped:
        shown = "; ".join(skipped[:10]) + (f"; and {len(skipped) - 10} more" if len(skipped) > 10 else "")
        rank_zero_info(f"data.source={source!r}: skipped {len(skipped)} file(s): {shown}")
    if not files:
        raise ValueError(f"data.source={source!r}: no text files to read (looked for {looked_for}; "
                         f"skipped {len(skipped)}).")
    return files


def iter_documents(files: list[Path], text_field: str):
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        yield _jsonl_text(line, path, line_no, text_field)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def _jsonl_text(line: str, path: Path, line_no: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({error.msg} at column {error.colno}); "
                         "each line of a .jsonl file must be one JSON object.") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{line_no}: a JSON {type(record).__name__}, not an object with a "
                         f"{text_field!r} field.")
    if text_field not in record:
        raise KeyError(f"{path}:{line_no}: record has no field {text_field!r}; set "
                       f"data.text_field to one of {sorted(record)}.")
    if not isinstance(record[text_field], str):
        raise ValueError(f"{path}:{line_no}: field {text_field!r} holds a {type(record[text_field]).__name__}, "
                         "not text.")
    return record[text_field]


def tokenize_sources(sources: list[str], tokenizer, text_field: str = "text",
                     max_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """One token stream (every document's tokens followed by the end-of-document token), and the files read."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    chunks, count, files_read = [], 0, 0
    for source in sources:
        resolved = resolve_source(source)
        if isinstance(resolved, Path):
            chunks.append(load_token_file(resolved, tokenizer.vocab_size))
            count, files_read = count + len(chunks[-1]), files_read + 1
            continue
        for path in resolved:
            files_read += 1
            for text in iter_documents([path], text_field):
                ids = tokenizer.encode(text)
                if len(ids):
                    chunks.append(np.append(ids, tokenizer.eos_id).astype(dtype))
                    count += len(chunks[-1])
            if max_tokens is not None and count >= max_tokens:
                break
        if max_tokens is not None and count >= max_tokens:
            break
    if len(chunks) == 1:
        tokens = chunks[0]  # keeps a memory-mapped token file mapped
    else:
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return (tokens[:max_tokens] if max_tokens is not None else tokens), files_read


def _token_file_info(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def load_token_file(path: Path, vocab_size: int) -> np.ndarray:
    """Memory-map a token file, refusing one written for a different vocabulary (its ids would overflow)."""
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"data.source={str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; token "
                         "files hold one flat array of integer ids: write one with `moe-lightning tokenize`.")
    if np.issubdtype(tokens.dtype, np.signedinteger) and len(tokens) and int(tokens.min()) < 0:
        raise ValueError(f"data.source={str(path)!r} holds negative token ids (min {int(tokens.min())}); ids run "
                         "from 0 to the vocabulary size - 1: write the file with `moe-lightning tokenize`.")
    info = _token_file_info(path)
    written_for = json.loads(info.read_text())["vocab_size"] if info.exists() else int(tokens.max()) + 1
    if written_for > vocab_size:
        raise ValueError(f"data.source={str(path)!r} holds token ids of a {written_for}-token vocabulary but the "
                         f"tokenizer has {vocab_size}: pass the tokenizer it was written with as data.tokenizer.")
    return tokens


def write_token_file(sources: list[str], out_path: str, tokenizer_path: str | None = None,
                     text_field: str = "text", overwrite: bool = False) -> Path:
    """Tokenize sources once into a ``.npy`` file that training memory-maps. Written atomically."""
    out = Path(out_path)
    if out.suffix != ".npy":
        raise ValueError(f"out={out_path!r}: token files must end in .npy")
    if out.exists() and not overwrite:
        raise FileExistsError(f"out={out_path!r} exists; choose another path or pass --overwrite.")
    tokenizer = load_tokenizer(tokenizer_path)
    tokens, _ = tokenize_sources(sources, tokenizer, text_field)
    if len(tokens) == 0:
        raise ValueError(f"sources {sources}: no text found, nothing to write.")
    tmp = out.with_name(out.name + ".partial.npy")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(tmp, tokens)
    _token_file_info(out).write_text(json.dumps({"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer_path}))
    os.replace(tmp, out)
    return out


class PackedSequences(Dataset):
    """Sequence ``i`` is ``tokens[i*S : i*S + S + 1]`` (inputs and shifted targets share the slice)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, indices: np.ndarray):
        self.tokens, self.seq_len, self.indices = tokens, seq_len, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.indices[i]) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


def split_indices(num_sequences: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Every k-th sequence (k = round(1/val_fraction)) goes to validation: deterministic and spread out."""
    every = max(2, round(1 / val_fraction))
    all_indices = np.arange(num_sequences)
    is_val = all_indices % every == every - 1
    return all_indices[~is_val], all_indices[is_val]


class ResumableSampler(DistributedSampler):
    """Shuffles by ``(seed, epoch)`` and deals the order out to ranks; can start an epoch part-way through.

    The global order does not depend on the number of ranks (rank ``r`` of ``W`` takes every ``W``-th
    index), so a resumed run skips exactly the samples already consumed, at any world size.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.resume_epoch, self.resume_samples = -1, 0

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)
        start = self.resume_samples if self.epoch == self.resume_epoch else 0
        end = len(order) - len(order) % self.num_replicas
        return iter(order[start + self.rank:end:self.num_replicas].tolist())


class TextDataModule(L.LightningDataModule):
    """Packs tokenized text into ``seq_len + 1`` windows; a resumable sampler splits them by rank.

    Checkpoints record how many training samples of the current epoch all ranks consumed together,
    so resuming (even at another world size with the same global batch) continues the same order.

    Args:
        source: ``stdlib``, a file, folder, glob, ``.jsonl`` or ``.npy`` token file, or a list of these.
        seq_len: Tokens per training sequence (targets are the next tokens).
        batch_size: Sequences per micro-batch on each device.
        val_fraction: Share of sequences held out for validation.
        tokenizer: Path to a ``tokenizers`` JSON file; ``None`` for byte-level tokens.
        text_field: JSONL field holding the text.
        max_tokens: Read at most this many tokens (handy for quick runs on large folders).
        num_workers: DataLoader worker processes.
        shuffle_seed: Seed of the per-epoch shuffle of training sequences.
    """

    def __init__(self, source: str | list[str] = "stdlib", seq_len: int = 256, batch_size: int = 16,
                 val_fraction: float = 0.05, tokenizer: str | None = None, text_field: str = "text",
                 max_tokens: int | None = None, num_workers: int = 0, shuffle_seed: int = 0):
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"data.seq_len={seq_len} and data.batch_size={batch_size} must be positive.")
        if not 0 < val_fraction <= 0.5:
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 0.5].")
        self.sources = [source] if isinstance(source, str) else list(source)
        for s in self.sources:
            resolve_source(s)  # fail now, not after the model is built
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.text_field, self.max_tokens, self.num_workers = text_field, max_tokens, num_workers
        self.shuffle_seed = shuffle_seed
        self._resume_position: tuple[int, int] | None = None  # (epoch, samples consumed by all ranks)
        self.tokenizer = load_tokenizer(tokenizer)
        self.train_set: PackedSequences | None = None
        self.val_set: PackedSequences | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            tokens, files_read = tokenize_sources(self.sources, self.tokenizer, self.text_field, self.max_tokens)
            num_sequences = (len(tokens) - 1) // self.seq_len
            if num_sequences < 2:
                raise ValueError(f"data.source={self.sources}: only {len(tokens)} tokens, fewer than two sequences "
                                 f"of seq_len={self.seq_len}; add text or lower data.seq_len.")
            train_idx, val_idx = split_indices(num_sequences, self.val_fraction)
            self.train_set = PackedSequences(tokens, self.seq_len, train_idx)
            self.val_set = PackedSequences(tokens, self.seq_len, val_idx)
            rank_zero_info(f"data: {files_read:,} file(s), {len(tokens):,} tokens -> {len(train_idx):,} train / "
                           f"{len(val_idx):,} validation sequences of {self.seq_len} tokens")
        if stage == "fit":
            self._check_enough_for_fit()

    def _check_enough_for_fit(self) -> None:
        """Refuse a dataset that makes no training batch (Lightning would exit 0 saying "No training batches"),
        or no validation batch while validation is on (it would silently skip validation)."""
        ranks = self._sampler_kwargs()["num_replicas"]
        if len(self.train_set) // ranks < self.batch_size:
            raise ValueError(f"data: {len(self.train_set)} training sequences of seq_len={self.seq_len} make no batch "
                             f"of data.batch_size={self.batch_size} on each of {ranks} process(es) (need "
                             f"{self.batch_size * ranks}): add text, or lower data.batch_size or data.seq_len.")
        validating = self.trainer is not None and self.trainer.limit_val_batches != 0
        if validating and len(self.val_set) == 0:
            raise ValueError(f"data: no validation sequence (every {max(2, round(1 / self.val_fraction))}th of the "
                             f"{len(self.train_set)} sequences is held out): add text, raise data.val_fraction, or "
                             "turn validation off with trainer.limit_val_batches=0.")

    def _sampler_kwargs(self) -> dict:
        strategy = self.trainer.strategy if self.trainer is not None else None
        return getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}

    def train_dataloader(self) -> DataLoader:
        sampler = ResumableSampler(self.train_set, seed=self.shuffle_seed, **self._sampler_kwargs())
        if self._resume_position is not None:
            sampler.resume_epoch, sampler.resume_samples = self._resume_position
            self._resume_position = None
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def state_dict(self) -> dict:
        """Training position: batches processed this epoch x the global batch (valid at any world size); and
        the tokenizer, so ``generate`` and ``export`` use the run's own without being told."""
        if self.trainer is None:
            return {"tokenizer": self.tokenizer.spec()}
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        global_batch = self.batch_size * self._sampler_kwargs()["num_replicas"]
        return {"epoch": self.trainer.current_epoch, "samples": processed * global_batch,
                "tokenizer": self.tokenizer.spec()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "epoch" in state_dict:
            self._resume_position = (state_dict["epoch"], state_dict["samples"])

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The held-out split (of ``source``: point it at other text to score that text's held-out share)."""
        return self.val_dataloader()


def tokenize_main(argv: list[str] | None = None) -> None:
    """``moe-lightning tokenize SOURCE... --out tokens.npy``: pre-tokenize a corpus for memory-mapped training."""
    parser = argparse.ArgumentParser(prog="moe-lightning tokenize", description=tokenize_main.__doc__)
    parser.add_argument("sources", nargs="+", help="stdlib, files, folders, globs or .jsonl")
    parser.add_argument("--out", required=True, help="output .npy path")
    parser.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: bytes)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = write_token_file(args.sources, args.out, args.tokenizer, args.text_field, args.overwrite)
    print(f"wrote {len(np.load(out, mmap_mode='r')):,} tokens to {out}")
