"""A tokenizers JSON file: a released model's declared end-of-sequence token ends documents; otherwise one id
is added after the vocabulary."""

import json
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")

from moe_lightning.data.tokenizer import HFTokenizer  # noqa: E402


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


def trained_bpe(path, with_bos: bool = False):
    """A byte-level BPE trained on a standard-library module; ``with_bos``: a released model's post-processor
    that starts every text with ``<s>`` (special tokens ``<s>``, ``</s>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    with open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8") as f:
        corpus = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if with_bos:
        tok.add_special_tokens(["<s>", "</s>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
            ("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return tok, corpus


@pytest.mark.parametrize("with_bos", [False, True])
def test_batch_encoding_gives_the_ids_of_tokenizers_own_encode(tmp_path, with_bos):
    """The batch path ``tokenize`` uses (offsets skipped where tokenizers can) against tokenizers' plain
    ``Tokenizer.encode`` of each text: merges, Unicode, spaces, nothing, a special token inside the text. The
    post-processor's special tokens are kept apart (``tokenize`` puts them around a whole document)."""
    reference, corpus = trained_bpe(tmp_path / "bpe.json", with_bos)
    texts = [corpus[:5000], "naïve café — 東京 🙂 ", "", "   \n\t ", corpus[-3000:] + " </s> more"]
    ours = HFTokenizer(str(tmp_path / "bpe.json"))
    bare = [reference.encode(text, add_special_tokens=False).ids for text in texts]
    assert [ids.tolist() for ids in ours.encode_batch(texts)] == bare and len(bare[0]) < 2500  # merges happened
    assert ours.document_start == ((reference.token_to_id("<s>"),) if with_bos else ()) and ours.document_end == ()
    assert [ours.encode(t).tolist() for t in texts] == [list(ours.document_start) + ids for ids in bare]


def test_the_special_tokens_around_a_text_are_found_for_each_kind_of_post_processor(tmp_path):
    """BERT's [CLS] text [SEP], a template adding BOS and EOS (the end-of-sequence id is left to tokenize), a
    template token that is also the probe's own id, RoBERTa's, byte-level only, and sequences of post-processors
    (where ``sequence_ids`` misleads): compared with what ``Tokenizer.encode`` puts around a text.
    A vocabulary without "a" (no unknown token) and a word-level one that refuses unknown words still work."""
    from tokenizers import processors
    reference, _ = trained_bpe(tmp_path / "bpe.json", with_bos=True)
    reference.add_special_tokens(["[CLS]", "[SEP]"])
    ids = {token: reference.token_to_id(token) for token in ("<s>", "</s>", "[CLS]", "[SEP]")}
    cases = {"bert": (processors.BertProcessing(("[SEP]", ids["[SEP]"]), ("[CLS]", ids["[CLS]"])), None,
                      ((ids["[CLS]"],), (ids["[SEP]"],))),
             "bos_eos": (processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
                 ("<s>", ids["<s>"]), ("</s>", ids["</s>"])]), "</s>", ((ids["<s>"],), ()))}
    cases["template_token_also_the_probe"] = (processors.TemplateProcessing(single="a $A", special_tokens=[
        ("a", reference.token_to_id("a"))]), None, ((reference.token_to_id("a"),), ()))
    roberta = processors.RobertaProcessing(("</s>", ids["</s>"]), ("<s>", ids["<s>"]))
    cases["roberta"] = (roberta, None, ((ids["<s>"],), (ids["</s>"],)))
    cases["byte_level_only"] = (processors.ByteLevel(trim_offsets=True), None, ((), ()))
    cases["sequence_bert_byte_level"] = (processors.Sequence([cases["bert"][0], processors.ByteLevel()]), None,
                                         cases["bert"][2])
    cases["sequence_template_byte_level"] = (processors.Sequence([processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])]),
        processors.ByteLevel(trim_offsets=True)]), None, ((ids["<s>"],), (ids["</s>"],)))
    for name, (processor, eos, expected) in cases.items():
        reference.post_processor = processor
        reference.save(str(tmp_path / f"{name}.json"))
        ours = HFTokenizer(str(tmp_path / f"{name}.json"), content=(tmp_path / f"{name}.json").read_text(),
                           eos_token=eos)
        assert (ours.document_start, ours.document_end) == expected, name
        full, bare = reference.encode("some words").ids, reference.encode("some words", add_special_tokens=False).ids
        assert full == [*ours.document_start, *bare, *ours.document_end, *([ours.eos_id] if eos else [])], name


def test_truncation_or_padding_saved_in_the_tokenizer_file_changes_no_id(tmp_path):
    """A released tokenizer.json may carry its model's input settings: every id of every text is still written,
    whatever the batch holds."""
    reference, corpus = trained_bpe(tmp_path / "bpe.json")
    want = [reference.encode(text).ids for text in (corpus[:3000], "short", corpus[5000:9000])]
    reference.enable_truncation(max_length=8)
    reference.enable_padding(pad_id=0, pad_token="!")
    reference.save(str(tmp_path / "configured.json"))
    ours = HFTokenizer(str(tmp_path / "configured.json"))
    got = ours.encode_batch([corpus[:3000], "short", corpus[5000:9000]])
    assert [ids.tolist() for ids in got] == want and len(want[0]) > 100


def test_the_special_tokens_are_found_whatever_the_vocabulary_lacks(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    bpe = Tokenizer(models.BPE(vocab={"b": 0, "[CLS]": 1, "[SEP]": 2}, merges=[]))  # "a" encodes to nothing
    words = Tokenizer(models.WordLevel({"b": 0, "[CLS]": 1, "[SEP]": 2}, unk_token="[UNK]"))  # "a" raises
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    for name, tok in {"bpe": bpe, "words": words}.items():
        tok.add_special_tokens(["[CLS]", "[SEP]"])
        tok.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
        tok.save(str(tmp_path / f"{name}.json"))
        ours = HFTokenizer(str(tmp_path / f"{name}.json"))
        assert (ours.document_start, ours.document_end) == ((1,), (2,)) and tok.encode("b").ids == [1, 0, 2], name
        assert ours.encode("b").tolist() == [1, 0], name  # a prompt: the document begins and goes on
