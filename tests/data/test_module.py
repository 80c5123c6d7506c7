"""Data: sources, packing, the deterministic split, memory-mapped token files, clear errors."""

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from moe_lightning.data import TextDataModule, split_indices, stdlib_files, write_token_file
from moe_lightning.data.tokenizer import ByteTokenizer


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("hello world " * 40)
    (folder / "sub" / "b.md").write_text("second document " * 30)
    (folder / "image.png").write_bytes(b"\x89PNG not text")
    return folder


def test_stdlib_source_is_found_without_installed_packages():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "argparse.py", "__init__.py"} <= names
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files)


def test_packing_makes_shifted_windows_separated_by_end_of_document(corpus):
    dm = TextDataModule(str(corpus), seq_len=16, batch_size=2, val_fraction=0.25)
    dm.setup()
    tokens = dm.train_set.tokens[:]
    expected = np.concatenate([
        np.append(np.frombuffer(b"hello world " * 40, np.uint8), ByteTokenizer.eos_id),
        np.append(np.frombuffer(b"second document " * 30, np.uint8), ByteTokenizer.eos_id)])
    np.testing.assert_array_equal(tokens, expected)  # png skipped, files in sorted order
    sequence = dm.train_set[1]
    index = dm.train_set.indices[1]
    assert sequence.shape == (17,)
    assert torch.equal(sequence, torch.from_numpy(expected[index * 16: index * 16 + 17].astype(np.int64)))


def test_split_is_deterministic_disjoint_and_complete():
    train, val = (np.asarray(part) for part in split_indices(1000, 0.05))
    train2, val2 = (np.asarray(part) for part in split_indices(1000, 0.05))
    assert np.array_equal(train, train2) and np.array_equal(val, val2)
    assert len(val) == 50 and not set(train) & set(val) and len(train) + len(val) == 1000
    assert val.min() < 100 and val.max() > 900  # spread over the corpus, not a tail


def test_distributed_sampler_gives_each_rank_different_sequences():
    dm = TextDataModule("stdlib", seq_len=64, max_tokens=64 * 200)
    dm.setup()
    per_rank = [set(DistributedSampler(dm.train_set, num_replicas=2, rank=r, shuffle=True, seed=0))
                for r in range(2)]
    assert not per_rank[0] & per_rank[1]
    assert len(per_rank[0] | per_rank[1]) == len(dm.train_set)


def test_jsonl_source_reads_the_text_field_and_names_a_missing_one(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": "x" * 50, "id": i}) for i in range(10)))
    dm = TextDataModule(str(path), seq_len=8, text_field="body")
    dm.setup()
    assert len(dm.train_set.tokens) == 10 * 51
    with pytest.raises(KeyError, match="data.text_field"):
        TextDataModule(str(path), seq_len=8).setup()


def test_token_file_round_trip_matches_text_and_is_memory_mapped(corpus, tmp_path):
    out = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"))
    from_file = TextDataModule(str(out), seq_len=16)
    from_text = TextDataModule(str(corpus), seq_len=16)
    from_file.setup(), from_text.setup()
    assert isinstance(from_file.train_set.tokens.parts[0].array(), np.memmap)
    np.testing.assert_array_equal(from_file.train_set.tokens[:], from_text.train_set.tokens[:])
    assert torch.equal(from_file.val_set[0], from_text.val_set[0])


def test_token_file_is_never_overwritten_without_asking(corpus, tmp_path):
    out = tmp_path / "tokens.npy"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_token_file([str(corpus)], str(out))
    assert out.read_bytes() == b"precious"


def test_tokenize_command_writes_a_token_file(corpus, tmp_path, capsys):
    from moe_lightning.commands.main import run
    run(["tokenize", str(corpus), "--out", str(tmp_path / "t.npy")])
    assert "wrote 962 tokens" in capsys.readouterr().out
    assert np.load(tmp_path / "t.npy").dtype == np.uint16


def test_missing_source_fails_at_construction_naming_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.source"):
        TextDataModule(str(tmp_path / "nope"))


def test_empty_source_fails_with_a_fix(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="fewer than two sequences"):
        TextDataModule(str(tmp_path / "empty.txt")).setup()
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        TextDataModule(str(tmp_path / "folder"))


@pytest.mark.parametrize("kwargs, field", [({"seq_len": 0}, "seq_len"), ({"val_fraction": 0.9}, "val_fraction")])
def test_bad_data_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"data.{field}"):
        TextDataModule("stdlib", **kwargs)


def test_token_file_from_another_vocabulary_is_refused(corpus, tmp_path):
    out = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"))
    (tmp_path / "tokens.npy.json").write_text(json.dumps({"vocab_size": 50000, "tokenizer": "big.json"}))
    with pytest.raises(ValueError, match="data.tokenizer"):
        TextDataModule(str(out), seq_len=16).setup()
    np.save(tmp_path / "foreign.npy", np.array([1, 2, 70000], dtype=np.uint32))  # no info file: ids are checked
    with pytest.raises(ValueError, match="70001-token vocabulary"):
        TextDataModule(str(tmp_path / "foreign.npy"), seq_len=1).setup()


@pytest.fixture
def lightning_log():
    """Messages of Lightning's logger (which does not propagate to the root logger)."""
    import logging
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    yield messages
    logging.getLogger("lightning.pytorch").removeHandler(handler)


def test_binary_file_source_is_refused_at_construction(tmp_path):
    binary = tmp_path / "ls"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 4)  # like /bin/ls
    with pytest.raises(ValueError, match=r"data.source=.*ls' is a binary file"):
        TextDataModule(str(binary))


def test_folder_names_each_skipped_file_and_why_and_the_summary_counts_what_was_read(corpus, lightning_log):
    (corpus / "model.bin.txt").write_bytes(b"weights\x00\x01\x02")  # a text suffix, binary content
    dm = TextDataModule(str(corpus), seq_len=16, batch_size=2, val_fraction=0.25)
    skipped = next(m for m in lightning_log if "skipped" in m)
    assert "skipped 2 file(s)" in skipped
    assert "image.png (suffix '.png' not read)" in skipped and "model.bin.txt (binary)" in skipped
    dm.setup()
    num_sequences = (962 - 1) // 16  # a.txt and b.md: 480 + 1 and 480 + 1 tokens
    assert (f"data: 2 file(s), 962 tokens -> {len(dm.train_set)} train / {len(dm.val_set)} validation sequences "
            "of 16 tokens") in lightning_log
    assert len(dm.train_set) + len(dm.val_set) == num_sequences


@pytest.mark.parametrize("array, message", [
    (np.array([1.0, 2.0, 3.0], dtype=np.float32), "holds a float32 array"),
    (np.array([[1, 2], [3, 4]], dtype=np.int64), r"shape \(2, 2\)"),
    (np.array([5, -3, 7], dtype=np.int32), r"negative token ids \(min -3\)"),
])
def test_token_file_of_wrong_dtype_shape_or_negative_ids_is_refused(tmp_path, array, message):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(ValueError, match=message):
        TextDataModule(str(tmp_path / "bad.npy"), seq_len=1).setup()


def test_jsonl_decode_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:3: not valid JSON"):
        TextDataModule(str(path), seq_len=4).setup()
    path.write_text('{"text": "fine"}\n["a", "list"]\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:2: a JSON list, not an object"):
        TextDataModule(str(path), seq_len=4).setup()


def fit_until_data_check(dm):
    """``Trainer.fit`` up to the DataModule's setup; the model is never built when the data is refused."""
    import lightning as L
    from moe_lightning import MoEConfig, MoELanguageModel

    module = MoELanguageModel(MoEConfig(vocab_size=260, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                        ffn_hidden=64, num_experts=2, top_k=1, expert_hidden=32))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    return module


def test_dataset_too_small_for_one_batch_is_refused_before_the_model_is_built(corpus):
    """Lightning used to print "No training batches" and exit 0."""
    dm = TextDataModule(str(corpus), seq_len=16, batch_size=64, val_fraction=0.25)
    with pytest.raises(ValueError, match=r"45 training sequences .* make no batch of data.batch_size=64"):
        fit_until_data_check(dm)


def test_no_validation_sequence_is_refused_while_validation_is_on(tmp_path):
    (tmp_path / "short.txt").write_text("x" * 200)  # 12 sequences of 16; every 20th held out: none
    with pytest.raises(ValueError, match="no validation sequence.*limit_val_batches=0"):
        fit_until_data_check(TextDataModule(str(tmp_path / "short.txt"), seq_len=16, batch_size=2))


def test_a_list_of_token_files_is_read_as_one_stream_without_concatenating(corpus, tmp_path):
    a = write_token_file([str(corpus / "a.txt")], str(tmp_path / "a.npy"))
    b = write_token_file([str(corpus / "sub")], str(tmp_path / "b.npy"))
    dm = TextDataModule([str(a), str(b)], seq_len=16)
    dm.setup()
    stream = dm.train_set.tokens
    assert [type(p.array()) for p in stream.parts] == [np.memmap, np.memmap]  # both mapped, nothing copied
    joined = np.concatenate([np.load(a), np.load(b)])
    np.testing.assert_array_equal(stream[470:500], joined[470:500])  # a window across the boundary
    assert len(stream) == len(joined)


def test_empty_token_file_is_refused_naming_it(tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"empty.npy' holds no tokens"):
        TextDataModule(str(tmp_path / "empty.npy"))


@pytest.mark.parametrize("sidecar", ["{not json", json.dumps({"tokenizer": None}), json.dumps({"vocab_size": "big"}),
                                     json.dumps([257])])
def test_corrupt_or_keyless_sidecar_is_refused_naming_it(corpus, tmp_path, sidecar):
    out = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"))
    (tmp_path / "tokens.npy.json").write_text(sidecar)
    with pytest.raises(ValueError, match=r"tokens.npy.json: the token file's sidecar is corrupt or lacks 'vocab_size'"):
        TextDataModule(str(out))


def test_sidecar_records_the_largest_id_and_a_larger_one_than_the_vocabulary_is_refused(corpus, tmp_path):
    out = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"))
    info = json.loads((tmp_path / "tokens.npy.json").read_text())
    assert info["max_id"] == 256 and info["vocab_size"] == 257
    (tmp_path / "tokens.npy.json").write_text(json.dumps({**info, "max_id": 257}))
    with pytest.raises(ValueError, match="data.tokenizer"):
        TextDataModule(str(out))


@pytest.mark.parametrize("recorded", ["max_id", "vocabulary only"])
def test_ids_beyond_the_sidecars_vocabulary_are_refused_at_start_up_naming_the_file(corpus, tmp_path, recorded):
    """Issue 33, item 8. The sidecar says a 257-token vocabulary (the byte tokenizer's) while the file holds ids up
    to 299 (a file replaced after tokenize wrote it, or a sidecar without ``max_id``). Before: accepted, and a model
    of vocabulary 320 trained on the foreign ids without a word (only the model's size was ever checked)."""
    out = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"))
    info = json.loads((tmp_path / "tokens.npy.json").read_text())
    ids = np.load(out) % 300
    ids[7] = 299
    np.save(out, ids.astype(np.uint16))
    if recorded == "vocabulary only":
        (tmp_path / "tokens.npy.json").write_text(json.dumps({k: v for k, v in info.items() if k != "max_id"}))
    with pytest.raises(ValueError, match=rf"data.source='{out}' holds token id 299 .*outside the 257-token "
                                         r"vocabulary its sidecar .*tokens.npy.json declares"):
        TextDataModule(str(out), seq_len=16)


def test_ids_beyond_a_manifests_vocabulary_are_refused_naming_the_shard(tmp_path):
    """Issue 33, item 8, for a shard folder: a shard whose ids exceed the manifest's vocabulary (changed after
    tokenize wrote it, same size) is refused at start-up, naming the shard. Before: trained on silently."""
    from moe_lightning.data.tokenize.folder import tokenize_to_folder
    (tmp_path / "a.txt").write_text("some text to tokenize " * 50)
    tokenize_to_folder([str(tmp_path / "a.txt")], str(tmp_path / "shards"), None, "text", 1, 10_000, False, 0, 1)
    [shard] = sorted((tmp_path / "shards").glob("*.npy"))
    ids = np.load(shard)
    ids[3] = 299
    np.save(shard, ids)
    with pytest.raises(ValueError, match=rf"{shard.name} holds token id 299 .*outside the 257-token vocabulary "
                                         r"its manifest"):
        TextDataModule(str(tmp_path / "shards"), seq_len=16)


def test_ids_outside_the_vocabulary_past_the_start_up_scan_are_refused_when_read(tmp_path, monkeypatch):
    from moe_lightning.data import tokens
    monkeypatch.setattr(tokens, "SCAN_TOKENS", 100)  # start-up checks a bounded prefix only
    ids = np.full(1000, 7, dtype=np.uint32)
    ids[500] = 70000
    np.save(tmp_path / "foreign.npy", ids)
    dm = TextDataModule(str(tmp_path / "foreign.npy"), seq_len=10)
    dm.setup()
    dm.train_set.tokens[0:100]  # clean windows read fine
    with pytest.raises(ValueError, match=r"foreign.npy: token ids outside 0..256 near position 4"):
        dm.train_set.tokens[490:510]


def test_max_tokens_must_be_positive():
    with pytest.raises(ValueError, match="data.max_tokens=0"):
        TextDataModule("stdlib", max_tokens=0)
