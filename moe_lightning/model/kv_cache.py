"""KV cache for generation: what each attention layer keeps per position, preallocated to a capacity (at most
``max_seq_len``; ``generate`` asks for no more than the prompt and the new tokens need).

GQA keeps rotated keys and values (``2 · n_kv_heads · head_dim`` numbers per token and layer); MLA keeps its
normalised compressed latent and the shared rotary key (``kv_lora_rank + qk_rope_head_dim``), the reason MLA
is cheap to serve. With document masking the cache also remembers each position's document.
"""

import torch

from moe_lightning.model.attention import document_ids


class LayerCache:
    """One layer's cached tensors ``[B, T, ...]``; ``append`` writes the new positions and returns all of them."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.buffers: list[torch.Tensor] | None = None

    def append(self, *new_BS: torch.Tensor) -> tuple[torch.Tensor, ...]:
        end = self.length + new_BS[0].shape[1]  # MoETransformer.forward checks it fits
        if self.buffers is None:
            self.buffers = [t.new_empty(t.shape[0], self.capacity, *t.shape[2:]) for t in new_BS]
        for buffer, t in zip(self.buffers, new_BS):
            buffer[:, self.length:end] = t
        self.length = end
        return tuple(buffer[:, :end] for buffer in self.buffers)


class KVCache:
    """Per-layer caches of one batch of sequences, plus their document ids when documents are masked."""

    def __init__(self, n_layers: int, capacity: int):
        self.capacity = capacity
        self.layers = [LayerCache(capacity) for _ in range(n_layers)]
        self.doc_ids_BT: torch.Tensor | None = None
        self.eods_B: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions cached so far (the next token's position)."""
        return self.layers[0].length

    def document_ids(self, tokens_BS: torch.Tensor, eod_token_id: int) -> torch.Tensor:
        """Record the new tokens' documents; returns the ids of every cached position plus the new ones."""
        start, end = self.length, self.length + tokens_BS.shape[1]
        if self.doc_ids_BT is None:
            self.doc_ids_BT = tokens_BS.new_zeros(tokens_BS.shape[0], self.capacity)
            self.eods_B = tokens_BS.new_zeros(tokens_BS.shape[0])
        self.doc_ids_BT[:, start:end] = document_ids(tokens_BS, eod_token_id, self.eods_B)
        self.eods_B += (tokens_BS == eod_token_id).sum(1)
        return self.doc_ids_BT[:, :end]
