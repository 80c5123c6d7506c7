"""Tokenizers: byte-level by default (nothing to download), a ``tokenizers`` JSON file as an option."""

import hashlib
import json
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; token 256 separates documents."""

    vocab_size = 257
    eos_id = 256
    document_start = document_end = ()  # no special tokens around a document

    def spec(self) -> dict:
        return {"kind": "bytes"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A trained ``tokenizers`` JSON file (install the ``tokenizers`` extra)."""

    def __init__(self, path: str, content: str | None = None, eos_token: str | None = None):
        """``content`` and ``eos_token`` (as a checkpoint recorded them) stand in for the files."""
        if content is None and not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer={path!r}: no such file; pass a tokenizers JSON file or omit it "
                                    "for the byte-level tokenizer.")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError("tokenizer: a JSON tokenizer needs `pip install tokenizers`.") from err
        self.path = path
        self.content = Path(path).read_text(encoding="utf-8") if content is None else content
        self.eos_token = _declared_eos_token(Path(path)) if content is None else eos_token
        self.sha256 = hashlib.sha256(self.content.encode("utf-8")).hexdigest()  # once: spec() runs at every save
        self._tok = Tokenizer.from_str(self.content)
        # a released tokenizer.json may carry truncation or padding for its model's inputs: a corpus wants every id
        # of every text (truncation dropped tokens; padding made a batch's ids differ from one text's)
        self._tok.no_truncation()
        self._tok.no_padding()
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is not None:  # a released model's tokenizer: its own end-of-sequence token ends documents
            self.vocab_size, self.eos_id = self._tok.get_vocab_size(), eos_id
        else:  # a tokenizer trained without one: one more id, after the vocabulary
            self.vocab_size = self._tok.get_vocab_size() + 1
            self.eos_id = self.vocab_size - 1
        self.document_start, self.document_end = self._specials_around_a_text()

    def _specials_around_a_text(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text (a Llama-style BOS; BERT's [CLS] and [SEP]):
        ``tokenize`` encodes a long document in pieces, so it adds them once a document, not once a piece. Found
        by post-processing a probe's ids (the first of "a", "0" or a vocabulary entry that has any) and reading
        which ids the post-processor added (``special_tokens_mask``: right for every kind and sequence of
        post-processors, where ``sequence_ids`` is not). An end-of-sequence id at the end is left out:
        ``tokenize`` ends every document with ``eos_id``."""
        bare = None
        for probe in ("a", "0", *(self._tok.id_to_token(i) or "" for i in range(min(self._tok.get_vocab_size(), 99)))):
            try:
                bare = self._tok.encode(probe, add_special_tokens=False)
            except Exception:  # a word-level model without an unknown token refuses words it lacks
                continue
            if bare.ids:
                break
        if bare is None or not bare.ids:  # no text encodes to any id: nothing to put around one
            return (), ()
        full = self._tok.post_process(bare)
        text = [i for i, added in enumerate(full.special_tokens_mask) if not added]
        before, after = full.ids[:text[0]], full.ids[text[-1] + 1:]
        if after and after[-1] == self.eos_id:
            after = after[:-1]
        return tuple(before), tuple(after)

    def spec(self) -> dict:
        """The whole JSON travels with the checkpoint: generation works where the files are gone."""
        return {"kind": "tokenizers", "path": self.path, "json": self.content, "eos_token": self.eos_token,
                "sha256": self.sha256}

    def encode(self, text: str) -> np.ndarray:
        """``text`` as a document begins (a prompt): ``document_start``, then the text's own ids; no end tokens,
        since the document goes on."""
        return np.asarray([*self.document_start, *self.encode_batch([text])[0]], dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text without the post-processor's special tokens (``document_start`` and
        ``document_end`` hold them), one call into Rust per batch: ``encode_batch_fast`` (tokenizers >= 0.20)
        skips the character offsets that ids never need (an 8k BPE encoded about 1.5x as fast:
        benchmarks/data_scale.py)."""
        encode = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eos_id])


def _declared_eos_token(path: Path) -> str | None:
    """The ``eos_token`` that a Hugging Face model directory declares beside its ``tokenizer.json``
    (``tokenizer_config.json``, a string or ``{"content": ...}``); ``None`` if there is none."""
    config = path.with_name("tokenizer_config.json")
    if not config.is_file():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def tokenizer_identity(spec: dict) -> dict:
    """What makes two tokenizers alike, from their ``spec()``: the same ids for the same text and the same
    end-of-document id. The kind, and for a ``tokenizers`` JSON its content hash and EOS token (not its path).
    Token manifests record it; checkpoints are compared with it."""
    if spec.get("kind") != "tokenizers":
        return {"kind": spec.get("kind", "bytes")}
    sha256 = spec.get("sha256") or hashlib.sha256(spec["json"].encode("utf-8")).hexdigest()
    return {"kind": "tokenizers", "sha256": sha256, "eos_token": spec.get("eos_token")}


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


def tokenizer_from_spec(spec: dict):
    """Rebuild the tokenizer a checkpoint recorded with ``tokenizer.spec()``."""
    if spec.get("kind") == "bytes":
        return ByteTokenizer()
    if spec.get("kind") == "tokenizers":
        return HFTokenizer(spec["path"], content=spec["json"], eos_token=spec.get("eos_token"))
    raise ValueError(f"tokenizer spec {spec!r}: unknown kind (expected 'bytes' or 'tokenizers').")
