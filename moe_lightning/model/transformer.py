"""The decoder-only MoE transformer, readable top to bottom. No distributed code lives here."""

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moe_lightning.model.attention import DocumentMask, GroupedQueryAttention, SequenceShard, document_ids
from moe_lightning.model.config import MoEConfig
from moe_lightning.model.kv_cache import KVCache
from moe_lightning.model.layers import OutputHead, RMSNorm, SwiGLU
from moe_lightning.model.mla import MultiHeadLatentAttention
from moe_lightning.model.moe import MoELayer
from moe_lightning.model.mtp import MTPModule
from moe_lightning.model.rotary import Rotary


def build_attention(config: MoEConfig) -> nn.Module:
    return MultiHeadLatentAttention(config) if config.attention == "mla" else GroupedQueryAttention(config)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; FFN dense or MoE."""

    def __init__(self, config: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = build_attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.is_moe = config.is_moe_layer(layer_id)
        self.ffn = MoELayer(config) if self.is_moe else SwiGLU(config.dim, config.ffn_hidden)

    def forward(self, x_BSD: torch.Tensor, sequence_shard: SequenceShard | None = None,
                **attention_kwargs) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), sequence_shard=sequence_shard, **attention_kwargs)
        ffn_in_BSD = self.ffn_norm(h_BSD)
        return h_BSD + (self.ffn(ffn_in_BSD, sequence_shard) if self.is_moe else self.ffn(ffn_in_BSD))


class MoETransformer(nn.Module):
    """Embedding → ``layers`` (the repeated blocks every plug-in wraps) → final norm → output head; with
    ``config.mtp_layers``, the multi-token prediction modules ``mtp`` (training only, see ``model/mtp.py``).

    ``sequence_shard`` is the context-parallel seam (``attention.SequenceShard``): one rank, the whole sequence,
    by default; a strategy may replace it so that this rank computes only some positions of each sequence."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary = Rotary(config, config.qk_rope_head_dim if config.attention == "mla" else config.head_dim)
        self.output = OutputHead(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.sequence_shard = SequenceShard()
        # each module's block is shaped like the last layer (dense or MoE); built last, so models without
        # multi-token prediction draw the same initial weights as before it existed
        self.mtp = nn.ModuleList(MTPModule(config, Block(config, config.n_layers - 1))
                                 for _ in range(config.mtp_layers))
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    def forward(self, tokens_BS: torch.Tensor, *, cache: KVCache | None = None,
                return_hidden: bool = False, mtp: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Logits ``[B, S, V]``, or with ``return_hidden`` the final-normed hidden states ``[B, S, D]`` (for a
        loss that applies the head itself: ``self.output.cross_entropy``). With ``cache`` the tokens continue the
        cached positions, which it then holds. With ``mtp`` (training, no cache): the hidden states of every
        depth, ``[h^0 [B, S, D], h^1 [B, S-1, D], ..., h^D [B, S-D, D]]`` (``h^0`` the main model's; see
        ``model/mtp.py``), each ready for the shared output head (under a shard: this rank's positions of each).

        Under a context-parallel ``sequence_shard``, ``tokens_BS`` is the whole sequence (on every rank of its
        group) and the result covers this rank's positions only, ``[B, S / size, ...]`` (the targets to compare
        it with: ``sequence_shard.local(targets_BS)``); rotary positions, document ids and the mask stay the
        whole sequence's.

        What every block shares is built here once, outside the blocks (a compiled block only reads it): the
        rotary tables and the attention mask (with FlexAttention, its block mask)."""
        B, S = tokens_BS.shape
        if mtp and (cache is not None or S <= len(self.mtp)):
            raise ValueError(f"multi-token prediction runs in training only, without a KV cache, on more than "
                             f"mtp_layers={len(self.mtp)} tokens; got cache={cache is not None}, {S} tokens.")
        positions_S = self.sequence_shard.positions(S, tokens_BS.device)
        if positions_S is not None and cache is not None:
            raise ValueError(f"context parallelism (sequence_shard over {self.sequence_shard.size} ranks) shards "
                             "training forwards; got a KV cache: generate on one rank.")
        start = 0 if cache is None else cache.length
        if cache is not None and start + S > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; {start} are cached and {S} more were "
                             f"given: start a new cache from the latest tokens.")
        if mtp and positions_S is not None:  # one call of the embedding: this rank's tokens, and each depth's
            shifted_S = [self.sequence_shard.truncated(S, S - k).positions(S - k, tokens_BS.device) + k
                         for k in range(1, len(self.mtp) + 1)]
            emb_BXD = self.tok_embeddings(tokens_BS[:, torch.cat([positions_S, *shifted_S])])
            emb_BSD, *shifted_emb = emb_BXD.split([len(positions_S), *map(len, shifted_S)], dim=1)
            h_BSD = emb_BSD
        else:
            emb_BSD = h_BSD = self.tok_embeddings(self.sequence_shard.local(tokens_BS))
            shifted_emb = None
        mask = None
        if self.config.document_masking:
            eod = self.config.eod_token_id
            mask = DocumentMask(document_ids(tokens_BS, eod) if cache is None else cache.document_ids(tokens_BS, eod),
                                q_len=S, q_positions_S=positions_S)
        elif start > 0 and S > 1:  # several queries after cached keys: causal offset mask, one document
            mask = DocumentMask(tokens_BS.new_zeros(B, start + S), q_len=S)
        elif positions_S is not None:  # a shard's queries against every key: causal at their global positions
            mask = DocumentMask(tokens_BS.new_zeros(B, S), q_positions_S=positions_S)
        if positions_S is None:
            cos_sin, shard = self.rotary.cos_sin(start, S, device=tokens_BS.device), None
        else:
            cos_sin, shard = self.rotary.cos_sin_at(positions_S), self.sequence_shard
        for i, layer in enumerate(self.layers):
            h_BSD = layer(h_BSD, mask=mask, cache=None if cache is None else cache.layers[i], cos_sin=cos_sin,
                          sequence_shard=shard)
        h_BSD = self.norm(h_BSD)
        if mtp:
            return self._multi_token_hidden(tokens_BS, emb_BSD, h_BSD, shifted_emb, mask)
        return h_BSD if return_hidden else self.output(h_BSD)

    def _multi_token_hidden(self, tokens_BS: torch.Tensor, emb_BSD: torch.Tensor, h_BSD: torch.Tensor,
                            shifted_emb: list[torch.Tensor] | None, mask: DocumentMask | None) -> list[torch.Tensor]:
        """``[h^0, ..., h^D]``: depth k pairs ``h^{k-1}`` at positions ``0..S-k-1`` with the embeddings of
        ``t[k..S-1]``; its blocks attend causally (within documents) over those ``S - k`` positions, through the
        main forward's ``mask`` of all ``S`` (its first ``S - k``: on CUDA FlexAttention keeps one shape and
        layout, so no depth recompiles its kernel or builds a mask of its own; without document masking SDPA's
        causal kernel runs, or with QK-clip a causal FlexAttention rounded up to 128-row blocks).

        Under a context-parallel shard each depth keeps this rank's positions below ``S - k`` (the first rows of
        its ``h^{k-1}``: the positions cut off are its largest) and the shard of the first ``S - k`` positions
        exchanges the key side (``SequenceShard.truncated``); ``shifted_emb[k - 1]``: the embeddings of the tokens
        k ahead of those positions."""
        B, S = tokens_BS.shape
        doc_BS = None  # a shard's depths build their masks (of their own length) from the sequence's document ids
        if self.sequence_shard.size > 1:
            doc_BS = document_ids(tokens_BS, self.config.eod_token_id) if self.config.document_masking \
                else tokens_BS.new_zeros(B, S)
        hidden = [h_BSD]
        for k, module in enumerate(self.mtp, start=1):
            n = S - k
            shard = self.sequence_shard.truncated(S, n)
            positions_S = shard.positions(n, tokens_BS.device)
            if positions_S is None:
                hidden.append(module(hidden[-1][:, :n], emb_BSD[:, k:], mask=mask, cache=None,
                                     cos_sin=self.rotary.cos_sin(0, n, device=tokens_BS.device)))
                continue
            hidden.append(module(hidden[-1][:, :len(positions_S)], shifted_emb[k - 1],
                                 mask=DocumentMask(doc_BS[:, :n], q_positions_S=positions_S), cache=None,
                                 cos_sin=self.rotary.cos_sin_at(positions_S), sequence_shard=shard))
        return hidden

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer; called after materialising from the meta device. A part set
        to None (the embedding, final norm or head of a model cut to some of its blocks) is skipped."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.config.tie_embeddings else std)
        for block in self.layers:
            block.attention_norm.init_weights()
            block.ffn_norm.init_weights()
            block.attention.init_weights(std, out_std)
            block.ffn.init_weights(std, out_std)
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not self.config.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.config.dim ** -0.5)
        for module in self.mtp:
            module.init_weights(std, out_std)

    def local_targets(self, targets_BS: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The targets of the positions ``forward(return_hidden=True)`` returns for a ``seq_len``-token input: all of
        them on one rank; under a sequence shard this rank's share (of the first ``targets_BS.shape[1]`` positions
        for a multi-token prediction depth)."""
        return self.sequence_shard.truncated(seq_len, targets_BS.shape[1]).local(targets_BS)

    def moe_layers(self) -> list[MoELayer]:
        """Every MoE layer, the multi-token prediction blocks' last (they route, count and balance alike)."""
        blocks = [*self.layers, *(module.block for module in self.mtp)]
        return [block.ffn for block in blocks if block.is_moe]

    def num_parameters(self, active: bool = False) -> int:
        """Total parameters, or those one token touches (routed experts scaled by top_k/num_experts)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        routed = sum(p.numel() for moe in self.moe_layers() for p in moe.experts.parameters())
        return total - routed + routed * self.config.top_k // self.config.num_experts

    @torch.no_grad()
    def generate(self, tokens_BS: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None, *, top_p: float | None = None,
                 stop_token: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """Prompt and continuation ``[B, S + new]`` (see ``generate_stream``; fewer new tokens if all rows stop).

        The model sees at most ``max_seq_len`` tokens: a longer prompt is cut to its newest ``max_seq_len``, and
        with the KV cache, once prompt + generated tokens pass ``max_seq_len`` generation restarts from the
        newest ``max_seq_len // 2`` tokens (everything older is forgotten), then again each time it fills.
        """
        new = list(self.generate_stream(tokens_BS, max_new_tokens, temperature, top_k, generator, top_p=top_p,
                                        stop_token=stop_token, use_cache=use_cache))
        return torch.cat([tokens_BS, *(next_B[:, None].to(tokens_BS.dtype) for next_B in new)], dim=1)

    @torch.no_grad()
    def generate_stream(self, tokens_BS: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, generator: torch.Generator | None = None, *,
                        top_p: float | None = None, stop_token: int | None = None,
                        use_cache: bool = True) -> Iterator[torch.Tensor]:
        """Yield each next token ``[B]`` as it is sampled (``temperature <= 0``: greedy).

        The model sees at most ``max_seq_len`` tokens. With the KV cache (default) each step feeds one token;
        when the cache is full it is rebuilt from the newest ``max_seq_len // 2`` tokens (one prefill per
        that many steps). Without it every step recomputes the last ``max_seq_len`` tokens. A row that
        produced ``stop_token`` repeats it; the stream ends once every row has.
        """
        check_sampling(max_new_tokens, top_k, top_p)
        window = self.config.max_seq_len
        context_BS = tokens_BS[:, -window:]
        pending_BS = context_BS
        # the last sampled token is never fed: a cache holds at most prompt + max_new_tokens - 1 positions
        cache = KVCache(len(self.layers), min(window, context_BS.shape[1] + max_new_tokens - 1)) if use_cache else None
        stopped_B = torch.zeros(tokens_BS.shape[0], dtype=torch.bool, device=tokens_BS.device)
        for _ in range(max_new_tokens):
            if cache is not None and cache.length + pending_BS.shape[1] > cache.capacity:  # only when it is full
                cache, pending_BS = KVCache(len(self.layers), window), context_BS[:, -max(window // 2, 1):]
            # the head runs on the last position only: prefill never builds [B, S, V] logits
            h_BSD = self(context_BS if cache is None else pending_BS, cache=cache, return_hidden=True)
            logits_BV = self.output(h_BSD[:, -1])
            next_B = sample_next(logits_BV.float(), temperature, top_k, top_p, generator)
            if stop_token is not None:
                next_B = next_B.masked_fill(stopped_B, stop_token)
                stopped_B |= next_B == stop_token
            yield next_B
            if stop_token is not None and bool(stopped_B.all()):
                return
            pending_BS = next_B[:, None].to(tokens_BS.dtype)
            context_BS = torch.cat([context_BS, pending_BS], dim=1)[:, -window:]


def check_sampling(max_new_tokens: int, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}: must be a positive integer, or None to keep every token.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1], or None to keep every token.")


def sample_next(logits_BV: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ``[B]``: argmax at ``temperature <= 0``, else sampled from the top-k, then top-p (nucleus) set."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth_B1 = logits_BV.topk(min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None:
        sorted_BV, order_BV = logits_BV.sort(-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        outside_BV = probs_BV.cumsum(-1) - probs_BV >= top_p  # mass before a token already reaches top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(outside_BV, float("-inf")))
    return torch.multinomial(F.softmax(logits_BV, -1), 1, generator=generator)[:, 0]
