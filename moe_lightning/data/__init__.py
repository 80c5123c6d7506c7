"""Data: sources → token shards and manifest → sequences, mixture and resumable samplers → ``TextDataModule``.

- ``sources``: what ``data.source`` names (text, JSONL, Parquet/Arrow, token files), no Lightning;
- ``tokenize/``: ``moe-lightning tokenize``, a corpus into ``.npy`` shards and a manifest, on every core;
- ``tokens``: token files and shard folders read lazily (memory-mapped, never concatenated);
- ``sampling``: sequences, the train/validation split, the shuffled and weighted-mixture orders;
- ``module``: ``TextDataModule``, the face users name in YAML (the only part that imports Lightning).

Names are imported on first use, so ``moe-lightning tokenize`` loads neither torch nor Lightning.
"""

import importlib

_WHERE = {
    "TextDataModule": "module", "ResumableLoader": "module",
    "ResumableSampler": "sampling", "MixtureSampler": "sampling", "MixtureSequences": "sampling",
    "PackedSequences": "sampling", "split_indices": "sampling", "interleave_pattern": "sampling",
    "resolve_source": "sources", "stdlib_files": "sources", "parse_sources": "sources",
    "TokenStream": "tokens", "open_token_file": "tokens",
    "write_token_file": "tokenize.files", "tokenize_to_folder": "tokenize.folder", "tokenize_main": "tokenize.command",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
