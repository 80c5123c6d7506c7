"""Token sources read lazily: ``.npy`` files memory-mapped, shard folders through their manifest.

Start-up reads headers and manifests only; token ids are read when a sequence is sampled, so each rank
reads its own samples and nothing else, and a list of sources is never concatenated in memory.
"""

import bisect
import json
from pathlib import Path

import numpy as np

from moe_lightning.data.tokenizer import tokenizer_identity
from moe_lightning.data.sources import MANIFEST, sidecar_path
from moe_lightning.data.tokenize.reading import tokenize_in_memory

SCAN_TOKENS = 1 << 22  # a bare .npy without a sidecar: ids checked in its first 4M tokens at start-up


def refuse_other_tokenizer(where: str, written_with: dict, written_vocab: int, tokenizer) -> None:
    """Token ids mean nothing under another tokenizer: refuse a file or folder written with one."""
    ours = tokenizer_identity(tokenizer.spec())
    if "eos_token" not in written_with:  # written before the EOS token was part of the identity
        ours.pop("eos_token", None)
    if written_with != ours or written_vocab != tokenizer.vocab_size:
        raise ValueError(f"{where} was tokenized with {written_with} ({written_vocab} tokens) but "
                         f"data.tokenizer is {ours} ({tokenizer.vocab_size} tokens): pass the tokenizer it was "
                         "written with as data.tokenizer, or tokenize the corpus again with this one.")


class TokenPart:
    """One token array: an in-memory array (tokenized text) or a ``.npy`` file opened on first read.

    ``check_ids`` is the vocabulary size to check every read against, for files whose largest id is unknown.
    """

    def __init__(self, length: int, path: Path | None = None, array: np.ndarray | None = None,
                 check_ids: int | None = None):
        self.length, self.path, self._array, self.check_ids = length, path, array, check_ids

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
            if self._array.shape != (self.length,):
                raise ValueError(f"{self.path}: holds {self._array.shape} tokens but its manifest says "
                                 f"({self.length},): the file changed after tokenize wrote it; tokenize again.")
        return self._array

    def read(self, start: int, stop: int) -> np.ndarray:
        window = self.array()[start:stop]
        if self.check_ids is not None and len(window) and (int(window.max()) >= self.check_ids or
                                                           (window.dtype.kind == "i" and int(window.min()) < 0)):
            raise ValueError(f"{self.path}: token ids outside 0..{self.check_ids - 1} near position {start} "
                             "(the file was written for another vocabulary): pass the tokenizer it was written "
                             "with as data.tokenizer.")
        return window

    def __getstate__(self) -> dict:
        """DataLoader workers started by spawn receive the path, never a copy of a memory-mapped file."""
        state = dict(self.__dict__)
        if self.path is not None:
            state["_array"] = None
        return state


class TokenStream:
    """Several token arrays read as one stream (what concatenating them would give) without concatenating."""

    def __init__(self, parts: list[TokenPart], limit: int | None = None):
        self.parts = [p for p in parts if p.length]
        self.starts = np.cumsum([0] + [p.length for p in self.parts]).tolist()
        self.length = self.starts[-1] if limit is None else min(limit, self.starts[-1])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.length)
        first = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        while start < stop:
            part_start = self.starts[first]
            end = min(stop, self.starts[first + 1])
            pieces.append(self.parts[first].read(start - part_start, end - part_start))
            start, first = end, first + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def open_token_file(path: Path, tokenizer) -> TokenPart:
    """A ``.npy`` token file (header and sidecar read; ids checked against the vocabulary without a full scan)."""
    where = f"data.source={str(path)!r}"
    try:
        tokens = np.load(path, mmap_mode="r")
    except ValueError as error:
        raise ValueError(f"{where}: not a readable .npy file ({error}); write token files with "
                         "`moe-lightning tokenize`.") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{where} holds a {tokens.dtype} array of shape {tokens.shape}; token "
                         "files hold one flat array of integer ids: write one with `moe-lightning tokenize`.")
    if len(tokens) == 0:
        raise ValueError(f"{where} holds no tokens (an empty array): point data.source at a token file with "
                         "text in it.")
    sidecar = sidecar_path(path)
    if sidecar.exists():
        try:
            info = json.loads(sidecar.read_text())
            written_for = int(info["vocab_size"])
            max_id, written_with = info.get("max_id"), info.get("tokenizer_identity")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{sidecar}: the token file's sidecar is corrupt or lacks 'vocab_size' "
                             f"({type(error).__name__}: {error}); rewrite it with `moe-lightning tokenize`, or "
                             "delete it to have the ids checked against the tokenizer instead.") from None
        if written_with is not None:  # sidecars before the identity was recorded say the vocabulary only
            refuse_other_tokenizer(where, written_with, written_for, tokenizer)
        # the sidecar's word is checked, not trusted (the file may have been replaced after tokenize wrote it)
        refuse_ids_beyond(tokens, written_for, where, f"its sidecar {sidecar}")
        check_ids = written_for if len(tokens) > SCAN_TOKENS else None
    else:  # no record of its vocabulary: scan a bounded prefix now, check every window when it is read
        head = np.asarray(tokens[:SCAN_TOKENS])
        if np.issubdtype(tokens.dtype, np.signedinteger) and int(head.min()) < 0:
            raise ValueError(f"{where} holds negative token ids (min {int(head.min())}); ids run "
                             "from 0 to the vocabulary size - 1: write the file with `moe-lightning tokenize`.")
        written_for, max_id, check_ids = int(head.max()) + 1, None, tokenizer.vocab_size
    if written_for > tokenizer.vocab_size or (max_id is not None and max_id >= tokenizer.vocab_size):
        raise ValueError(f"{where} holds token ids of a {written_for}-token vocabulary but the "
                         f"tokenizer has {tokenizer.vocab_size}: pass the tokenizer it was written with as "
                         "data.tokenizer.")
    return TokenPart(len(tokens), path=path, array=tokens, check_ids=check_ids)


def refuse_ids_beyond(tokens: np.ndarray, vocab_size: int, where: str, declared_by: str) -> None:
    """Start-up's check of a token array against the vocabulary its sidecar or manifest declares: the first
    ``SCAN_TOKENS`` ids (reads past them are checked as they happen, ``TokenPart.check_ids``)."""
    head = np.asarray(tokens[:SCAN_TOKENS])
    if not len(head):
        return
    worst = int(head.argmin()) if head.dtype.kind == "i" and int(head.min()) < 0 else int(head.argmax())
    if not 0 <= int(head[worst]) < vocab_size:
        raise ValueError(f"{where} holds token id {int(head[worst])} (position {worst}), outside the "
                         f"{vocab_size}-token vocabulary {declared_by} declares: the tokens changed after "
                         "`moe-lightning tokenize` wrote them; tokenize the corpus again.")


def read_manifest(folder: Path) -> dict:
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        [(s["file"], int(s["tokens"])) for s in manifest["shards"]]
        manifest["vocab_size"], manifest["tokenizer"]["kind"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{manifest_path}: not a token-shard manifest ({type(error).__name__}: {error}); "
                         "write the folder with `moe-lightning tokenize`.") from None
    return manifest


def open_shard_folder(folder: Path, tokenizer) -> list[TokenPart]:
    """The shards a manifest lists, unopened; refused if written by another tokenizer or vocabulary."""
    manifest, where = read_manifest(folder), f"data.source={str(folder)!r}"
    refuse_other_tokenizer(where, manifest["tokenizer"], manifest["vocab_size"], tokenizer)
    if int(manifest.get("max_id", 0)) >= tokenizer.vocab_size:
        raise ValueError(f"{where}: its manifest records token id {manifest['max_id']}, outside the tokenizer's "
                         f"{tokenizer.vocab_size} ids: tokenize the corpus again.")
    parts, dtype = [], np.dtype(manifest.get("dtype", "uint16"))
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{where}: shard {shard['file']} listed in {MANIFEST} is missing; copy the "
                                    "whole folder, or tokenize again.")
        expected = shard.get("bytes") or _header_bytes(path) + int(shard["tokens"]) * dtype.itemsize
        size = path.stat().st_size
        if size != expected:  # a truncated copy would fail later, in the middle of training, naming no file
            raise ValueError(f"{where}: shard {path} holds {size:,} bytes but {MANIFEST} says {expected:,} "
                             f"({'truncated' if size < expected else 'changed'} after tokenize wrote it): copy the "
                             "whole folder again, or tokenize again.")
        parts.append(TokenPart(int(shard["tokens"]), path=path, check_ids=tokenizer.vocab_size))
    if sum(p.length for p in parts) == 0:
        raise ValueError(f"{where}: its manifest lists no tokens (an empty corpus): tokenize text into it.")
    first = next(p for p in parts if p.length)  # every read is checked; start-up scans the first shard's head
    refuse_ids_beyond(first.array(), tokenizer.vocab_size, f"{where}: shard {first.path.name}",
                      f"its manifest {folder / MANIFEST}")
    return parts


def _header_bytes(path: Path) -> int:
    """Length of a ``.npy`` file's header (manifests written before shard sizes were recorded)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()


def open_tokens(resolved, tokenizer, text_field: str, max_tokens: int | None) -> tuple[list[TokenPart], int]:
    """The token parts of one resolved source (see ``sources.resolve_source``) and the files they come from;
    ``max_tokens`` stops tokenizing text early (token files are cut by ``TokenStream``'s limit instead)."""
    if isinstance(resolved, Path) and resolved.is_dir():
        parts = open_shard_folder(resolved, tokenizer)
        return parts, len(parts)
    if isinstance(resolved, Path):
        return [open_token_file(resolved, tokenizer)], 1

    array, files_read = tokenize_in_memory(resolved, tokenizer, text_field, max_tokens)
    return [TokenPart(len(array), array=array)], files_read
