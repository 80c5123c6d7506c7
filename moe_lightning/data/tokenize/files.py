"""The files ``tokenize`` writes, each through ``durable.atomic_write``: ``.npy`` shards streamed with their header
patched, a unit's record after its shards, the manifest last (from the unit records, never held whole), JSON an
item a line; and the single ``.npy`` file (with its sidecar) of a small corpus."""

import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_lightning.data.sources import MANIFEST, sidecar_path
from moe_lightning.data.tokenize.errors import TokenizeError
from moe_lightning.data.tokenize.reading import input_files, new_tally, reading_plan, token_dtype, \
    tokenized_batches, unit_segments
from moe_lightning.data.tokenizer import load_tokenizer, tokenizer_identity
from moe_lightning.run.durable import PARTIAL_SUFFIX, atomic_write

FORMAT = "moe_lightning token shards v1"


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


def unit_record(out: Path, index: int) -> Path:
    return out / f"part-{index:05d}.done.json"


def shard_name(unit: int, number: int) -> str:
    return f"part-{unit:05d}-{number:03d}.npy"



def remove_partials(folder: Path, units: list[dict]) -> None:
    """Partial shards and records of this task's units (a killed worker's): ours by name, never complete. One
    listing of the folder, whatever the number of units."""
    indexes = {unit["index"] for unit in units}
    for entry in os.scandir(folder):
        ours = _PARTIAL_NAME.fullmatch(entry.name)
        if ours and int(ours.group(1)) in indexes:
            Path(entry.path).unlink(missing_ok=True)


_PARTIAL_NAME = re.compile(r"part-(\d{5,})[-.].*" + re.escape(PARTIAL_SUFFIX))  # a unit's shard or record


def write_manifest(folder: Path, plan: dict, tokenizer, tokenizer_path: str | None) -> dict:
    totals = {"tokens": 0, "documents": 0, "null_rows": 0, "max_id": -1, "shard_count": 0}
    for record in unit_records(folder, plan):  # a first pass for the totals the manifest opens with
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
    write_json(folder / MANIFEST, {**header, "shards": listed_shards(folder, plan, totals)})
    return header



def summary(folder: Path) -> dict:
    """The manifest's fields but its shard list, which can be long: ``shard_count`` instead."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["shard_count"] = len(manifest.pop("shards"))
    return manifest


def unit_records(folder: Path, plan: dict):
    """Each unit's record, in order, read one at a time: a manifest of thousands of units is never held whole."""
    for unit in plan["units"]:
        yield json.loads(unit_record(folder, unit["index"]).read_text())


def listed_shards(folder: Path, plan: dict, totals: dict):
    """The manifest's shards, read again; they must add up to the totals of the first reading (a record rewritten
    in between would pair a header with other shards: the error leaves no manifest)."""
    count, tokens = 0, 0
    for record in unit_records(folder, plan):
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
