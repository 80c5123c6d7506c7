"""Causal grouped-query attention with rotary position embeddings, and the one kernel choice all attention shares.

Document masking (packed sequences): token ``i`` belongs to document ``#EODs strictly before i``, so an
end-of-document token is the last token of the document it ends. A query sees a key when both are in the
same document and the key is not in the future. Rotary positions stay those of the packed sequence: rotary
scores depend only on the distance between query and key, so a document scores as it would alone.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
# FlexAttention, create_block_mask and torch.compiler.is_compiling exist in torch >= 2.5; torch.compile of
# create_block_mask is what 2.13 recommends instead of its deprecated ``_compile=True``.
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
# AuxRequest(max_scores=True): per-row maxima of the scaled, masked scores from the kernel itself (torch >= 2.11;
# CUDA only: on CPU torch 2.11-2.13 raise NotImplementedError for it)
from torch.nn.attention.flex_attention import AuxRequest

from moe_lightning.model.config import MoEConfig
from moe_lightning.model.layers import RMSNorm, autocast_dtype
from moe_lightning.model.rotary import Rotary, apply_rotary

# Compiled lazily at the first CUDA call: fused kernels, and the block mask never builds the S x S mask.
_create_block_mask_compiled = torch.compile(create_block_mask)
_flex_attention_compiled = torch.compile(flex_attention)


def _compiled_on_cuda(eager_fn, compiled_fn, device: torch.device):
    """The compiled function on CUDA; the plain one elsewhere, or inside a compiled region (which traces it)."""
    return compiled_fn if device.type == "cuda" and not torch.compiler.is_compiling() else eager_fn


def document_ids(tokens_BS: torch.Tensor, eod_token_id: int, eods_before_B: torch.Tensor | None = None) -> torch.Tensor:
    """Document index of every token: end-of-document tokens strictly before it (plus ``eods_before_B``)."""
    is_eod_BS = (tokens_BS == eod_token_id).int()
    doc_BS = is_eod_BS.cumsum(1) - is_eod_BS
    return doc_BS if eods_before_B is None else doc_BS + eods_before_B[:, None]


def dense_mask(doc_kv_BT: torch.Tensor, q_len: int, q_pos_S: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[B, 1, S, T]`` mask (``True`` = attend) of the queries at positions ``q_pos_S`` of the ``T``
    (default: the last ``q_len``)."""
    T = doc_kv_BT.shape[1]
    if q_pos_S is None:
        q_pos_S = torch.arange(T - q_len, T, device=doc_kv_BT.device)
    causal_ST = q_pos_S[:, None] >= torch.arange(T, device=doc_kv_BT.device)
    same_doc_BST = doc_kv_BT[:, q_pos_S, None] == doc_kv_BT[:, None, :]
    return (causal_ST & same_doc_BST)[:, None]


def document_mask_mod(doc_BT: torch.Tensor, q_pos_S: torch.Tensor | None = None):
    """FlexAttention's predicate (a plain function of four indices): query row ``q_idx`` is the sequence's
    position ``q_pos_S[q_idx]`` (default: ``q_idx`` itself, a square ``S == T`` mask)."""
    if q_pos_S is None:
        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])
        return same_document_causal

    def same_document_causal_at(b, h, q_idx, kv_idx):
        q_pos = q_pos_S[q_idx]
        return (q_pos >= kv_idx) & (doc_BT[b, q_pos] == doc_BT[b, kv_idx])
    return same_document_causal_at


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_block_mask(T: int, device: torch.device) -> BlockMask:
    """FlexAttention block mask of plain causal attention (used on CUDA when max logits are recorded). Built once
    per ``(T, device)`` and shared by every layer and forward (it depends on nothing else); a compiled region
    builds its own, in its graph."""
    if torch.compiler.is_compiling():
        return create_block_mask(_causal, None, None, T, T, device=device)
    return _cached_causal_block_mask(T, device)


@functools.lru_cache(maxsize=8)
def _cached_causal_block_mask(T: int, device: torch.device) -> BlockMask:
    build = _compiled_on_cuda(create_block_mask, _create_block_mask_compiled, device)
    return build(_causal, None, None, T, T, device=device)


def document_block_mask(doc_BT: torch.Tensor, q_pos_S: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention block mask of a document mask (one per batch row, shared by the heads): square, or of the
    queries at positions ``q_pos_S`` against all ``T`` keys (``Q_LEN != KV_LEN``)."""
    B, T = doc_BT.shape
    build = _compiled_on_cuda(create_block_mask, _create_block_mask_compiled, doc_BT.device)
    q_len = T if q_pos_S is None else len(q_pos_S)
    return build(document_mask_mod(doc_BT, q_pos_S), B, None, q_len, T, device=doc_BT.device)


class DocumentMask:
    """Which keys each query sees: same document, not in the future. Built once per forward, outside the
    blocks (so a compiled block only reads it), and shared by all of them.

    ``doc_kv_BT`` holds the document ids of all ``T`` keys (with a KV cache: cached ones first); the ``q_len``
    queries (default ``T``) are the last of those positions, or (context parallelism) those at ``q_positions_S``
    of the global sequence. ``flex`` (default: on CUDA, for training or prefill or a context-parallel shard)
    builds FlexAttention's block mask, otherwise the exact boolean mask for SDPA is built.

    A square mask also serves queries and keys of its first ``n < T`` positions (multi-token prediction's depth k
    runs over ``T - k`` positions and reuses the main forward's mask): ``attend`` cuts the dense mask, and pads q,
    k and v to ``T`` for FlexAttention, so its kernel and the block mask keep one static shape (no recompile).
    """

    def __init__(self, doc_kv_BT: torch.Tensor, q_len: int | None = None, flex: bool | None = None,
                 q_positions_S: torch.Tensor | None = None):
        T = doc_kv_BT.shape[1]
        q_len = T if q_len is None else q_len
        if q_positions_S is None and flex and q_len != T:  # the cached-decoding path of ``attend`` is dense
            raise ValueError(f"DocumentMask(flex=True) needs q_len == T (training, prefill) or q_positions_S "
                             f"(a context-parallel shard); got {q_len} of {T}.")
        flex = doc_kv_BT.is_cuda and (q_len == T or q_positions_S is not None) if flex is None else flex
        self.length = T  # key positions covered
        self.block_mask: BlockMask | None = document_block_mask(doc_kv_BT, q_positions_S) if flex else None
        self.dense_B1ST: torch.Tensor | None = None if flex else dense_mask(doc_kv_BT, q_len, q_positions_S)

    def dense(self, q_len: int, kv_len: int) -> torch.Tensor:
        """The boolean mask ``[B, 1, q_len, kv_len]``: all of it, or of a square mask its first positions."""
        return self.dense_B1ST[:, :, :q_len, :kv_len]


class SequenceShard:
    """The context-parallel seam (as ``MoELayer.dispatcher`` is expert parallelism's): which positions of each
    sequence this rank computes, and how attention's key side (GQA: grouped K and V; MLA: the normalised latent
    and the rotated shared key) reaches its queries from the ranks that hold the other positions.

    ``MoETransformer.sequence_shard`` holds one and hands it to every attention and MoE layer; a strategy replaces it
    (``parallel/context_parallel.py``). This default is one rank holding the whole sequence: every method returns
    its input, so the one-rank model runs exactly the ops it ran before the seam existed (no copy, no op)."""

    size = 1  # ranks that share one sequence

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """This rank's positions ``[S / size]`` in the global sequence (ascending), or None for all of them."""
        return None

    def local(self, x_BS: torch.Tensor) -> torch.Tensor:
        """The entries of a per-position tensor ``[B, S, ...]`` (token ids, targets) at this rank's positions."""
        return x_BS

    def gather(self, *key_side_BS: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``[B, S_local, ...]`` key-side tensor of this rank's positions, completed to ``[B, S, ...]`` over
        every position of the sequence in order (differentiable: its gradient returns to the owners)."""
        return key_side_BS

    def sum_over_sequence(self, sums_BX: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums over this rank's positions ``[B, X]``, completed to the whole sequences' sums (the
        balancing losses' statistics: every rank then computes the sequences' own losses). Differentiable."""
        return sums_BX

    def truncated(self, seq_len: int, length: int) -> "SequenceShard":
        """This shard of the first ``length`` positions of a ``seq_len`` sequence (multi-token prediction's depth
        k runs over ``seq_len - k`` positions): its ``positions`` are those below ``length``, and ``gather``
        completes key-side tensors of those positions to ``[B, length, ...]``. A shard over several ranks must
        provide it (this one-rank default is the identity)."""
        if self.size > 1:
            raise ValueError(f"{type(self).__name__} splits sequences over {self.size} ranks without truncated(), "
                             "which multi-token prediction needs: implement it, or train with context_parallel_size=1.")
        return self


def flex_attend(q_BHSK, k_BGSK, v_BGSV, block_mask: BlockMask, scale: float | None,
                return_max_logits: bool = False, length: int | None = None):
    """FlexAttention with a block mask; compiled on CUDA (fused kernel), eager elsewhere (tests).

    ``return_max_logits``: also the largest scaled, unmasked score per query head ``[H]`` (fp32), which the
    kernel tracks anyway for its online softmax (``AuxRequest(max_scores=True)``: no second pass).
    ``length``: the square block mask's positions when q, k and v hold only its first ``S`` (multi-token
    prediction): they are zero-padded to it, and the padded rows dropped from the output and the maxima (a real
    query never sees a padded key: they lie in its future)."""
    kernel = _compiled_on_cuda(flex_attention, _flex_attention_compiled, q_BHSK.device)
    gqa = q_BHSK.shape[1] != k_BGSK.shape[1]
    S, padding = q_BHSK.shape[2], 0 if length is None else length - k_BGSK.shape[2]
    if padding < 0 or padding and S != k_BGSK.shape[2]:
        raise ValueError(f"flex_attend(length={length}) pads the first positions of a square mask; got {S} queries "
                         f"over {k_BGSK.shape[2]} keys.")
    if padding:
        q_BHSK, k_BGSK, v_BGSV = (_padded_rows(t, length) for t in (q_BHSK, k_BGSK, v_BGSV))
    if not return_max_logits:
        return kernel(q_BHSK, k_BGSK, v_BGSV, block_mask=block_mask, scale=scale, enable_gqa=gqa)[:, :, :S]
    out_BHSV, aux = kernel(q_BHSK, k_BGSK, v_BGSV, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                           return_aux=AuxRequest(max_scores=True))
    return out_BHSV[:, :, :S], aux.max_scores[:, :, :S].float().amax(dim=(0, 2))


def _padded_rows(t_BHTK: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` with zero rows appended along dim 2 up to ``length``, with the strides a ``length``-row tensor made the
    same way has (the main forward's q, k and v: transposed views, MLA's value a split view): the compiled kernel
    then meets the layout it was compiled for and does not recompile. Strides of the dims outside the rows grow
    with them; the others stay."""
    T, row = t_BHTK.shape[2], t_BHTK.stride(2)
    strides = [stride // T * length if stride > row else stride for stride in t_BHTK.stride()]
    padded = torch.empty_strided((*t_BHTK.shape[:2], length, *t_BHTK.shape[3:]), strides, dtype=t_BHTK.dtype,
                                 device=t_BHTK.device)
    padded[:, :, T:].zero_()
    padded[:, :, :T] = t_BHTK
    return padded


@torch.no_grad()
def exact_max_logits(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor, mask: DocumentMask | None,
                     scale: float | None) -> torch.Tensor:
    """Largest scaled ``q·k`` per query head ``[H]`` over the batch and every visible (query, key) pair, in fp32
    from the q and k the kernel gets. Builds the ``[B, H, S, T]`` scores: the CPU path's exact reference."""
    B, H, S, K = q_BHSK.shape
    G, T = k_BGTK.shape[1], k_BGTK.shape[2]
    scale = K ** -0.5 if scale is None else scale
    q_BGRSK = q_BHSK.float().view(B, G, H // G, S, K)  # query head g * H/G + r reads key head g
    scores_BGRST = q_BGRSK @ k_BGTK.float().transpose(-1, -2)[:, :, None] * scale
    if mask is not None and mask.dense_B1ST is not None:
        visible_B1ST = mask.dense(S, T)
    elif mask is not None:  # FlexAttention's block mask: evaluate its predicate at every position
        visible_B1ST = create_mask(mask.block_mask.mask_mod, B, 1, S, T, device=q_BHSK.device)
    else:
        visible_B1ST = dense_mask(k_BGTK.new_zeros(B, T, dtype=torch.long), S)
    scores_BGRST = scores_BGRST.masked_fill(~visible_B1ST[:, :, None], float("-inf"))
    return scores_BGRST.amax(dim=(0, 3, 4)).flatten()


def attend(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTV: torch.Tensor, mask: DocumentMask | None = None,
           scale: float | None = None, return_max_logits: bool = False):
    """Causal attention of the ``S`` queries (the last ``S`` of ``T`` positions) over ``T`` keys: the kernel choice.

    - no document mask, ``S == T``: SDPA's own causal flag (fused kernels);
    - a mask with a block mask (CUDA; ``S == T``, or a context-parallel shard's queries against all keys):
      FlexAttention (never builds ``S x T``);
    - a document mask without one (CPU): SDPA with the exact boolean mask;
    - queries after cached keys (decoding): each key head's ``H / G`` query heads are folded into its query
      axis, so no kernel copies the keys per query head (SDPA's ``enable_gqa`` may: the math kernel does).

    q, k and v reach the kernel in one dtype: autocast's when enabled (FlexAttention is not an autocast op, and
    a QK-norm with fp32 weights returns fp32 q/k), else v's.

    ``return_max_logits`` (training: ``S == T``, or a context-parallel shard's mask): returns ``(out, max_logits_H)``, the largest scaled score per
    query head over the batch and the visible positions (QK-clip's input). On CUDA it comes from FlexAttention
    (with a causal block mask when there is no document mask); elsewhere ``exact_max_logits`` computes it.
    """
    if return_max_logits:
        return _attend_with_max_logits(q_BHSK, k_BGTK, v_BGTV, mask, scale)
    B, H, S, K = q_BHSK.shape
    G, T = k_BGTK.shape[1], k_BGTK.shape[2]
    dtype = autocast_dtype(v_BGTV)  # is_autocast_enabled/get_autocast_dtype(device) exist since torch 2.4
    q_BHSK, k_BGTK, v_BGTV = q_BHSK.to(dtype), k_BGTK.to(dtype), v_BGTV.to(dtype)
    if mask is not None and mask.block_mask is not None:
        return flex_attend(q_BHSK, k_BGTK, v_BGTV, mask.block_mask, scale, length=mask.length)
    if S < T:
        mask_B1ST = None if mask is None and S == 1 else (
            mask.dense_B1ST if mask is not None else dense_mask(k_BGTK.new_zeros(B, T, dtype=torch.long), S))
        q_BGXK = q_BHSK.reshape(B, G, H // G * S, K)  # row r * S + s: query s of head g * H/G + r
        if mask_B1ST is not None and S > 1:
            mask_B1ST = mask_B1ST.repeat(1, 1, H // G, 1)
        out_BGXV = F.scaled_dot_product_attention(q_BGXK, k_BGTK, v_BGTV, attn_mask=mask_B1ST, scale=scale)
        return out_BGXV.view(B, H, S, -1)
    gqa = H != G
    if mask is None:
        return F.scaled_dot_product_attention(q_BHSK, k_BGTK, v_BGTV, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q_BHSK, k_BGTK, v_BGTV, attn_mask=mask.dense(S, T), scale=scale,
                                          enable_gqa=gqa)


def _attend_with_max_logits(q_BHSK, k_BGTK, v_BGTV, mask: DocumentMask | None, scale: float | None):
    S, T = q_BHSK.shape[2], k_BGTK.shape[2]
    if S != T and mask is None:
        raise ValueError(f"attend(return_max_logits=True) records training forwards (S == T, or a context-parallel "
                         f"shard's mask); got {S} queries after {T - S} cached keys.")
    dtype = autocast_dtype(v_BGTV)
    q_BHSK, k_BGTK, v_BGTV = q_BHSK.to(dtype), k_BGTK.to(dtype), v_BGTV.to(dtype)
    if q_BHSK.is_cuda and mask is None:  # rows rounded up to FlexAttention's 128-row blocks: MTP's S - k reuse S's
        length = -(-T // 128) * 128
        return flex_attend(q_BHSK, k_BGTK, v_BGTV, causal_block_mask(length, q_BHSK.device), scale,
                           return_max_logits=True, length=length)
    if q_BHSK.is_cuda and mask.block_mask is not None:
        return flex_attend(q_BHSK, k_BGTK, v_BGTV, mask.block_mask, scale, return_max_logits=True, length=mask.length)
    return attend(q_BHSK, k_BGTK, v_BGTV, mask, scale), exact_max_logits(q_BHSK, k_BGTK, mask, scale)


class MaxLogitRecorder:
    """The QK-clip seam of an attention module: while ``record_max_logits`` is on, every training forward folds
    its per-head maximum pre-softmax logit into ``max_logits`` (``[n_heads]``, fp32, on the activations' device).

    A running maximum until a reader sets ``max_logits = None``: the micro-batches of a step fold in, and a block
    recomputed in backward (activation checkpointing) records the same values again, which changes nothing.
    Off by default, so training without QK-clip pays nothing. ``qk_clip_scales`` says which weight rows to scale.
    """

    record_max_logits: bool = False
    max_logits: torch.Tensor | None = None

    def _record(self, max_logits_H: torch.Tensor) -> None:
        max_logits_H = max_logits_H.detach()
        self.max_logits = max_logits_H if self.max_logits is None else torch.maximum(self.max_logits, max_logits_H)

    def _recording(self, cache) -> bool:
        return self.record_max_logits and self.training and cache is None


class GroupedQueryAttention(MaxLogitRecorder, nn.Module):
    """``n_heads`` query heads share ``n_kv_heads`` key/value heads; optional QK-norm and q/k/v clipping."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.rotary = Rotary(config, self.head_dim)
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)
        self.qk_norm, self.clip_qkv = config.qk_norm, config.clip_qkv
        if self.qk_norm != "none":
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else self.n_heads * self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else self.n_kv_heads * self.head_dim, config.norm_eps)

    def forward(self, x_BSD: torch.Tensor, mask: DocumentMask | None = None, cache=None,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                sequence_shard: SequenceShard | None = None) -> torch.Tensor:
        """``cache`` (a ``kv_cache.LayerCache``): positions continue after the cached ones, keys/values are kept.
        ``cos_sin``: this forward's rotary tables (``MoETransformer`` computes them once for all layers).
        ``sequence_shard``: ``x`` holds this rank's positions of the sequence; the grouped K and V are gathered
        (``mask`` and ``cos_sin`` are then those positions')."""
        B, S, _ = x_BSD.shape
        q_BSHK = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k_BSGK = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v_BSGK = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHK, k_BSGK = self.q_norm(q_BSHK), self.k_norm(k_BSGK)
        elif self.qk_norm == "full":
            q_BSHK = self.q_norm(q_BSHK.flatten(2)).view_as(q_BSHK)
            k_BSGK = self.k_norm(k_BSGK.flatten(2)).view_as(k_BSGK)
        if self.clip_qkv is not None:
            q_BSHK, k_BSGK, v_BSGK = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q_BSHK, k_BSGK, v_BSGK))
        cos, sin = cos_sin or self.rotary.cos_sin(0 if cache is None else cache.length, S, device=x_BSD.device)
        q_BSHK, k_BTGK = apply_rotary(q_BSHK, cos, sin), apply_rotary(k_BSGK, cos, sin)
        v_BTGK = v_BSGK
        if cache is not None:
            k_BTGK, v_BTGK = cache.append(k_BTGK, v_BTGK)
        if sequence_shard is not None:
            k_BTGK, v_BTGK = sequence_shard.gather(k_BTGK, v_BTGK)
        q_BHSK, k_BGTK, v_BGTK = q_BSHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2)
        if self._recording(cache):
            out_BHSK, max_logits_H = attend(q_BHSK, k_BGTK, v_BGTK, mask, return_max_logits=True)
            self._record(max_logits_H)
        else:
            out_BHSK = attend(q_BHSK, k_BGTK, v_BGTK, mask)
        return self.wo(out_BHSK.transpose(1, 2).reshape(B, S, -1))

    def qk_clip_scales(self, gamma_H: torch.Tensor, alpha: float) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip's weight operation as ``(parameter, factor per row)`` pairs: every logit of query head ``h``
        is multiplied by ``gamma_H[h]`` or less. Query rows of head ``h`` get ``gamma_H[h] ** alpha``; a key head
        shared by several query heads (GQA) gets the smallest ``gamma`` of its group, ``min(gamma) ** (1 - alpha)``,
        so its other query heads' logits shrink too (by that factor; their query rows stay as they are).
        Rotary rotation commutes with scaling a head's rows. With ``qk_norm="full"`` the projection's scale is
        normalised away, so the norm's per-feature weights are scaled instead."""
        if self.qk_norm == "head" or self.clip_qkv is not None:
            raise ValueError(qk_clip_unsupported(self.qk_norm, self.clip_qkv))
        q_rows = (gamma_H ** alpha).repeat_interleave(self.head_dim)
        gamma_G = gamma_H.view(self.n_kv_heads, -1).amin(dim=1)
        k_rows = (gamma_G ** (1 - alpha)).repeat_interleave(self.head_dim)
        if self.qk_norm == "full":
            return [(self.q_norm.weight, q_rows), (self.k_norm.weight, k_rows)]
        return [(self.wq.weight, q_rows), (self.wk.weight, k_rows)]

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        if self.qk_norm != "none":
            self.q_norm.init_weights()
            self.k_norm.init_weights()


def qk_clip_unsupported(qk_norm: str, clip_qkv: float | None) -> str | None:
    """Why QK-clip cannot bound this GQA's logits by rescaling weights, or None when it can."""
    if qk_norm == "head":
        return ("QKClip: config.qk_norm='head' normalises every head with one shared weight, so no weight scales "
                "a single head's logits; use qk_norm='full' or 'none', or remove QKClip (QK-norm already bounds "
                "the logits' scale).")
    if clip_qkv is not None:
        return (f"QKClip: config.clip_qkv={clip_qkv} clamps q and k after the projections, so scaling their rows "
                "does not scale the logits; set clip_qkv to null or remove QKClip.")
    return None
