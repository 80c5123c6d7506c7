"""Reading a corpus as ``tokenize`` reads it: the input files, what reading them needs, and a unit's text in corpus
order, encoded in bounded batches. One reader for the shard folder, the single ``.npy`` file and the in-memory
tokenizing at ``fit``'s start-up, so all three give the same ids."""

import re
from pathlib import Path

import numpy as np

from moe_lightning.data import sources
from moe_lightning.data.sources import TABLE_SUFFIXES, WORD_END, is_token_source, iter_jsonl, iter_table_batches, \
    last_word_end, resolve_source, segments, table_groups
from moe_lightning.data.tokenize.errors import TokenizeError

BATCH_CHARS = 1 << 19  # text encoded per batch (512 KiB, half the smallest unit): memory flat at any size


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)



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


def reading_plan(files: list[Path], text_field: str) -> dict:
    """What reading ``files`` needs (their sizes and times, each table's row groups or batches, the text field):
    the part of a plan that ``unit_segments`` reads, shared by the folder, single-file and in-memory paths."""
    return {"inputs": describe_inputs(files), "text_field": text_field,
            "groups": {str(i): table_groups(p) for i, p in enumerate(files) if p.suffix in TABLE_SUFFIXES}}


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
