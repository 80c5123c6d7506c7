"""``tokenizer.json`` + ``tokenizer_config.json`` for a Hugging Face export, from the tokenizer a run recorded.

The byte tokenizer (ids 0..255 are the UTF-8 bytes, 256 ends a document) is written as a ``tokenizers`` byte-level
BPE with no merges: the ``ByteLevel`` pre-tokenizer turns every byte into one printable character, each character
is its own token, and the vocabulary maps the character of byte ``b`` to id ``b``; the end-of-document token is a
special token with id 256. ``tokenizers``, ``transformers.AutoTokenizer`` and ``moe-lightning generate`` then read
the same ids as the model was trained on. Written as JSON here, so exporting needs no ``tokenizers`` install.
"""

import json

EOD_TOKEN = "<|endoftext|>"


def byte_characters() -> list[str]:
    """The character ``ByteLevel`` uses for each byte 0..255 (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the others (controls, space, DEL, the no-break and soft hyphens) take code points 256, 257, ...
    in byte order, so no token is whitespace or invisible."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _special(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def byte_tokenizer_json() -> str:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [_special(256, EOD_TOKEN)],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {char: b for b, char in enumerate(byte_characters())}, "merges": []}}, ensure_ascii=False)


def _with_eod_token(content: str) -> tuple[str, str]:
    """A trained tokenizer without an end-of-sequence token: the run used one more id after its vocabulary
    (``HFTokenizer``), which becomes a special token here so the exported files name it."""
    tokenizer = json.loads(content)
    vocab = tokenizer.get("model", {}).get("vocab", {})
    taken = {t["content"] for t in tokenizer.get("added_tokens", [])} | set(vocab if isinstance(vocab, dict) else ())
    ids = [t["id"] for t in tokenizer.get("added_tokens", [])]
    ids += list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
    name = next(n for n in (EOD_TOKEN, "<|moe_eod|>", "<|moe_eod_0|>", "<|moe_eod_1|>") if n not in taken)
    tokenizer.setdefault("added_tokens", []).append(_special(max(ids, default=-1) + 1, name))
    return json.dumps(tokenizer, ensure_ascii=False), name


def tokenizer_files(spec: dict, model_max_length: int) -> dict[str, str]:
    """File name -> text, for the tokenizer ``spec`` a checkpoint recorded (``tokenizer.spec()``)."""
    if spec.get("kind") == "bytes":
        content, eos = byte_tokenizer_json(), EOD_TOKEN
    elif spec.get("kind") == "tokenizers":
        content, eos = (spec["json"], spec["eos_token"]) if spec.get("eos_token") else _with_eod_token(spec["json"])
    else:
        raise ValueError(f"tokenizer spec kind {spec.get('kind')!r}: expected 'bytes' or 'tokenizers'.")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": content, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
