"""What a ``data.source`` names: documents to tokenize (text, JSONL, Parquet, Arrow) or token files.

Nothing here imports Lightning: ``moe-lightning tokenize`` reads the same sources without the trainer.
A remote reader (object storage) would add one more branch to ``resolve_source`` and the readers of ``tokenize.unit_segments``.
"""

import glob
import json
import math
import os
import re
import sysconfig
from pathlib import Path

import numpy as np

from moe_lightning.run.console import info

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".html", ".tex"}
TABLE_SUFFIXES = {".parquet", ".arrow"}  # read through pyarrow, one document per row
READ_SUFFIXES = TEXT_SUFFIXES | {".jsonl"} | TABLE_SUFFIXES  # what a folder source reads
MANIFEST = "manifest.json"  # the index of a shard folder written by `moe-lightning tokenize`
PLAN = "tokenize-plan.json"  # its plan, written first: a folder with a plan and no manifest is being written
SEGMENT_CHARS = 1 << 19  # a longer document is encoded in pieces of about this many characters, cut between words
MAX_SEGMENT_CHARS = 1 << 22  # a run this long without whitespace (a blob, not prose) is cut where it reaches it
WORD_END = re.compile(r"[\x21-\x7e][ \t\n\r\x0b\x0c]")  # an ASCII non-space then whitespace: a cut between words

def stdlib_files() -> list[Path]:
    """The interpreter's own standard library sources, in a stable order (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB: what ``git`` and ``grep`` take for a binary file (text never has one)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def is_token_source(resolved) -> bool:
    """A ``.npy`` token file or a shard folder (as ``resolve_source`` returns them), not documents."""
    return isinstance(resolved, Path)


def _written_by_tokenize(folder: Path) -> bool:
    return (folder / PLAN).is_file() or any(folder.glob("part-*.npy"))


def _wait_for_tokenize(folder: Path, source: str) -> None:
    """Wait for the tokenize writing ``folder`` (a run, or every task of an array), saying whose: its folder lock,
    and each task's, taken shared (the ranks of one fit do not wait for each other) and given back at once. A
    folder whose locks cannot be taken here (a read-only copy) is judged by its files alone."""
    from moe_lightning.run import locks
    for lock in [folder / locks.LOCK_FILE, *sorted(folder.glob(f"{locks.LOCK_PREFIX}.task-*.lock"))]:
        try:
            try:
                held = locks.acquire(lock, shared=True)
            except locks.FolderLockedError as busy:
                os.write(2, f"data.source={source!r}: a tokenize is still writing it ({busy.holders}); waiting for "
                            f"it to finish.\n".encode())
                held = locks.acquire(lock, shared=True, wait=True)
        except (OSError, locks.NoFlockError):
            return
        held.release()


def resolve_source(source: str) -> list[Path] | Path:
    """The document files a source names, or the path of a token source (a ``.npy`` file or a shard folder
    with its manifest); raise if it names nothing.

    A file named directly must be text or a table; folders and globs skip what is not, and say what they
    skipped. A folder holding Parquet/Arrow files is read as a table folder (only those files).
    """
    if source == "stdlib":
        return stdlib_files()
    path = Path(source).expanduser()
    if path.suffix == ".npy" and path.is_file():
        return path
    if path.is_dir() and not (path / MANIFEST).is_file() and _written_by_tokenize(path):
        _wait_for_tokenize(path, source)
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(f"data.source={source!r} is a token folder with no {MANIFEST}: the tokenize "
                                    "run that wrote it did not finish and no process is writing it now (the manifest "
                                    "is written last). Rerun the same `moe-lightning tokenize ... --resume` to "
                                    "complete it.")
    if path.is_dir() and (path / MANIFEST).is_file() and any(path.glob("part-*.npy")):
        return path
    if path.is_file():
        if path.suffix not in TABLE_SUFFIXES and is_binary(path):
            raise ValueError(f"data.source={source!r} is a binary file (it has NUL bytes), not text: pass text files, "
                             "a folder, .jsonl, .parquet/.arrow, or token files written by `moe-lightning tokenize`.")
        return [path]
    folder = path.is_dir()
    if folder:  # sorted by parts, as Path sorts, without Path's slow comparisons (50,000 files: 1.5 s)
        candidates = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.parts)
        looked_for = f"{sorted(READ_SUFFIXES)}"
        if any(p.name.startswith("part-") and p.name.endswith(".npy") for p in candidates):
            raise FileNotFoundError(f"data.source={source!r} holds token shards but no {MANIFEST}: the tokenize run "
                                    "that wrote it did not finish (the manifest is written last). Rerun the same "
                                    "`moe-lightning tokenize ... --resume` to complete it.")
    else:
        candidates = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        looked_for = "text files"
        if not candidates:
            raise FileNotFoundError(f"data.source={source!r}: no such file, folder or glob match. Use 'stdlib' for "
                                    "the built-in corpus, or a path to text, .jsonl, Parquet/Arrow or .npy token files.")
    table_folder = folder and any(p.suffix in TABLE_SUFFIXES for p in candidates)
    files, skipped = [], []

    def shown():  # only for the files skipped (relative_to costs 20 us a file)
        return p.relative_to(path) if folder else p

    for p in candidates:
        suffix = p.suffix
        if table_folder and suffix not in TABLE_SUFFIXES:
            skipped.append(f"{shown()} (a folder of Parquet/Arrow files: only those are read)")
        elif folder and suffix not in READ_SUFFIXES:
            skipped.append(f"{shown()} (suffix {suffix or 'none'!r} not read)")
        elif suffix == ".npy":
            skipped.append(f"{p} (token files are read only when named directly)")
        elif suffix not in TABLE_SUFFIXES and is_binary(p):
            skipped.append(f"{shown()} (binary)")
        else:
            files.append(p)
    if skipped:
        shown = "; ".join(skipped[:10]) + (f"; and {len(skipped) - 10} more" if len(skipped) > 10 else "")
        info(f"data.source={source!r}: skipped {len(skipped)} file(s): {shown}")
    if not files:
        raise ValueError(f"data.source={source!r}: no text files to read (looked for {looked_for}; "
                         f"skipped {len(skipped)}).")
    return files


def segments(text: str) -> list[str]:
    """``text`` in pieces of about ``SEGMENT_CHARS`` that a tokenizer encodes as it would the whole: each cut
    falls between an ASCII non-space character and the whitespace after it, which a byte-level BPE's
    pre-tokenizer (GPT-2's pattern) never joins, so the ids are the same. A run of ``MAX_SEGMENT_CHARS`` without
    one is cut where it reaches that length (the only place the ids may differ). Either way no tokenizer is
    handed a document of any size at once (a 200 MB one aborted the process inside the library)."""
    if len(text) <= SEGMENT_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > SEGMENT_CHARS:
        cut = last_word_end(text, start, start + SEGMENT_CHARS)
        if cut <= start:
            found = WORD_END.search(text, start + SEGMENT_CHARS, start + MAX_SEGMENT_CHARS)
            cut = found.start() + 1 if found else min(start + MAX_SEGMENT_CHARS, len(text))
        pieces.append(text[start:cut])
        start = cut
    return pieces + [text[start:]] if start < len(text) else pieces


def last_word_end(text, start: int, end: int) -> int:
    """The last cut between words (see ``segments``) in ``text[start:end]`` (a str or bytes), or -1."""
    for space in (("\n", " ") if isinstance(text, str) else (b"\n", b" ")):
        at = text.rfind(space, start + 1, end)
        while at > start:
            before = text[at - 1]
            if 0x21 <= (ord(before) if isinstance(before, str) else before) <= 0x7E:
                return at
            at = text.rfind(space, start + 1, at)
    return -1


def iter_jsonl(path: Path, text_field: str, tally: dict, start: int = 0, end: int | None = None):
    """Texts of the lines that begin in bytes ``[start, end)`` (a worker's slice of a large file); the bytes
    read are added to ``tally["bytes_read"]`` (progress counts bytes of input, not characters of text)."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # finish the line that straddles ``start``: it belongs to the previous slice
        line_no = None if start else 0  # line numbers are known only when reading from the top
        while end is None or f.tell() < end:
            raw = f.readline()
            if not raw:
                break
            tally["bytes_read"] += len(raw)
            line_no = None if line_no is None else line_no + 1
            line = raw.decode("utf-8", errors="replace")
            if line.strip():
                yield _jsonl_text(line, path, line_no if line_no is not None else f"byte {f.tell() - len(raw)}",
                                  text_field)


def _jsonl_text(line: str, path: Path, line_no, text_field: str) -> str:
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
                       f"data.text_field (tokenize: --text-field) to one of {sorted(record)}.")
    if not isinstance(record[text_field], str):
        raise ValueError(f"{path}:{line_no}: field {text_field!r} holds a {type(record[text_field]).__name__}, "
                         "not text.")
    return record[text_field]


def pyarrow_modules():
    """``(pyarrow, pyarrow.parquet)``, or an error saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("reading Parquet/Arrow files needs pyarrow: pip install 'moe-lightning[data]' "
                          "(or pip install pyarrow).") from None
    return pyarrow, pyarrow.parquet


def _open_arrow(path: Path):
    """An Arrow IPC reader: the random-access file format, else the stream format (what ``datasets`` saves)."""
    pa, _ = pyarrow_modules()
    try:
        return pa.ipc.open_file(pa.OSFile(str(path)))
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.OSFile(str(path)))


def table_groups(path: Path) -> list[int]:
    """Uncompressed bytes of each Parquet row group (from the footer alone) or Arrow record batch (read one at a
    time): the pieces a table is cut into, so a large file is spread over workers in bounded memory."""
    _, pq = pyarrow_modules()
    if path.suffix == ".parquet":
        meta = pq.ParquetFile(str(path)).metadata
        return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    return [batch.nbytes for batch in _arrow_batches(_open_arrow(path))]


def _arrow_batches(reader, wanted: list[int] | None = None):
    """Record batches of an Arrow reader (those numbered in ``wanted`` only), one in memory at a time; the
    stream format has no index, so the batches before the wanted ones are read past (each unit of a stream file
    reads it from its start up to its own batches: the file format, which has an index, reads only those)."""
    if hasattr(reader, "num_record_batches"):
        yield from (reader.get_batch(i) for i in (range(reader.num_record_batches) if wanted is None else wanted))
        return
    if wanted is not None and not wanted:
        return
    last = None if wanted is None else max(wanted)
    wanted = None if wanted is None else set(wanted)
    for i, batch in enumerate(reader):
        if wanted is None or i in wanted:
            yield batch
        if i == last:
            return


def iter_table_batches(path: Path, text_field: str, groups: list[int], batch_rows: int = 1024):
    """``(texts, rows whose text is null, bytes read)``, ``batch_rows`` rows (or one Arrow record batch) at a
    time, of the row groups or record batches numbered in ``groups``: memory stays bounded at any file size. The
    bytes are those ``table_groups`` counts, a Parquet row group's spread over its rows."""
    pa, pq = pyarrow_modules()
    if path.suffix == ".parquet":
        file = pq.ParquetFile(str(path), buffer_size=1 << 20)  # column chunks read in pieces, not whole
        schema, batches = file.schema_arrow, None
    else:
        reader = _open_arrow(path)
        schema = reader.schema
    if text_field not in schema.names:
        raise KeyError(f"{path}: no column {text_field!r}; set data.text_field (tokenize: --text-field) to one of "
                       f"{schema.names}.")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {text_field!r} holds {kind}, not text; set data.text_field "
                         "(tokenize: --text-field) to a string column.")
    if path.suffix == ".parquet":
        if groups == []:
            return
        batches = file.iter_batches(batch_size=batch_rows, columns=[text_field], row_groups=groups)
        meta = file.metadata
        rows_before = np.cumsum([0] + [meta.row_group(g).num_rows for g in groups])
        bytes_before = np.cumsum([0] + [meta.row_group(g).total_byte_size for g in groups])
    else:
        batches = _arrow_batches(reader, groups)
    rows, read = 0, 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        if path.suffix == ".parquet":
            rows += batch.num_rows
            now = int(np.interp(rows, rows_before, bytes_before))
            batch_bytes, read = now - read, now
        else:
            batch_bytes = batch.nbytes
        yield [text for text in column.to_pylist() if text is not None], column.null_count, batch_bytes


def parse_sources(source) -> tuple[list[dict], bool]:
    """``data.source`` as ``[{"path", "weight", "name"}]`` and whether it is a weighted mixture.

    A string or a plain list of strings is one corpus (today's meaning: concatenated, one split); any entry
    written as ``{path: ..., weight: ...}`` makes the list a mixture (strings in it weigh 1).
    """
    entries = [source] if isinstance(source, str) else source
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(f"data.source={source!r}: give a path, a list of paths, or a list of "
                         "{path: ..., weight: ...} entries.")
    mixture = any(isinstance(e, dict) for e in entries)
    parsed = []
    for i, entry in enumerate(entries):
        where = f"data.source[{i}]"
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{where}={entry!r}: each source is a path or {{path: ..., weight: ...}}.")
        unknown = set(entry) - {"path", "weight", "name"}
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {sorted(unknown)}: a source takes path, weight, name.")
        if not isinstance(entry.get("path"), str):
            raise ValueError(f"{where}={entry!r}: needs a path (a string).")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise ValueError(f"{where}.weight={weight!r} (source {entry['path']!r}): weights must be positive "
                             "numbers (they are relative: 3 and 1 give 75 % and 25 %).")
        name = entry.get("name") or Path(entry["path"].rstrip("/")).name.removesuffix(".npy") or entry["path"]
        parsed.append({"path": entry["path"], "weight": float(weight), "name": str(name)})
    seen = {}
    for i, e in enumerate(parsed):  # a source given twice would silently count twice (weight and validation)
        key = "stdlib" if e["path"] == "stdlib" else os.path.realpath(os.path.expanduser(e["path"]))
        if key in seen:
            raise ValueError(f"data.source[{i}] ({e['path']!r}) repeats data.source[{seen[key]}]: a source given "
                             "twice would count twice in training and validation; list it once (in a mixture, "
                             "with the sum of the weights).")
        seen[key] = i
    names = [e["name"] for e in parsed]
    for e in parsed:  # names label the per-source validation losses: make them unique
        if names.count(e["name"]) > 1:
            e["name"] = f"{e['name']}_{parsed.index(e)}"
    return parsed, mixture


def sidecar_path(path: Path) -> Path:
    """Where a ``.npy`` token file's metadata (tokenizer, vocabulary, max id) lives."""
    return path.with_name(path.name + ".json")
