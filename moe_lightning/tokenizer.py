"""Tokenizers: byte-level by default (nothing to download), a ``tokenizers`` JSON file as an option."""

import hashlib
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; token 256 separates documents."""

    vocab_size = 257
    eos_id = 256

    def spec(self) -> dict:
        return {"kind": "bytes"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A trained ``tokenizers`` JSON file (install the ``tokenizers`` extra)."""

    def __init__(self, path: str, content: str | None = None):
        """``content`` (the JSON text, as recorded in a checkpoint) wins over reading ``path``."""
        if content is None and not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer={path!r}: no such file; pass a tokenizers JSON file or omit it "
                                    "for the byte-level tokenizer.")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError("tokenizer: a JSON tokenizer needs `pip install tokenizers`.") from err
        self.path = path
        self.content = Path(path).read_text(encoding="utf-8") if content is None else content
        self._tok = Tokenizer.from_str(self.content)
        self.vocab_size = self._tok.get_vocab_size() + 1
        self.eos_id = self.vocab_size - 1

    def spec(self) -> dict:
        """The whole JSON travels with the checkpoint: generation works where the file is gone."""
        return {"kind": "tokenizers", "path": self.path, "json": self.content,
                "sha256": hashlib.sha256(self.content.encode("utf-8")).hexdigest()}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eos_id])

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


def tokenizer_from_spec(spec: dict):
    """Rebuild the tokenizer a checkpoint recorded with ``tokenizer.spec()``."""
    if spec.get("kind") == "bytes":
        return ByteTokenizer()
    if spec.get("kind") == "tokenizers":
        return HFTokenizer(spec["path"], content=spec["json"])
    raise ValueError(f"tokenizer spec {spec!r}: unknown kind (expected 'bytes' or 'tokenizers').")
