"""A tokenizers JSON file: a released model's declared end-of-sequence token ends documents; otherwise one id
is added after the vocabulary."""

import json

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
