"""``moe-lightning tokenize``: a corpus of any size → a folder of ``.npy`` token shards and a manifest, on every core
and, as a scheduler's array of tasks, on many nodes.

The input is cut once into units of work, recorded in the folder's plan: spans of the corpus in order, cutting
large text and JSONL files by byte range (between words, between lines), Parquet files by row group and Arrow
files by record batch, and grouping small files. Each worker process tokenizes one unit at a time in bounded
batches and streams it into its own shards, so memory stays flat whatever the file sizes. Every file is written
through ``durable.atomic_write``; a unit's record follows its shards; the manifest, the only file ``fit`` reads
(its size does not grow with the number of input files), is written last, by whichever task finishes last.
``--resume`` reruns only the units without a record, after checking the arguments and inputs against the plan.
Nothing here imports torch or Lightning.
"""

import argparse
import ctypes
import errno
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moe_lightning.run import locks
from moe_lightning.run.durable import PARTIAL_SUFFIX, atomic_write
from moe_lightning.data.tokenizer import load_tokenizer, tokenizer_identity
from moe_lightning.data import sources
from moe_lightning.data.sources import MANIFEST, TABLE_SUFFIXES, WORD_END, is_token_source, iter_jsonl, iter_table_batches, \
    last_word_end, resolve_source, segments, sidecar_path, table_groups

PLAN = "tokenize-plan.json"
LOCK = "tokenize.lock"
PLAN_LOCK = "tokenize-plan.lock"  # held while a task writes the plan or the manifest
SHARD_TOKENS = 1 << 28  # 268M tokens: 512 MiB of uint16 or 1 GiB of uint32 per shard
BATCH_CHARS = 1 << 19  # text encoded per batch (512 KiB, half the smallest unit): memory flat at any size
MIN_UNIT_BYTES = 1 << 20  # units smaller than this cost more in start-up than they gain in balance
UNITS = 4096  # enough units for 64 tasks of 64 workers to stay busy; never a function of the task count, so
# a text file's cuts (token-neutral only for GPT-2-style pre-tokenizers) fall in the same places however many run
PROGRESS_EVERY_S = 2.0
STOP_WAIT_S = 10.0  # a stopped worker's grace before SIGKILL
SLOTS = 3  # shared counters per unit: bytes read, tokens written, the pid of the worker tokenizing it
FORMAT = "moe_lightning token shards v1"
PLAN_FORMAT = "moe_lightning tokenize plan v2"


class TokenizeError(Exception):
    """A failure the user can act on, reported as one line."""

    exit_code = 1


class Stopped(TokenizeError):
    """SIGTERM or SIGINT: workers stopped, finished units kept."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_json(path: Path, record: dict[str, object]) -> None:
    """``record`` as JSON, a key a line and each top-level list one item a line, written item by item: a list of
    thousands (a plan's inputs and units, a manifest's shards) is never held as one string, nor at all when it is
    an iterator."""
    with atomic_write(path) as file:
        opening = b"{\n "
        for key, value in record.items():
            if not isinstance(key, str):
                raise TypeError(f"write_json: key {key!r} is not a string")
            file.write(opening + json.dumps(key).encode() + b": ")
            if isinstance(value, (list, Iterator)):
                start = b"[\n  "
                for item in value:
                    file.write(start + json.dumps(item).encode())
                    start = b",\n  "
                file.write(b"[]" if start == b"[\n  " else b"\n ]")
            else:
                file.write(json.dumps(value).encode())
            opening = b",\n "
        file.write(b"{}\n" if opening == b"{\n " else b"\n}\n")


class NpyStream:
    """A ``.npy`` array streamed into an open file (one of ``atomic_write``'s): numpy's header leaves room for
    the shape to grow, so ``finish`` writes the final length over the placeholder."""

    def __init__(self, file, dtype: np.dtype):
        self.file, self.dtype = file, dtype
        self.tokens, self.documents, self.max_id = 0, 0, -1
        self.header_bytes = len(self._header(0))
        file.write(self._header(0))

    def _header(self, length: int) -> bytes:
        out = io.BytesIO()
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                   "fortran_order": False, "shape": (length,)})
        return out.getvalue()

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.file.write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self.tokens, self.documents = self.tokens + len(tokens), self.documents + documents
        self.max_id = max(self.max_id, int(tokens.max()) if len(tokens) else -1)

    def finish(self, name: str) -> dict:
        header = self._header(self.tokens)
        assert len(header) == self.header_bytes, "numpy's .npy header no longer leaves room for the shape"
        self.file.seek(0)
        self.file.write(header)
        return {"file": name, "tokens": self.tokens, "documents": self.documents, "max_id": self.max_id,
                "bytes": self.header_bytes + self.tokens * self.dtype.itemsize}


# ---- planning: the corpus cut into units of work ----------------------------------------------------------------

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


def describe_inputs(files: list[Path], missing_ok: bool = False) -> list[list]:
    """``[path, bytes, mtime_ns]`` per input file: what a resumed run checks is unchanged (``missing_ok``: a
    file that is gone is left out, for the caller to name)."""
    described = []
    for path in files:
        try:
            stat = path.stat()
        except FileNotFoundError:
            if not missing_ok:
                raise
            continue
        described.append([str(path), stat.st_size, stat.st_mtime_ns])
    return described


def plan_units(inputs: list[list], groups: dict[int, list[int]], target: int) -> list[dict]:
    """Units of about ``target`` bytes, each a span ``[start, end)`` of ``(input, position)`` in corpus order:
    small files grouped, a large text or JSONL file cut by byte range, a table between row groups or batches."""
    units, start, size = [], [0, 0], 0

    def cut(i: int, position: int) -> None:
        nonlocal start, size
        units.append({"index": len(units), "start": start, "end": [i, position], "bytes": size})
        start, size = [i, position], 0

    for i, (_, nbytes, _) in enumerate(inputs):
        if i in groups:
            for g, group_bytes in enumerate(groups[i]):
                size += group_bytes
                if size >= target:
                    cut(i, g + 1)
            continue
        position = 0
        while nbytes - position + size >= target:
            position += target - size
            size = target
            cut(i, position)
        size += nbytes - position
    if size or not units:
        units.append({"index": len(units), "start": start, "end": [len(inputs), 0], "bytes": size})
    return units


def unit_pieces(unit: dict, plan: dict) -> list[tuple]:
    """``(path, first, last, end of the input, is table)`` for each input the unit covers (non-empty ranges only);
    positions are bytes in text and JSONL files, row groups or record batches in tables."""
    (i0, p0), (i1, p1) = unit["start"], unit["end"]
    pieces = []
    for i in range(i0, min(i1 + 1, len(plan["inputs"]))):
        path, size, _ = plan["inputs"][i]
        groups = plan["groups"].get(str(i))
        whole = size if groups is None else len(groups)
        first, last = (p0 if i == i0 else 0), (p1 if i == i1 else whole)
        if last > first:
            pieces.append((path, first, last, whole, groups is not None))
    return pieces


def describe_unit(unit: dict, plan: dict) -> str:
    pieces = unit_pieces(unit, plan)
    if not pieces:
        return f"unit {unit['index']}"
    path, first, last, whole, table = pieces[0]
    where = "" if (first, last) == (0, whole) else \
        f" {'groups' if table else 'bytes'} {first:,}-{last:,}"
    more = f" and {len(pieces) - 1} more file(s)" if len(pieces) > 1 else ""
    return f"unit {unit['index']} ({path}{where}{more})"


# ---- reading a unit: segments of documents in order -------------------------------------------------------------

def _word_end_at_or_after(file, position: int, size: int) -> int:
    """Where a text file's byte range starting at ``position`` really starts: the first cut between words (see
    ``sources.segments``) at or after it, else (a blob without whitespace) the first character boundary. Both
    neighbouring units compute the same, so their ranges tile the file."""
    if position <= 0 or position >= size:
        return min(max(position, 0), size)
    file.seek(position - 1)
    window = b""
    while len(window) <= sources.MAX_SEGMENT_CHARS:  # read a little at a time: a word end is usually bytes away
        more = file.read(1 << 16)
        if not more:
            return size
        searched, window = max(len(window) - 1, 0), window + more
        found = _WORD_END_BYTES.search(window, searched)
        if found is not None:
            return position - 1 + found.start() + 1
    return position - 1 + _character_start(window, 1)


def _character_start(data: bytes, at: int) -> int:
    """The first UTF-8 character boundary at or after ``at`` (a cut there splits no character)."""
    while at < len(data) and data[at] & 0xC0 == 0x80:
        at += 1
    return at


_WORD_END_BYTES = re.compile(WORD_END.pattern.encode())


def _text_file_segments(path: str, first: int, last: int, size: int, tally: dict):
    """``(text, ends the document)`` for bytes ``[first, last)`` of a text file (one document), read a batch at a
    time and cut between words; the segment that reaches the file's end ends the document."""
    with open(path, "rb") as file:
        begin, end = (_word_end_at_or_after(file, p, size) for p in (first, last))
        file.seek(begin)
        left, carry = end - begin, b""
        while left or carry:
            data = file.read(min(sources.SEGMENT_CHARS, left))
            tally["bytes_read"] += len(data)
            if left and not data:
                raise ValueError(f"{path}: the file is shorter than when the run was planned; tokenize again.")
            left, block = left - len(data), carry + data
            cut = len(block) if not left else last_word_end(block, 0, len(block))
            if cut <= 0 and len(block) >= sources.MAX_SEGMENT_CHARS:  # a blob without whitespace
                cut = _character_start(block, len(block) // 2)
            if cut <= 0:
                carry = block
                continue
            carry = block[cut:]
            yield block[:cut].decode("utf-8", errors="replace"), not left and not carry and end == size


def new_tally() -> dict:
    """What reading a unit counts besides its texts: rows whose text is null, and input bytes read (progress)."""
    return {"null_rows": 0, "bytes_read": 0}


def unit_segments(unit: dict, plan: dict, tally: dict):
    """``(text, ends a document)`` for every piece of a unit, in corpus order; a text file's range that does not
    start the file continues a document begun in the previous unit. Null table texts and the input's bytes as
    they are read are counted in ``tally`` (``new_tally``)."""
    field = plan["text_field"]
    for path, first, last, whole, table in unit_pieces(unit, plan):
        if table:
            for texts, null_rows, nbytes in iter_table_batches(Path(path), field, list(range(first, last))):
                tally["null_rows"] += null_rows
                tally["bytes_read"] += nbytes
                for text in texts:
                    yield from _document(text)
        elif path.endswith(".jsonl"):
            for text in iter_jsonl(Path(path), field, tally, first, None if last == whole else last):
                yield from _document(text)
        else:
            if first > 0:
                yield "", False  # continues a document: its end-of-document token is due even if this is empty
            yield from _text_file_segments(path, first, last, whole, tally)


def _document(text: str):
    pieces = segments(text)
    for piece in pieces[:-1]:
        yield piece, False
    yield pieces[-1], True


def tokenized_batches(segment_stream, tokenizer, dtype: np.dtype):
    """``(tokens, documents)`` per batch of about ``BATCH_CHARS``: each non-empty document's ids, between the
    special tokens its tokenizer puts around a text, then the end-of-document token (a document split into
    segments gets them once: the start before its first ids, the end after its last)."""
    start = np.array(tokenizer.document_start, dtype=dtype)
    end = np.array([*tokenizer.document_end, tokenizer.eos_id], dtype=dtype)
    batch, chars, open_tokens = [], 0, 0

    def encode():
        nonlocal open_tokens
        parts, documents = [], 0
        for ids, (_, ends) in zip(tokenizer.encode_batch([text for text, _ in batch]), batch):
            if len(ids):
                if not open_tokens:
                    parts.append(start)
                parts.append(ids.astype(dtype, copy=False))
            open_tokens += len(ids)
            if ends and open_tokens:
                parts.append(end)
                documents, open_tokens = documents + 1, 0
            elif ends:
                open_tokens = 0
        return (np.concatenate(parts) if parts else end[:0]), documents

    for text, ends in segment_stream:
        if text == "" and not ends:  # marks a continued document
            open_tokens = max(open_tokens, 1)
            continue
        if batch and chars + len(text) > BATCH_CHARS:  # a batch holds at most BATCH_CHARS (or one segment)
            yield encode()
            batch, chars = [], 0
        batch.append((text, ends))
        chars += len(text)
    if batch:
        yield encode()


# ---- workers ----------------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(plan: dict, out: str, tokenizer_path: str | None, slots, tick=None) -> None:
    """Load the tokenizer and take the plan once per process (a unit is then sent as its index: the plan of a
    large corpus is megabytes); ``tick`` (a run in one process) shows progress between batches."""
    if tick is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process decides
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes, not threads inside each
    _WORKER.update(plan=plan, out=Path(out), tokenizer=load_tokenizer(tokenizer_path), slots=slots,
                   tick=tick or (lambda: None), heap=HeapCeiling())


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the main process dies, however it dies (even SIGKILL), so no
    orphan goes on writing shards a resumed run is about to write."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


class HeapCeiling:
    """Keeps a process's resident memory flat over any number of batches. glibc keeps the pages of freed batches
    (text, ids) inside its heap, fragmented, so a worker's memory crept from 44 to 97 MB between a 50 MB and a
    2 GB file. Whenever the resident size grows ``SLACK`` past what the last return left, the free pages go back
    (``malloc_trim``): after most batches, as a batch's own memory is freed, so the next batch faults some pages in
    anew. With 2 MiB that costs byte-level tokenizing ~10 % (4 MiB left a 2 GB file's workers 3 MB above a 50 MB
    file's) and a BPE ~1 % (a batch encodes for 100+ ms, a trim takes 2). (A fixed mmap threshold kept memory flat
    too, but faulted every page of every batch: BPE 20 % and bytes 2x slower.)"""

    SLACK = 2 << 20

    def __init__(self):
        self.trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None  # glibc
        self.page = os.sysconf("SC_PAGE_SIZE") if self.trim else 0
        self.ceiling = self._resident() + self.SLACK if self.trim else 0

    def _resident(self) -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self.page

    def check(self) -> None:
        if self.trim is not None and self._resident() > self.ceiling:
            self.trim(0)
            self.ceiling = self._resident() + self.SLACK


def unit_record(out: Path, index: int) -> Path:
    return out / f"part-{index:05d}.done.json"


def shard_name(unit: int, number: int) -> str:
    return f"part-{unit:05d}-{number:03d}.npy"


def tokenize_unit(index: int) -> dict:
    """Tokenize unit ``index`` of the plan into ``part-<unit>-<n>.npy`` shards, then record it as done."""
    plan, out, tokenizer, slots = _WORKER["plan"], _WORKER["out"], _WORKER["tokenizer"], _WORKER["slots"]
    unit = plan["units"][index]
    slots[SLOTS * index + 2] = os.getpid()  # whose unit this is, should this process die
    dtype, shards, tally = token_dtype(tokenizer.vocab_size), [], new_tally()
    batches = tokenized_batches(unit_segments(unit, plan, tally), tokenizer, dtype)

    def reported(stream):
        for tokens, documents in stream:
            slots[SLOTS * index] = min(tally["bytes_read"], unit["bytes"])
            slots[SLOTS * index + 1] += len(tokens)
            _WORKER["tick"]()
            _WORKER["heap"].check()
            if len(tokens):
                yield tokens, documents

    stream = reported(batches)
    pending = next(stream, None)
    while pending is not None:
        name = shard_name(index, len(shards))
        with atomic_write(out / name) as file:
            shard = NpyStream(file, dtype)
            shard.write(*pending)
            pending = None
            for tokens, documents in stream:
                if shard.tokens >= plan["shard_tokens"]:
                    pending = (tokens, documents)
                    break
                shard.write(tokens, documents)
            shards.append(shard.finish(name))
    record = {"index": index, "bytes": unit["bytes"], "shards": shards, "null_rows": tally["null_rows"]}
    write_json(unit_record(out, index), record)
    slots[SLOTS * index] = unit["bytes"]
    return record


class Progress:
    """Input read, tokens written, tokens/s and ETA on stderr, every few seconds, from the per-unit counters the
    workers keep in shared memory (no queue a killed worker could leave locked)."""

    def __init__(self, units: list[dict], slots, already_done: int):
        self.slots, self.total, self.before = slots, sum(u["bytes"] for u in units), already_done
        self.start = self.last = time.monotonic()

    def maybe_show(self) -> None:
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.show()

    def show(self, final: bool = False) -> None:
        self.last = now = time.monotonic()
        counts = np.frombuffer(self.slots, dtype=np.int64).reshape(-1, SLOTS)[:, :2].sum(0)
        done, tokens = self.before + int(counts[0]), int(counts[1])
        elapsed = max(now - self.start, 1e-9)
        rate = (done - self.before) / elapsed
        eta = "done" if final else (f"ETA {_duration((self.total - done) / rate)}" if rate > 0 else "ETA ?")
        digits = 1 if self.total >= 1e8 else 3
        print(f"tokenize: {done / 1e6:,.{digits}f} of {self.total / 1e6:,.{digits}f} MB read, {tokens:,} tokens, "
              f"{tokens / elapsed:,.0f} tokens/s, {eta}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ---- one run per folder -----------------------------------------------------------------------------------------

def lock_folder(folder: Path, task: int, tasks: int, wait: bool = False) -> list[locks.HeldLock]:
    """One ``tokenize`` per folder, or the tasks of one array (the package's one lock, ``locks``): a plain run holds
    ``tokenize.lock`` exclusively, each task holds it shared and its own task lock exclusively. ``wait``: a folder
    held by another run is waited for (saying so) instead of refused."""
    about, held = {"task": task, "tasks": tasks}, []
    try:
        held.append(_lock(folder, folder / LOCK, tasks > 1, about, wait))
        if tasks > 1:
            held.append(_lock(folder, folder / f"tokenize-task-{task:05d}-of-{tasks:05d}.lock", False, about, wait))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held


def _lock(folder: Path, path: Path, shared: bool, about: dict, wait: bool) -> locks.HeldLock:
    try:
        return locks.acquire(path, shared=shared, about=about)
    except locks.NoFlockError as error:
        raise TokenizeError(f"tokenize: {error}") from None
    except locks.FolderLockedError as error:
        holders = error.holders if path.name != LOCK else locks.describe(locks.holders(  # a run, or an array's tasks
            [locks.record_path(path), *sorted(folder.glob("tokenize-task-*.lock" + locks.HOLDER_SUFFIX))]))
        if not wait:
            raise TokenizeError(f"tokenize: another tokenize is writing {folder} ({holders}); wait for it to finish, "
                                "or stop it, then rerun with --resume.") from None
    print(f"tokenize: another run is tokenizing into {folder} ({holders}); waiting for it to finish.",
          file=sys.stderr, flush=True)
    return locks.acquire(path, shared=shared, about=about, wait=True)


# ---- the command ------------------------------------------------------------------------------------------------

def _cores() -> int:
    """The cores this process may run on (a SLURM or cgroup CPU set), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def task_from_environment(task_index: int | None, num_tasks: int | None, planned: dict | None = None) -> tuple:
    """``(task index, number of tasks, first array id)``: each of index and count as given, else from a SLURM array
    (the index counted from its first id in steps of its step) or torchrun, else ``(0, 1)``. ``planned``: the
    folder's plan, whose array a single resubmitted index (``sbatch --array=17``: an array of one) belongs to."""
    env, names, found, first = os.environ, ("--task-index", "--num-tasks"), None, 0
    if "SLURM_ARRAY_TASK_ID" in env:
        ident = int(env["SLURM_ARRAY_TASK_ID"])
        first, step = int(env.get("SLURM_ARRAY_TASK_MIN", 0)), int(env.get("SLURM_ARRAY_TASK_STEP") or 1)
        count = int(env["SLURM_ARRAY_TASK_COUNT"]) if "SLURM_ARRAY_TASK_COUNT" in env else \
            (int(env.get("SLURM_ARRAY_TASK_MAX", ident)) - first) // step + 1
        if count == 1 and planned and planned.get("tasks", 1) > 1:  # one task of the planned array, rerun
            first = planned.get("first_task_id", 0)
            found = (ident - first, planned["tasks"])
        else:
            found = ((ident - first) // step if (ident - first) % step == 0 else count, count)
        env_names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
    elif "RANK" in env and "WORLD_SIZE" in env:
        found, env_names = (int(env["RANK"]), int(env["WORLD_SIZE"])), ("RANK", "WORLD_SIZE")
    index, count = task_index, num_tasks
    if found is not None:
        if index is None:
            index, names = found[0], (env_names[0], names[1])
        if count is None:
            count, names = found[1], (names[0], env_names[1])
    if count is not None and count > 1 and index is None:
        raise TokenizeError(f"tokenize: --num-tasks={count} needs --task-index (this task's index), or run it as a "
                            "SLURM array task.")
    if index is not None and index > 0 and count is None:
        raise TokenizeError(f"tokenize: --task-index={index} needs --num-tasks (how many tasks share the work).")
    index, count = index or 0, count or 1
    if count < 1 or not 0 <= index < count:
        raise TokenizeError(f"tokenize: task index {index} (from {names[0]}) must be in 0..{count - 1} for {count} "
                            f"tasks (from {names[1]}); a SLURM array given as a list (--array=1,5,9) needs "
                            "--task-index and --num-tasks." if names[0].startswith("SLURM") else
                            f"tokenize: {names[0]}={index} must be in 0..{count - 1} ({names[1]}={count}).")
    return index, count, first


def tokenize_to_folder(sources: list[str], out: str, tokenizer_path: str | None = None, text_field: str = "text",
                       workers: int | None = None, shard_tokens: int = SHARD_TOKENS, resume: bool = False,
                       task_index: int | None = None, num_tasks: int | None = None, wait: bool = False) -> dict | None:
    """Tokenize ``sources`` into the shard folder ``out`` (this task's share of it); return the manifest's
    ``_summary``, or ``None`` when other tasks of the array still have units to finish. ``wait``: a folder another
    run is writing is waited for, then continued or found complete (``fit``: two runs of a sweep sharing a corpus)."""
    folder, workers = Path(out), workers or _cores()
    if workers < 1 or shard_tokens < 1:
        raise TokenizeError(f"tokenize: --workers={workers} and --shard-tokens={shard_tokens} must be positive.")
    try:
        planned = json.loads((folder / PLAN).read_text())
    except (OSError, ValueError):
        planned = None  # none yet (or unreadable: said below)
    task, tasks, first_id = task_from_environment(task_index, num_tasks, planned)
    tokenizer = load_tokenizer(tokenizer_path)
    identity = {"format": PLAN_FORMAT, "sources": sources, "tokenizer": tokenizer_identity(tokenizer.spec()),
                "text_field": text_field, "shard_tokens": shard_tokens, **_document_tokens(tokenizer)}
    if folder.exists() and not (folder / PLAN).exists() and any(
            not p.name.startswith("tokenize") for p in folder.iterdir()):
        raise FileExistsError(f"tokenize: --out {folder} exists and is not a tokenize folder (no {PLAN}); choose "
                              "another folder.")
    if (folder / MANIFEST).exists():
        # a finished corpus: nothing writes it again (a run either finds it complete or is refused), so it is
        # checked and read without a lock, which a read-only mount or a FUSE one could not give
        with _stopped_by_signals():
            _existing_plan(folder, identity, sources, resume, task, tasks)
            return _complete(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _stopped_by_signals():  # a signal while waiting for the lock stops the wait too
            held = lock_folder(folder, task, tasks, wait)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # a read-only mount, another user's folder
            raise TokenizeError(f"tokenize: cannot write {error.filename or folder} ({error.strerror}), and {folder} "
                                f"holds no finished corpus (no {MANIFEST}); tokenize into a folder you can write.") \
                from None
        if isinstance(error, PermissionError):  # worded by ``locks``, with its fix
            raise TokenizeError(f"tokenize: {_one_line(error)}") from None
        raise
    try:
        with _stopped_by_signals():
            plan = None
            if not (folder / PLAN).exists():
                if resume and not wait:  # said to a user who asked to resume (fit always continues a folder)
                    print(f"tokenize: {folder} holds no run yet; starting from the beginning.", file=sys.stderr)
                # one task of an array plans, the rest wait for its plan
                with _writing_shared_file(folder, PLAN, {"task": task, "tasks": tasks}):
                    if not (folder / PLAN).exists():
                        plan = _new_plan(folder, identity, input_files(sources), tokenizer, tasks, first_id)
            if plan is None:
                plan = _existing_plan(folder, identity, sources, resume, task, tasks)
                if (folder / MANIFEST).exists():
                    return _complete(folder)
            if tasks > 1 and plan.get("tasks", tasks) != tasks:  # a plain run (exclusive lock) may finish any plan
                raise TokenizeError(f"tokenize: {folder} is tokenized by an array of {plan['tasks']} tasks, this task "
                                    f"counts {tasks}; rerun it with --num-tasks {plan['tasks']}, or finish the folder "
                                    "with one plain run (--resume --num-tasks 1).")
            mine = [u for u in plan["units"] if u["index"] % tasks == task]
            _remove_partials(folder, mine)
            pending = [u for u in mine if not unit_record(folder, u["index"]).exists()]
            _run_units(pending, mine, plan, folder, tokenizer_path, workers)
            return _finish(folder, plan, tokenizer, tokenizer_path, task, tasks)
    finally:
        for lock in held:
            lock.release()


def _document_tokens(tokenizer) -> dict:
    """The special tokens put around each document, where there are any: part of what a folder was written with
    (a folder half-written by a version that put them around every piece of a long document is not continued;
    one it finished is read as written)."""
    around = [list(tokenizer.document_start), list(tokenizer.document_end)]
    return {"document_tokens": around} if any(around) else {}


def _existing_plan(folder: Path, identity: dict, sources: list[str], resume: bool, task: int, tasks: int) -> dict:
    """The plan of a folder a run has written, if this run may continue it: asked to (``--resume``, or a task of
    an array), with the same arguments and inputs."""
    if not resume and tasks == 1:
        done = "holds a tokenized corpus" if (folder / MANIFEST).exists() else "holds an unfinished run"
        raise FileExistsError(f"tokenize: --out {folder} already {done}; pass --resume to continue the run that "
                              "wrote it, or choose another folder.")
    # a task of an array checks its own units' files; a plain run (the array's last step) the listing
    return _checked_plan(folder, identity, input_files(sources) if tasks == 1 else None, task, tasks)


def _complete(folder: Path) -> dict:
    print(f"tokenize: {folder} is already complete ({MANIFEST} written, same arguments and inputs); nothing to do.",
          file=sys.stderr)
    return _summary(folder)


def reading_plan(files: list[Path], text_field: str) -> dict:
    """What reading ``files`` needs (their sizes and times, each table's row groups or batches, the text field):
    the part of a plan that ``unit_segments`` reads, shared by the folder, single-file and in-memory paths."""
    return {"inputs": describe_inputs(files), "text_field": text_field,
            "groups": {str(i): table_groups(p) for i, p in enumerate(files) if p.suffix in TABLE_SUFFIXES}}


def _new_plan(folder: Path, identity: dict, files: list[Path], tokenizer, tasks: int, first_id: int) -> dict:
    reading = reading_plan(files, identity["text_field"])
    inputs, groups = reading["inputs"], {int(i): g for i, g in reading["groups"].items()}
    total = sum(size for _, size, _ in inputs)
    bytes_per_token = 1 if tokenizer.spec()["kind"] == "bytes" else 4
    # at most a shard a unit, and enough units to keep every worker busy: the same cuts for any task count
    target = max(MIN_UNIT_BYTES, min(identity["shard_tokens"] * bytes_per_token, math.ceil(total / UNITS)))
    plan = {**identity, **reading, "units": plan_units(inputs, groups, target), "tasks": tasks,
            "first_task_id": first_id}
    write_json(folder / PLAN, plan)
    return plan


def _checked_plan(folder: Path, identity: dict, files: list[Path] | None, task: int = 0, tasks: int = 1) -> dict:
    """The plan in ``folder``, if it is this job (same arguments) over the same, unchanged inputs: all of them
    listed anew (``files``), or (``None``: a task of an array, so that a thousand tasks do not each list and stat
    millions of files) the files of this task's units, each unchanged."""
    try:
        plan = json.loads((folder / PLAN).read_text())
    except (OSError, json.JSONDecodeError):
        raise TokenizeError(f"tokenize: {folder / PLAN} is unreadable; tokenize into a new folder.") from None
    # an argument added to the identity after a corpus was finished (document_tokens) did not shape it: the corpus
    # is read as written, so a run that trained on it resumes on the same data; an unfinished one is not continued
    finished = (folder / MANIFEST).exists()
    differs = [key for key, value in identity.items() if plan.get(key) != value and (key in plan or not finished)]
    if differs:
        raise TokenizeError(f"tokenize --resume: {folder} was written with other {', '.join(differs)} "
                            f"({', '.join(f'{k}={plan.get(k)!r}' for k in differs)}); rerun with the same "
                            "arguments, or tokenize into a new folder.")
    if files is None:
        used = sorted({i for u in plan["units"] if u["index"] % tasks == task
                       for i in range(u["start"][0], min(u["end"][0] + 1, len(plan["inputs"])))})
        expected = [plan["inputs"][i] for i in used]
        now = describe_inputs([Path(p) for p, _, _ in expected], missing_ok=True)
    else:
        expected, now = plan["inputs"], describe_inputs(files)
    if now != expected:
        planned = {p: (b, m) for p, b, m in expected}
        current = {p: (b, m) for p, b, m in now}
        added = [p for p in current if p not in planned]
        gone = [p for p in planned if p not in current]
        changed = [p for p in current if p in planned and current[p] != planned[p]]
        what = "; ".join(f"{label} {len(paths)} file(s), e.g. {paths[0]}" for label, paths in
                         (("added", added), ("removed", gone), ("changed", changed)) if paths) or "reordered"
        raise TokenizeError(f"tokenize --resume: the inputs differ from those {folder} was tokenized from ({what}); "
                            "shards already written would not match them. Tokenize into a new folder.")
    return plan


def _remove_partials(folder: Path, units: list[dict]) -> None:
    """Partial shards and records of this task's units (a killed worker's): ours by name, never complete. One
    listing of the folder, whatever the number of units."""
    indexes = {unit["index"] for unit in units}
    for entry in os.scandir(folder):
        ours = _PARTIAL_NAME.fullmatch(entry.name)
        if ours and int(ours.group(1)) in indexes:
            Path(entry.path).unlink(missing_ok=True)


_PARTIAL_NAME = re.compile(r"part-(\d{5,})[-.].*" + re.escape(PARTIAL_SUFFIX))  # a unit's shard or record


class _stopped_by_signals:
    """SIGTERM and SIGINT raise ``Stopped`` in the main thread while tokenizing (then workers are stopped)."""

    def __enter__(self):
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.saved[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Stopped(f"tokenize: stopped by {signal.Signals(signum).name}; finished units are kept: rerun the same "
                      "command with --resume to finish.", signum)

    def __exit__(self, *exc):
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def _run_units(pending: list[dict], mine: list[dict], plan: dict, folder: Path, tokenizer_path, workers: int) -> None:
    """Tokenize ``pending`` on ``workers`` processes; at the first failure (an error, a worker killed, a signal)
    stop every worker and say which unit failed and why; finished units stay for ``--resume``."""
    slots = multiprocessing.RawArray("q", SLOTS * len(plan["units"]))
    already = sum(u["bytes"] for u in mine if unit_record(folder, u["index"]).exists())
    progress = Progress(mine, slots, already)  # this task's share
    failure = None  # (unit or None, cause)
    try:
        if workers == 1 or len(pending) <= 1:
            _init_worker(plan, str(folder), tokenizer_path, slots, tick=progress.maybe_show)
            for unit in pending:
                try:
                    tokenize_unit(unit["index"])
                except Stopped:  # a signal, not this unit's failure
                    raise
                except Exception as error:
                    failure = (unit, _one_line(error).rstrip("."))
                    break
        else:
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            processes = min(workers, len(pending))
            executor = ProcessPoolExecutor(processes, mp_context=context, initializer=_init_worker,
                                           initargs=(plan, str(folder), tokenizer_path, slots))
            broken = False
            try:
                queued, futures = iter(pending), {}  # a few units in flight: memory flat over thousands of units
                while failure is None and not broken:
                    try:
                        for unit in itertools.islice(queued, 2 * processes - len(futures)):
                            futures[executor.submit(tokenize_unit, unit["index"])] = unit
                    except BrokenProcessPool:  # a worker died since the last wait
                        broken = True
                        break
                    if not futures:
                        break
                    done, _ = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in sorted(done, key=lambda f: futures[f]["index"]):
                        error = future.exception()
                        if isinstance(error, BrokenProcessPool):
                            broken = True
                        elif error is not None and failure is None:
                            failure = (futures[future], _one_line(error).rstrip("."))
                        del futures[future]
                    progress.maybe_show()
            finally:
                exits = _stop(executor)
            if broken:
                failure = _lost_unit(exits, pending, slots, folder)
    except Stopped as stop:
        _remove_partials(folder, pending)
        kept = sum(unit_record(folder, u["index"]).exists() for u in plan["units"])
        name = signal.Signals(stop.exit_code - 128).name
        raise Stopped(f"tokenize: stopped by {name}; {kept} of {len(plan['units'])} units are finished and kept: "
                      "rerun the same command with --resume to finish.", stop.exit_code - 128) from None
    if failure is not None:
        _remove_partials(folder, pending)
        unit, cause = failure
        kept = sum(unit_record(folder, u["index"]).exists() for u in plan["units"])
        where = describe_unit(unit, plan) if unit is not None else "a worker outside any unit"
        raise TokenizeError(f"tokenize: {where} failed: {cause}. {kept} of {len(plan['units'])} units are finished "
                            "and kept: fix the cause and rerun the same command with --resume.")
    progress.show(final=True)


def _lost_unit(exits: dict[int, int | None], pending: list[dict], slots, folder: Path) -> tuple[dict | None, str]:
    """Which unit a broken pool lost, and why, from its workers' exit codes. The pool ends the survivors with
    SIGTERM, so the worker that broke it is one with another code: killed by a signal, or exited (status 0 when
    it could not start: its initializer failed, the error printed above). When every worker ended by SIGTERM, a
    scheduler's stop (SLURM signals every process of a step) reached them before this process: a stop, not a
    failure."""
    died = {pid: code for pid, code in exits.items() if code is not None and code != -signal.SIGTERM}
    if not died:
        raise Stopped("tokenize: stopped by SIGTERM.", signal.SIGTERM)
    pid, code = min(died.items(), key=lambda item: item[1] == 0)  # a killed worker before one that could not start
    if code == 0:
        return None, f"a worker process (pid {pid}) could not start (the error is printed above)"
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    unit = next((u for u in pending if slots[SLOTS * u["index"] + 2] == pid
                 and not unit_record(folder, u["index"]).exists()), None)
    return unit, f"its worker process (pid {pid}) {how} (the out-of-memory killer sends SIGKILL)"


def _stop(executor: ProcessPoolExecutor) -> dict[int, int | None]:
    """Stop the pool now: queued units cancelled, running workers terminated (their partial shards are removed
    by the caller), so nothing goes on writing after we return. Returns each worker's exit code; a worker that
    ignores SIGTERM (stuck in the kernel, e.g. on a hung NFS mount) gets SIGKILL, and none is waited for forever."""
    processes = list((getattr(executor, "_processes", None) or {}).values())  # 3.14 has terminate_workers()
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_WAIT_S)
    return {process.pid: process.exitcode for process in processes}


def _one_line(error: BaseException) -> str:
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(message).split()) or type(error).__name__


def _finish(folder: Path, plan: dict, tokenizer, tokenizer_path: str | None, task: int, tasks: int) -> dict | None:
    """The manifest, once every unit of every task is done (so the last task to finish writes it)."""
    missing = [u["index"] for u in plan["units"] if not unit_record(folder, u["index"]).exists()]
    if missing:
        owners = sorted({i % tasks for i in missing})
        print(f"tokenize: task {task} of {tasks} finished its units; {len(missing)} unit(s) of task(s) "
              f"{', '.join(map(str, owners[:10]))}{' ...' if len(owners) > 10 else ''} are not done yet. The last task "
              "to finish writes the manifest (a task that failed: rerun it with --resume).", file=sys.stderr)
        return None
    with _writing_shared_file(folder, MANIFEST, {"task": task, "tasks": tasks}):
        if (folder / MANIFEST).exists():  # another task of the array finished too and wrote it
            return _summary(folder)
        return _write_manifest(folder, plan, tokenizer, tokenizer_path)


def _write_manifest(folder: Path, plan: dict, tokenizer, tokenizer_path: str | None) -> dict:
    totals = {"tokens": 0, "documents": 0, "null_rows": 0, "max_id": -1, "shard_count": 0}
    for record in _unit_records(folder, plan):  # a first pass for the totals the manifest opens with
        totals["null_rows"] += record.get("null_rows", 0)
        for shard in record["shards"]:
            totals["shard_count"] += 1
            for key in ("tokens", "documents"):
                totals[key] += shard[key]
            totals["max_id"] = max(totals["max_id"], shard["max_id"])
    if not totals["shard_count"]:
        raise TokenizeError(f"tokenize: sources {plan['sources']} hold no text; nothing written to {folder}.")
    header = {"format": FORMAT, "tokenizer": tokenizer_identity(tokenizer.spec()), "tokenizer_path": tokenizer_path,
              "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
              "dtype": token_dtype(tokenizer.vocab_size).name, "text_field": plan["text_field"], **totals,
              "input_files": len(plan["inputs"]), "input_bytes": sum(size for _, size, _ in plan["inputs"])}
    write_json(folder / MANIFEST, {**header, "shards": _listed_shards(folder, plan, totals)})
    return header


@contextmanager
def _writing_shared_file(folder: Path, name: str, about: dict):
    """The plan and the manifest, which any task of an array may write, are written by one task at a time (the
    others wait, saying for whom); under that lock a partial copy of either (a task killed while writing it) is
    stale and goes, except where flock is local to each node and a writer on another node may be live."""
    try:
        held = locks.acquire(folder / PLAN_LOCK, about=about)
    except locks.FolderLockedError as error:
        print(f"tokenize: waiting for {error.holders} to write {folder / name}.", file=sys.stderr, flush=True)
        held = locks.acquire(folder / PLAN_LOCK, about=about, wait=True)
    try:
        if locks.local_only_flock(folder) is None:
            for entry in os.scandir(folder):
                copy = _PARTIAL_COPY.fullmatch(entry.name)
                if copy and copy.group(1) == name:
                    Path(entry.path).unlink(missing_ok=True)
        yield
    finally:
        held.release()


_PARTIAL_COPY = re.compile(r"(.+)\.[a-z0-9_]{8}" + re.escape(PARTIAL_SUFFIX))  # atomic_write's (mkstemp's) name


def _summary(folder: Path) -> dict:
    """The manifest's fields but its shard list, which can be long: ``shard_count`` instead."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["shard_count"] = len(manifest.pop("shards"))
    return manifest


def _unit_records(folder: Path, plan: dict):
    """Each unit's record, in order, read one at a time: a manifest of thousands of units is never held whole."""
    for unit in plan["units"]:
        yield json.loads(unit_record(folder, unit["index"]).read_text())


def _listed_shards(folder: Path, plan: dict, totals: dict):
    """The manifest's shards, read again; they must add up to the totals of the first reading (a record rewritten
    in between would pair a header with other shards: the error leaves no manifest)."""
    count, tokens = 0, 0
    for record in _unit_records(folder, plan):
        for shard in record["shards"]:
            count, tokens = count + 1, tokens + shard["tokens"]
            yield shard
    if (count, tokens) != (totals["shard_count"], totals["tokens"]):
        raise TokenizeError(f"tokenize: the unit records in {folder} changed while the manifest was written (is "
                            "another run writing this folder?); rerun with --resume.")


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
    plan = reading_plan(input_files(sources), text_field)
    inputs = plan["inputs"]
    whole = {"index": 0, "start": [0, 0], "end": [len(inputs), 0], "bytes": sum(s for _, s, _ in inputs)}
    sidecar, dtype = sidecar_path(out), token_dtype(tokenizer.vocab_size)
    with atomic_write(out) as file:
        writer = NpyStream(file, dtype)
        for tokens, documents in tokenized_batches(unit_segments(whole, plan, new_tally()), tokenizer, dtype):
            writer.write(tokens, documents)
        if writer.tokens == 0:
            raise ValueError(f"sources {sources}: no text found, nothing to write.")
        writer.finish(out.name)
        # the old file's record goes before the rename and the new one after it, so a failure part-way never
        # pairs one file's tokens with the other's record (a .npy alone has its ids checked when read)
        sidecar.unlink(missing_ok=True)
    write_json(sidecar, {"vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer_path, "max_id": writer.max_id,
                         "tokenizer_identity": tokenizer_identity(tokenizer.spec())})
    return out


def tokenize_in_memory(files: list[Path], tokenizer, text_field: str,
                       max_tokens: int | None) -> tuple[np.ndarray, int]:
    """Documents tokenized at start-up (small corpora), read as ``tokenize`` reads them (one reader: raw bytes,
    so a "\\r\\n" file gives the same ids either way); stops at the batch that reaches ``max_tokens``.
    Returns the tokens and how many files were read."""
    plan, dtype = reading_plan(files, text_field), token_dtype(tokenizer.vocab_size)
    chunks, count, tally = [], 0, new_tally()
    for i in range(len(files)):
        unit = {"index": 0, "start": [i, 0], "end": [i + 1, 0], "bytes": plan["inputs"][i][1]}
        for tokens, _ in tokenized_batches(unit_segments(unit, plan, tally), tokenizer, dtype):
            chunks.append(tokens)
            count += len(tokens)
            if max_tokens is not None and count >= max_tokens:
                break
        if max_tokens is not None and count >= max_tokens:
            break
    if tally["null_rows"]:
        sources.info(f"data: skipped {tally['null_rows']:,} table row(s) whose {text_field!r} is null")
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)), i + 1 if files else 0


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
    parser.add_argument("--num-tasks", type=int, default=None,
                        help="tasks sharing the work (default: SLURM_ARRAY_TASK_COUNT or WORLD_SIZE, else 1)")
    parser.add_argument("--task-index", type=int, default=None,
                        help="this task's index (default: SLURM_ARRAY_TASK_ID or RANK, else 0)")
    args = parser.parse_args(argv)
    try:
        if args.out.endswith(".npy"):
            out = write_token_file(args.sources, args.out, args.tokenizer, args.text_field, args.overwrite)
            print(f"wrote {len(np.load(out, mmap_mode='r')):,} tokens to {out}")
            return
        manifest = tokenize_to_folder(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                                      args.shard_tokens, args.resume, args.task_index, args.num_tasks)
    except (TokenizeError, ValueError, KeyError, OSError, ImportError) as error:
        print(f"moe-lightning tokenize: error: {_one_line(error)}", file=sys.stderr)
        raise SystemExit(getattr(error, "exit_code", 1)) from None
    if manifest is not None:
        nulls = f"; {manifest['null_rows']:,} rows with null text skipped" if manifest["null_rows"] else ""
        print(f"wrote {manifest['tokens']:,} tokens ({manifest['documents']:,} documents{nulls}) in "
              f"{manifest['shard_count']} shard(s) to {args.out}")
