"""`moe-lightning tokenize` into shard folders, and reading them: same tokens as tokenizing at start-up,
parallel, resumable, atomic, refusing bad inputs with one clear line."""

import json
import os

import numpy as np
import pytest

from moe_lightning.data import TextDataModule, tokenize_to_folder, write_token_file
from moe_lightning.data.tokenize import files, reading, workers
from moe_lightning.data.tokenize import plan as planning
from moe_lightning.data.tokenize.command import tokenize_main
from moe_lightning.data.tokenize.errors import TokenizeError


def bpe_tokenizer(path, text: str) -> str:
    """A small trained byte-level BPE (what real corpora use), written as a tokenizers JSON file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """Every input kind: text files, JSONL, Parquet (three row groups), Arrow stream (as `datasets` saves);
    units of a few KB, so that a tiny corpus is still cut into many units."""
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 2000)
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path / "corpus"
    (root / "text").mkdir(parents=True)
    for i in range(5):
        (root / "text" / f"doc{i}.txt").write_text(f"plain text number {i} " * (20 + 7 * i))
    (root / "text" / "empty.txt").write_text("")  # an empty document adds nothing, not even its end token
    with open(root / "docs.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"body": f"json record {i} élan " * (1 + i % 9), "id": i}) + "\n")
    rows = [f"parquet row {i} " * (1 + i % 5) for i in range(600)]
    (root / "table").mkdir()
    pq.write_table(pa.table({"body": rows, "n": list(range(600))}), root / "table" / "a.parquet", row_group_size=200)
    (root / "table" / "README.md").write_text("a table folder's other files are not documents")
    with pa.ipc.new_stream(root / "b.arrow", pa.schema([("body", pa.string())])) as writer:
        for start in (0, 50):
            writer.write_batch(pa.record_batch([pa.array([f"arrow row {i} " * 3 for i in range(start, start + 50)])],
                                               names=["body"]))
    return [str(root / "text"), str(root / "docs.jsonl"), str(root / "table"), str(root / "b.arrow")]


def stream(dm) -> np.ndarray:
    dm.setup()
    return dm.train_set.tokens[:]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_shards_hold_exactly_the_tokens_of_tokenizing_at_start_up_for_every_input_kind(corpus, tmp_path, kind):
    tokenizer = None if kind == "bytes" else bpe_tokenizer(tmp_path / "bpe.json", "json record parquet row " * 50)
    # small shards and units: several workers, several shards per unit, Parquet split by row groups
    manifest = tokenize_to_folder(corpus, str(tmp_path / "shards"), tokenizer, "body", workers=2, shard_tokens=3000)
    expected = stream(TextDataModule(corpus, seq_len=8, tokenizer=tokenizer, text_field="body"))
    got = stream(TextDataModule(str(tmp_path / "shards"), seq_len=8, tokenizer=tokenizer))
    np.testing.assert_array_equal(got, expected)
    listed = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest == {**{k: v for k, v in listed.items() if k != "shards"}, "shard_count": len(listed["shards"])}
    assert manifest["tokens"] == len(expected) and manifest["shard_count"] > 5
    plan = json.loads((tmp_path / "shards" / "tokenize-plan.json").read_text())
    parquet = next(i for i, (path, _, _) in enumerate(plan["inputs"]) if path.endswith("a.parquet"))
    assert [parquet, 1] in [u["end"] for u in plan["units"]]  # Parquet cut between row groups
    assert manifest["documents"] == 5 + 300 + 600 + 100  # the empty text file is no document
    assert manifest["dtype"] == "uint16" and manifest["max_id"] == int(expected.max())
    written = sum(len(np.load(tmp_path / "shards" / s["file"])) for s in listed["shards"])
    assert written == manifest["tokens"] == sum(s["tokens"] for s in listed["shards"])
    assert {os.path.basename(path) for path, _, _ in plan["inputs"]} >= {"docs.jsonl", "a.parquet", "b.arrow"}
    assert not any(path.endswith("README.md") for path, _, _ in plan["inputs"])
    assert manifest["input_files"] == len(plan["inputs"]) and "inputs" not in manifest


def test_a_crlf_text_file_gives_the_same_ids_in_memory_and_in_a_folder(tmp_path):
    """Was: the start-up reader translated "\\r\\n" to "\\n" (Path.read_text), tokenize did not: other tokens."""
    path = tmp_path / "dos.txt"
    path.write_bytes(b"a line of text\r\n" * 1000 + b"an old mac line\r" * 100)
    tokenize_to_folder([str(path)], str(tmp_path / "shards"), workers=1)
    in_memory = stream(TextDataModule(str(path), seq_len=8))
    np.testing.assert_array_equal(stream(TextDataModule(str(tmp_path / "shards"), seq_len=8)), in_memory)
    assert len(in_memory) == path.stat().st_size + 1  # every byte, then the end-of-document token


def test_one_worker_and_many_write_the_same_stream_and_a_large_jsonl_is_split_by_lines(tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} " * (i % 13 + 1)}) + "\n" for i in range(4000)))
    monkeypatch.setattr(reading, "BATCH_CHARS", 1000)  # many batches per unit
    one = tokenize_to_folder([str(path)], str(tmp_path / "one"), workers=1)
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 5000)
    many = tokenize_to_folder([str(path)], str(tmp_path / "many"), workers=2, shard_tokens=20_000)
    assert many["shard_count"] > one["shard_count"] == 1
    units = json.loads((tmp_path / "many" / "tokenize-plan.json").read_text())["units"]
    assert len(units) > 4 and all(u["start"][0] == 0 for u in units[:-1])  # byte ranges of the one file
    a, b = (stream(TextDataModule(str(tmp_path / name), seq_len=8)) for name in ("one", "many"))
    np.testing.assert_array_equal(a, b)
    assert one["documents"] == many["documents"] == 4000


def test_resume_redoes_only_unfinished_units_and_a_folder_without_manifest_is_never_read(corpus, tmp_path, capsys):
    out = tmp_path / "shards"
    tokenize_to_folder(corpus, str(out), text_field="body", workers=2, shard_tokens=3000)
    reference = stream(TextDataModule(str(out), seq_len=8))
    # the state a kill leaves: the manifest not yet written, one unit's record missing, a shard half written
    (out / "manifest.json").unlink()
    (out / "part-00001.done.json").unlink()
    (out / "part-00001-000.npy.k1ll3d.partial").write_bytes(b"half a shard")  # atomic_write's partial name
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("part-00000-*.npy")}
    with pytest.raises(FileNotFoundError, match="no manifest.json.*--resume"):
        TextDataModule(str(out))
    with pytest.raises(FileExistsError, match="--resume"):
        tokenize_to_folder(corpus, str(out), text_field="body")
    with pytest.raises(TokenizeError, match="text_field"):
        tokenize_to_folder(corpus, str(out), text_field="text", resume=True)
    tokenize_to_folder(corpus, str(out), text_field="body", workers=1, shard_tokens=3000, resume=True)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-00000-*.npy")} == finished  # not redone
    assert not list(out.glob("*.partial"))
    np.testing.assert_array_equal(stream(TextDataModule(str(out), seq_len=8)), reference)
    tokenize_main([*corpus, "--out", str(out), "--text-field", "body", "--shard-tokens", "3000", "--resume"])
    assert "already complete" in capsys.readouterr().err


def test_progress_goes_to_stderr_with_rate_and_eta(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workers, "PROGRESS_EVERY_S", 0.0)  # a line per batch
    tokenize_main([*corpus, "--out", str(tmp_path / "s"), "--text-field", "body", "--workers", "1"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("tokenize:")]
    assert len(lines) > 3 and "tokens/s" in lines[0] and "ETA" in lines[0] and lines[-1].endswith("done")
    read, total = lines[-1].split(" MB read")[0].removeprefix("tokenize: ").split(" of ")
    assert read == total  # bytes against bytes (was characters against bytes: "50.0 of 52.0 MB ... done")
    assert "shard(s)" in captured.out and "tokenize:" not in captured.out


def test_disk_full_is_one_line_naming_the_file_and_leaves_no_shard_behind(corpus, tmp_path, capsys, monkeypatch):
    import errno
    real_fsync = os.fsync

    def fsync(fd):  # the disk fills while a shard is written (the plan and records still fit)
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial") and ".npy." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(SystemExit) as exit_:
        tokenize_main([*corpus, "--out", str(tmp_path / "s"), "--text-field", "body", "--workers", "1"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 's' / 'part-00000-000.npy'} was not written: the disk is full" in err[0]
    assert "--resume" in err[0]
    assert not list((tmp_path / "s").glob("*.npy*")) and not (tmp_path / "s" / "manifest.json").exists()


def test_token_file_of_another_tokenizer_is_refused_as_a_shard_folder_is(corpus, tmp_path):
    """The sidecar's tokenizer identity is compared, not only its vocabulary size (the BPE here is larger)."""
    out = write_token_file(corpus[:1], str(tmp_path / "bytes.npy"))
    bpe = bpe_tokenizer(tmp_path / "bpe.json", "plain text number " * 40)
    with pytest.raises(ValueError, match=r"bytes.npy'? was tokenized with \{'kind': 'bytes'\}.*data.tokenizer"):
        TextDataModule(str(out), tokenizer=bpe)
    TextDataModule(str(out)).setup()  # the tokenizer it was written with reads it


def test_overwritten_token_file_never_pairs_old_tokens_with_a_new_sidecar(corpus, tmp_path, monkeypatch):
    out = write_token_file(corpus[:1], str(tmp_path / "t.npy"))
    old_tokens, sidecar = out.read_bytes(), tmp_path / "t.npy.json"
    bpe = bpe_tokenizer(tmp_path / "bpe.json", "plain text number " * 40)

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")
    with monkeypatch.context() as patch:  # the .npy cannot be finished: the old tokens stay, with no new record
        patch.setattr(files.NpyStream, "finish", full_disk)
        with pytest.raises(OSError):
            write_token_file(corpus[:1], str(out), bpe, overwrite=True)
    assert out.read_bytes() == old_tokens
    assert not sidecar.exists() or json.loads(sidecar.read_text())["tokenizer"] is None
    write_token_file(corpus[:1], str(out), overwrite=True)
    with monkeypatch.context() as patch:  # the new .npy is in place but its record cannot be written
        patch.setattr(files, "write_json", full_disk)
        with pytest.raises(OSError):
            write_token_file(corpus[:1], str(out), bpe, overwrite=True)
    assert out.read_bytes() != old_tokens and not sidecar.exists()  # ids are then checked against the tokenizer
    write_token_file(corpus[:1], str(out), bpe, overwrite=True)
    assert json.loads(sidecar.read_text())["tokenizer"] == bpe and TextDataModule(str(out), tokenizer=bpe)


def test_missing_text_column_and_missing_pyarrow_are_named(corpus, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        tokenize_main([corpus[2], "--out", str(tmp_path / "s"), "--text-field", "content", "--workers", "1"])
    err = capsys.readouterr().err
    assert "no column 'content'" in err and "--text-field" in err and "['body', 'n']" in err
    import sys
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"moe-lightning\[data\]"):
        TextDataModule(corpus[2], text_field="body").setup()


def test_shard_folder_of_another_tokenizer_or_vocabulary_is_refused_before_training(corpus, tmp_path):
    tokenize_to_folder(corpus[:1], str(tmp_path / "bytes"), workers=1)
    bpe = bpe_tokenizer(tmp_path / "bpe.json", "plain text number " * 40)
    with pytest.raises(ValueError, match=r"tokenized with \{'kind': 'bytes'\}.*data.tokenizer"):
        TextDataModule(str(tmp_path / "bytes"), tokenizer=bpe)
    manifest_path = tmp_path / "bytes" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "max_id": 300}))
    with pytest.raises(ValueError, match="token id 300, outside the tokenizer's 257 ids"):
        TextDataModule(str(tmp_path / "bytes"))
    manifest_path.write_text(json.dumps({**manifest, "tokens": 0, "shards": []}))
    with pytest.raises(ValueError, match="lists no tokens"):
        TextDataModule(str(tmp_path / "bytes"))
    manifest_path.write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: not a token-shard manifest"):
        TextDataModule(str(tmp_path / "bytes"))


def test_a_truncated_or_replaced_shard_is_refused_at_start_up_naming_it(corpus, tmp_path):
    """Was: "mmap length is greater than file size" in the middle of training, naming no file."""
    tokenize_to_folder(corpus[:1], str(tmp_path / "s"), workers=1)
    shard = tmp_path / "s" / json.loads((tmp_path / "s" / "manifest.json").read_text())["shards"][0]["file"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)  # a copy cut short, the manifest intact
    with pytest.raises(ValueError, match=rf"shard {shard} holds .* bytes but manifest.json says .* \(truncated"):
        TextDataModule(str(tmp_path / "s"), seq_len=4)
    np.save(shard, np.zeros(10, dtype=np.uint16))
    with pytest.raises(ValueError, match=rf"shard {shard} holds 148 bytes .* \(truncated"):
        TextDataModule(str(tmp_path / "s"), seq_len=4)
