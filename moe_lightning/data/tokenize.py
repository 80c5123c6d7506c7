"""``moe-lightning tokenize``: a corpus of any size → a folder of ``.npy`` token shards and a manifest, on every core.

The input is cut into units (files, JSONL byte ranges, Parquet row groups) planned once and recorded in the
folder; each worker process tokenizes one unit at a time in bounded batches and streams it into its own shards,
so memory stays flat whatever the corpus size. Each shard is written under a temporary name and renamed when
complete; a unit's record is written after its shards; the manifest, the only file ``fit`` reads, is written
last. ``--resume`` reruns only the units without a record. Nothing here imports torch or Lightning.
"""

import argparse
import errno
import io
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from queue import Empty

import numpy as np

from ..tokenizer import load_tokenizer, tokenizer_identity
from .sources import MANIFEST, TABLE_SUFFIXES, is_token_source, iter_jsonl, iter_table_batches, resolve_source, \
    table_row_groups
from .tokens import sidecar_path

PLAN = "tokenize-plan.json"
SHARD_TOKENS = 1 << 28  # 268M tokens: 512 MiB of uint16 or 1 GiB of uint32 per shard
BATCH_BYTES = 1 << 22  # text encoded per batch (4 MiB): a process's memory does not grow with the corpus
MIN_UNIT_BYTES = 1 << 20  # units smaller than this cost more in start-up than they gain in balance
PROGRESS_EVERY_S = 2.0
FORMAT = "moe_lightning token shards v1"


class TokenizeError(Exception):
    """A failure the user can act on, reported as one line."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _create(path: Path):
    """Open a new file for writing, unbuffered (short writes and a full disk are seen where they happen)."""
    return open(path, "wb", buffering=0)


def _write_all(file, data, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            written = file.write(view)
        except OSError as error:
            raise _write_error(error, path) from None
        if not written:
            raise TokenizeError(f"tokenize: writing {path} stopped short ({len(view)} bytes not written); check the "
                                "disk, then rerun with --resume.")
        view = view[written:]


def _write_error(error: OSError, path: Path) -> TokenizeError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return TokenizeError(f"tokenize: no space left writing {path} ({error.strerror}); free space or choose "
                             "another --out, then rerun the same command with --resume.")
    return TokenizeError(f"tokenize: cannot write {path}: {error.strerror or error}.")


def _finish(file, tmp: Path, final: Path) -> None:
    """Flush to disk (a full disk may only show here) and rename into place."""
    try:
        os.fsync(file.fileno())
        file.close()
        os.replace(tmp, final)
    except OSError as error:
        raise _write_error(error, tmp) from None


def write_json_atomically(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with _create(tmp) as file:
        _write_all(file, json.dumps(record, indent=1).encode(), tmp)
        _finish(file, tmp, path)


class NpyWriter:
    """A ``.npy`` file written as a stream: numpy's header leaves room for the shape to grow, so the final length
    is written over the placeholder at the end; the file lives under ``<name>.tmp`` until it is complete."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.tmp, self.dtype = path, path.with_name(path.name + ".tmp"), dtype
        self.tokens, self.documents, self.max_id = 0, 0, -1
        self.file = _create(self.tmp)
        self.header_bytes = len(self._header(0))
        _write_all(self.file, self._header(0), self.tmp)

    def _header(self, length: int) -> bytes:
        out = io.BytesIO()
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                   "fortran_order": False, "shape": (length,)})
        return out.getvalue()

    def write(self, tokens: np.ndarray, documents: int) -> None:
        _write_all(self.file, np.ascontiguousarray(tokens, dtype=self.dtype), self.tmp)
        self.tokens, self.documents = self.tokens + len(tokens), self.documents + documents
        self.max_id = max(self.max_id, int(tokens.max()) if len(tokens) else -1)

    def close(self) -> dict:
        header = self._header(self.tokens)
        assert len(header) == self.header_bytes, "numpy's .npy header no longer leaves room for the shape"
        try:
            self.file.seek(0)
        except OSError as error:
            raise _write_error(error, self.tmp) from None
        _write_all(self.file, header, self.tmp)
        _finish(self.file, self.tmp, self.path)
        return {"file": self.path.name, "tokens": self.tokens, "documents": self.documents, "max_id": self.max_id}


# ---- planning: the corpus cut into units of work ----------------------------------------------------------------

def _pieces(path: Path, target_bytes: int) -> list[dict]:
    """One input file as pieces of about ``target_bytes``: JSONL by byte range, Parquet by row groups."""
    size = path.stat().st_size
    if path.suffix == ".jsonl" and size > target_bytes:
        cuts = list(range(0, size, target_bytes)) + [size]
        return [{"path": str(path), "start": a, "end": b, "bytes": b - a} for a, b in zip(cuts, cuts[1:])]
    if path.suffix == ".parquet":
        pieces, group, group_bytes = [], [], 0
        groups = table_row_groups(path)
        for index, (_, nbytes) in enumerate(groups):
            group, group_bytes = group + [index], group_bytes + nbytes
            if group_bytes >= target_bytes or index == len(groups) - 1:
                pieces.append({"path": str(path), "row_groups": group, "bytes": group_bytes})
                group, group_bytes = [], 0
        return pieces or [{"path": str(path), "row_groups": [], "bytes": 0}]
    return [{"path": str(path), "bytes": size}]


def input_files(sources: list[str]) -> list[Path]:
    """The documents' files, in corpus order; token files are refused (they are tokenized already)."""
    files = []
    for source in sources:
        resolved = resolve_source(source)
        if is_token_source(resolved):
            raise TokenizeError(f"tokenize: {source!r} is already tokenized (a .npy file or shard folder); pass "
                                "text, JSONL, Parquet or Arrow sources.")
        files += resolved
    return files


def plan_units(files: list[Path], target_bytes: int) -> list[dict]:
    """Units of work in corpus order: consecutive pieces of the input adding up to about ``target_bytes``."""
    units, current, current_bytes = [], [], 0
    for path in files:
        for piece in _pieces(path, target_bytes):
            current.append(piece)
            current_bytes += piece["bytes"]
            if current_bytes >= target_bytes:
                units.append(current)
                current, current_bytes = [], 0
    if current:
        units.append(current)
    return [{"index": i, "pieces": pieces, "bytes": sum(p["bytes"] for p in pieces)} for i, pieces in enumerate(units)]


def _text_batches(pieces: list[dict], text_field: str):
    """``(texts, input bytes they stand for)`` in order, about ``BATCH_BYTES`` of text at a time."""
    for piece in pieces:
        path = Path(piece["path"])
        if path.suffix == ".jsonl":
            texts, size = [], 0
            for text in iter_jsonl(path, text_field, piece.get("start", 0), piece.get("end")):
                texts.append(text)
                size += len(text)
                if size >= BATCH_BYTES:
                    yield texts, size
                    texts, size = [], 0
            yield texts, size
        elif path.suffix in TABLE_SUFFIXES:
            batches = iter_table_batches(path, text_field, piece.get("row_groups"))
            for texts in batches:
                yield texts, sum(map(len, texts))
        else:
            yield [path.read_text(encoding="utf-8", errors="replace")], piece["bytes"]


def tokenized_batches(pieces: list[dict], tokenizer, text_field: str, dtype: np.dtype):
    """``(tokens, documents, input bytes)`` per batch: each non-empty document's ids then end-of-document."""
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for texts, size in _text_batches(pieces, text_field):
        ids = [i for i in tokenizer.encode_batch(texts) if len(i)]
        tokens = np.concatenate([part for i in ids for part in (i.astype(dtype), eos)]) if ids else eos[:0]
        yield tokens, len(ids), size


# ---- workers ----------------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_path: str | None, queue) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes, not threads inside each
    _WORKER.update(tokenizer=load_tokenizer(tokenizer_path), queue=queue)


def unit_record(out: Path, index: int) -> Path:
    return out / f"part-{index:05d}.done.json"


def tokenize_unit(unit: dict, out: str, text_field: str, shard_tokens: int) -> dict:
    """Tokenize one unit into ``part-<unit>-<n>.npy`` shards, then record it as done."""
    out, tokenizer = Path(out), _WORKER["tokenizer"]
    dtype, shards, writer = token_dtype(tokenizer.vocab_size), [], None
    try:
        for tokens, documents, size in tokenized_batches(unit["pieces"], tokenizer, text_field, dtype):
            if len(tokens) and (writer is None or writer.tokens >= shard_tokens):
                if writer is not None:
                    shards.append(writer.close())
                writer = NpyWriter(out / f"part-{unit['index']:05d}-{len(shards):03d}.npy", dtype)
            if len(tokens):
                writer.write(tokens, documents)
            _WORKER["queue"].put((size, len(tokens)))
        if writer is not None:
            shards.append(writer.close())
    finally:
        if writer is not None and not writer.file.closed:
            writer.file.close()
            writer.tmp.unlink(missing_ok=True)
    record = {"index": unit["index"], "bytes": unit["bytes"], "shards": shards}
    write_json_atomically(unit_record(out, unit["index"]), record)
    return record


class _InlineQueue:
    """The progress queue of a one-process run: reports go straight to the display."""

    def __init__(self, progress):
        self.put = lambda item: progress.update(*item)


class Progress:
    """Input read, tokens written, tokens/s and ETA on stderr, every few seconds."""

    def __init__(self, total_bytes: int, done_bytes: int):
        self.total, self.done, self.tokens, self.every = total_bytes, done_bytes, 0, PROGRESS_EVERY_S
        self.start = self.last = time.monotonic()
        self.start_bytes = done_bytes

    def update(self, nbytes: int, tokens: int) -> None:
        self.done, self.tokens = self.done + nbytes, self.tokens + tokens
        if time.monotonic() - self.last >= self.every:
            self.show()

    def show(self, final: bool = False) -> None:
        self.last = now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.start_bytes) / elapsed
        left = max(self.total - self.done, 0)
        eta = "done" if final else (f"ETA {_duration(left / rate)}" if rate > 0 else "ETA ?")
        print(f"tokenize: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB read, {self.tokens:,} tokens, "
              f"{self.tokens / elapsed:,.0f} tokens/s, {eta}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ---- the command ------------------------------------------------------------------------------------------------

def tokenize_to_folder(sources: list[str], out: str, tokenizer_path: str | None = None, text_field: str = "text",
                       workers: int | None = None, shard_tokens: int = SHARD_TOKENS, resume: bool = False) -> dict:
    """Tokenize ``sources`` into the shard folder ``out``; return its manifest."""
    folder, workers = Path(out), workers or os.cpu_count() or 1
    if workers < 1 or shard_tokens < 1:
        raise TokenizeError(f"tokenize: --workers={workers} and --shard-tokens={shard_tokens} must be positive.")
    tokenizer = load_tokenizer(tokenizer_path)
    identity = {"sources": sources, "tokenizer": tokenizer_identity(tokenizer.spec()), "text_field": text_field,
                "shard_tokens": shard_tokens}
    if (folder / MANIFEST).exists():
        if resume:
            print(f"tokenize: {folder} is already complete ({MANIFEST} written); nothing to do.", file=sys.stderr)
            return json.loads((folder / MANIFEST).read_text())
        raise FileExistsError(f"tokenize: --out {folder} already holds a tokenized corpus; choose another folder.")
    if folder.exists() and any(folder.iterdir()):
        if not resume:
            raise FileExistsError(f"tokenize: --out {folder} exists and is not empty; pass --resume to continue the "
                                  "run that wrote it, or choose another folder.")
        plan = _resumable_plan(folder, identity)
    else:
        if resume and not folder.exists():
            print(f"tokenize: {folder} does not exist yet; starting from the beginning.", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        files = input_files(sources)
        inputs = [{"path": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]
        bytes_per_token = 1 if tokenizer.spec()["kind"] == "bytes" else 4
        total = sum(i["bytes"] for i in inputs)  # units: at most a shard each, and enough to keep every worker busy
        target = max(MIN_UNIT_BYTES, min(shard_tokens * bytes_per_token, math.ceil(total / (4 * workers))))
        plan = {**identity, "units": plan_units(files, target), "inputs": inputs}
        write_json_atomically(folder / PLAN, plan)
    pending = [u for u in plan["units"] if not unit_record(folder, u["index"]).exists()]
    _run_units(pending, plan, folder, tokenizer_path, text_field, shard_tokens, workers)
    return _write_manifest(folder, plan, tokenizer, tokenizer_path)


def _resumable_plan(folder: Path, identity: dict) -> dict:
    """The plan of the interrupted run in ``folder``, if it is the same job over unchanged inputs."""
    try:
        plan = json.loads((folder / PLAN).read_text())
    except (OSError, json.JSONDecodeError):
        raise FileExistsError(f"tokenize: --out {folder} is not a tokenize run's folder (no readable {PLAN}); "
                              "choose another folder.") from None
    differs = [key for key, value in identity.items() if plan.get(key) != value]
    if differs:
        raise TokenizeError(f"tokenize --resume: {folder} was started with other {', '.join(differs)} "
                            f"({', '.join(f'{k}={plan.get(k)!r}' for k in differs)}); rerun with the same arguments.")
    for record in plan["inputs"]:
        path = Path(record["path"])
        stat = path.stat() if path.exists() else None
        if stat is None or (stat.st_size, stat.st_mtime_ns) != (record["bytes"], record["mtime_ns"]):
            raise TokenizeError(f"tokenize --resume: input {path} changed since the run started; shards already "
                                "written would not match it. Tokenize into a new folder.")
    for stale in folder.glob("part-*.npy.tmp"):  # a shard a killed worker was writing: ours, never complete
        stale.unlink()
    return plan


def _run_units(pending: list[dict], plan: dict, folder: Path, tokenizer_path, text_field, shard_tokens,
               workers: int) -> None:
    total = sum(u["bytes"] for u in plan["units"])
    progress = Progress(total, total - sum(u["bytes"] for u in pending))
    args = [(unit, str(folder), text_field, shard_tokens) for unit in pending]
    if workers == 1 or len(pending) <= 1:
        _init_worker(tokenizer_path, _InlineQueue(progress))
        for a in args:
            tokenize_unit(*a)
    else:
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        queue = context.Queue()
        with context.Pool(min(workers, len(pending)), initializer=_init_worker,
                          initargs=(tokenizer_path, queue)) as pool:
            results = [pool.apply_async(tokenize_unit, a) for a in args]
            while not all(r.ready() for r in results) or not queue.empty():
                try:
                    progress.update(*queue.get(timeout=0.5))
                except Empty:  # nothing reported in the last half second
                    pass
            for r in results:
                r.get()  # a worker's error surfaces here, unchanged
    progress.show(final=True)


def _write_manifest(folder: Path, plan: dict, tokenizer, tokenizer_path: str | None) -> dict:
    shards = [s for unit in plan["units"] for s in json.loads(unit_record(folder, unit["index"]).read_text())["shards"]]
    if not shards:
        raise TokenizeError(f"tokenize: sources {plan['sources']} hold no text; nothing written to {folder}.")
    manifest = {"format": FORMAT, "tokenizer": tokenizer_identity(tokenizer.spec()), "tokenizer_path": tokenizer_path,
                "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                "dtype": token_dtype(tokenizer.vocab_size).name, "text_field": plan["text_field"],
                "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                "max_id": max((s["max_id"] for s in shards), default=-1), "shards": shards,
                "inputs": plan["inputs"]}
    write_json_atomically(folder / MANIFEST, manifest)
    return manifest


def write_token_file(sources: list[str], out_path: str, tokenizer_path: str | None = None,
                     text_field: str = "text", overwrite: bool = False) -> Path:
    """Tokenize sources, in one process, into one ``.npy`` file that training memory-maps (small corpora; the
    folder form scales). Streamed to disk, written atomically, with a sidecar recording its vocabulary."""
    out = Path(out_path)
    if out.suffix != ".npy":
        raise ValueError(f"out={out_path!r}: token files must end in .npy")
    if out.exists() and not overwrite:
        raise FileExistsError(f"out={out_path!r} exists; choose another path or pass --overwrite.")
    tokenizer = load_tokenizer(tokenizer_path)
    pieces = [p for unit in plan_units(input_files(sources), 1 << 62) for p in unit["pieces"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    sidecar = sidecar_path(out)
    writer = NpyWriter(out, token_dtype(tokenizer.vocab_size))
    try:
        for tokens, documents, _ in tokenized_batches(pieces, tokenizer, text_field, writer.dtype):
            writer.write(tokens, documents)
        if writer.tokens == 0:
            raise ValueError(f"sources {sources}: no text found, nothing to write.")
        # the old file's record goes first and the new one follows the finished .npy, so a failure part-way
        # never pairs one file's tokens with the other's record (a .npy alone has its ids checked when read)
        sidecar.unlink(missing_ok=True)
        writer.close()
    finally:
        if not writer.file.closed:
            writer.file.close()
            writer.tmp.unlink(missing_ok=True)
    write_json_atomically(sidecar, {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer_path,
                                    "max_id": writer.max_id,
                                    "tokenizer_identity": tokenizer_identity(tokenizer.spec())})
    return out


def tokenize_main(argv: list[str] | None = None) -> None:
    """``moe-lightning tokenize SOURCE... --out FOLDER``: tokenize a corpus into .npy shards and a manifest."""
    parser = argparse.ArgumentParser(prog="moe-lightning tokenize", description=tokenize_main.__doc__)
    parser.add_argument("sources", nargs="+", help="stdlib, text files, folders, globs, .jsonl, .parquet, .arrow")
    parser.add_argument("--out", required=True, help="output folder of shards (or a .npy path: one file, one process)")
    parser.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: bytes)")
    parser.add_argument("--text-field", default="text", help="JSONL field or Parquet/Arrow column with the text")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per shard (about)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run into the same folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing .npy output")
    args = parser.parse_args(argv)
    try:
        if args.out.endswith(".npy"):
            out = write_token_file(args.sources, args.out, args.tokenizer, args.text_field, args.overwrite)
            print(f"wrote {len(np.load(out, mmap_mode='r')):,} tokens to {out}")
            return
        manifest = tokenize_to_folder(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                                      args.shard_tokens, args.resume)
    except (TokenizeError, ValueError, KeyError, OSError, ImportError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        print(f"moe-lightning tokenize: error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {manifest['tokens']:,} tokens ({manifest['documents']:,} documents) in "
          f"{len(manifest['shards'])} shard(s) to {args.out}")
