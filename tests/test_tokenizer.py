"""A tokenizers JSON file: a released model's declared end-of-sequence token ends documents; otherwise one id
is added after the vocabulary."""

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")

from moe_lightning.tokenizer import HFTokenizer  # noqa: E402


def word_level_tokenizer(path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_a_declared_eos_token_is_the_end_of_document_id_and_adds_no_row(tmp_path):
    word_level_tokenizer(tmp_path / "tokenizer.json", ["<unk>", "</s>", "hello", "world"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.vocab_size, tok.eos_id) == (4, 1)  # a 4-token model needs 4 embedding rows, not 5
    assert tok.decode(list(tok.encode("hello world")) + [tok.eos_id]) == "hello world"


def test_without_a_declared_eos_one_id_follows_the_vocabulary(tmp_path):
    word_level_tokenizer(tmp_path / "tokenizer.json", ["<unk>", "hello", "world"])
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.vocab_size, tok.eos_id) == (4, 3)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-in-vocab|>"}))
    assert HFTokenizer(str(tmp_path / "tokenizer.json")).eos_id == 3  # a declared token it lacks changes nothing


def test_batch_encoding_gives_the_ids_of_tokenizers_own_encode(tmp_path):
    """The batch path ``tokenize`` uses (offsets skipped where tokenizers can) against tokenizers' plain
    ``Tokenizer.encode`` of each text: a trained byte-level BPE, texts with merges, Unicode, spaces and nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    corpus = open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8").read()
    reference = Tokenizer(models.BPE())
    reference.pre_tokenizer, reference.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), \
        decoders.ByteLevel()
    reference.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    reference.save(str(tmp_path / "bpe.json"))
    texts = [corpus[:5000], "naïve café — 東京 🙂 ", "", "   \n\t ", corpus[-3000:]]
    got = HFTokenizer(str(tmp_path / "bpe.json")).encode_batch(texts)
    want = [reference.encode(text).ids for text in texts]
    assert [ids.tolist() for ids in got] == want and len(want[0]) < 2500  # merges happened: fewer ids than bytes
