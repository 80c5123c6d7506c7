"""Causal grouped-query attention with rotary position embeddings, and the one kernel choice all attention shares.

Document masking (packed sequences): token ``i`` belongs to document ``#EODs strictly before i``, so an
end-of-document token is the last token of the document it ends. A query sees a key when both are in the
same document and the key is not in the future. Rotary positions stay those of the packed sequence: rotary
scores depend only on the distance between query and key, so a document scores as it would alone.
"""

import torch
import torch.nn.functional as F
from torch import nn
# FlexAttention, create_block_mask and torch.compiler.is_compiling exist in torch >= 2.5; torch.compile of
# create_block_mask is what 2.13 recommends instead of its deprecated ``_compile=True``.
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .config import MoEConfig
from .layers import RMSNorm, autocast_dtype
from .rotary import Rotary, apply_rotary

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


def dense_mask(doc_kv_BT: torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean ``[B, 1, S, T]`` mask (``True`` = attend) of the last ``q_len`` of the ``T`` positions."""
    T = doc_kv_BT.shape[1]
    q_pos_S = torch.arange(T - q_len, T, device=doc_kv_BT.device)
    causal_ST = q_pos_S[:, None] >= torch.arange(T, device=doc_kv_BT.device)
    same_doc_BST = doc_kv_BT[:, T - q_len:, None] == doc_kv_BT[:, None, :]
    return (causal_ST & same_doc_BST)[:, None]


def document_mask_mod(doc_BT: torch.Tensor):
    """FlexAttention's predicate for a square ``S == T`` mask; a plain function of four indices."""
    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])
    return same_document_causal


def document_block_mask(doc_BT: torch.Tensor) -> BlockMask:
    """FlexAttention block mask of a square document mask (one per batch row, shared by the heads)."""
    B, T = doc_BT.shape
    build = _compiled_on_cuda(create_block_mask, _create_block_mask_compiled, doc_BT.device)
    return build(document_mask_mod(doc_BT), B, None, T, T, device=doc_BT.device)


class DocumentMask:
    """Which keys each query sees: same document, not in the future. Built once per forward, outside the
    blocks (so a compiled block only reads it), and shared by all of them.

    ``doc_kv_BT`` holds the document ids of all ``T`` keys (with a KV cache: cached ones first); the ``q_len``
    queries (default ``T``) are the last of those positions. ``flex`` (default: on CUDA when ``q_len == T``)
    builds FlexAttention's block mask, otherwise the exact boolean mask for SDPA is built.
    """

    def __init__(self, doc_kv_BT: torch.Tensor, q_len: int | None = None, flex: bool | None = None):
        T = doc_kv_BT.shape[1]
        q_len = T if q_len is None else q_len
        flex = doc_kv_BT.is_cuda and q_len == T if flex is None else flex
        if flex and q_len != T:
            raise ValueError(f"DocumentMask(flex=True) needs q_len == T (training, prefill); got {q_len} of {T}.")
        self.block_mask: BlockMask | None = document_block_mask(doc_kv_BT) if flex else None
        self.dense_B1ST: torch.Tensor | None = None if flex else dense_mask(doc_kv_BT, q_len)


def flex_attend(q_BHSK, k_BGSK, v_BGSV, block_mask: BlockMask, scale: float | None) -> torch.Tensor:
    """FlexAttention with a block mask; compiled on CUDA (fused kernel), eager elsewhere (tests)."""
    kernel = _compiled_on_cuda(flex_attention, _flex_attention_compiled, q_BHSK.device)
    return kernel(q_BHSK, k_BGSK, v_BGSV, block_mask=block_mask, scale=scale,
                  enable_gqa=q_BHSK.shape[1] != k_BGSK.shape[1])


def attend(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTV: torch.Tensor, mask: DocumentMask | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Causal attention of the ``S`` queries (the last ``S`` of ``T`` positions) over ``T`` keys: the kernel choice.

    - no document mask, ``S == T``: SDPA's own causal flag (fused kernels);
    - document mask with a block mask (CUDA, ``S == T``): FlexAttention (never builds ``S x S``);
    - a document mask without one (CPU): SDPA with the exact boolean mask;
    - queries after cached keys (decoding): each key head's ``H / G`` query heads are folded into its query
      axis, so no kernel copies the keys per query head (SDPA's ``enable_gqa`` may: the math kernel does).

    q, k and v reach the kernel in one dtype: autocast's when enabled (FlexAttention is not an autocast op, and
    a QK-norm with fp32 weights returns fp32 q/k), else v's.
    """
    B, H, S, K = q_BHSK.shape
    G, T = k_BGTK.shape[1], k_BGTK.shape[2]
    dtype = autocast_dtype(v_BGTV)  # is_autocast_enabled/get_autocast_dtype(device) exist since torch 2.4
    q_BHSK, k_BGTK, v_BGTV = q_BHSK.to(dtype), k_BGTK.to(dtype), v_BGTV.to(dtype)
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
    if mask.block_mask is not None:
        return flex_attend(q_BHSK, k_BGTK, v_BGTV, mask.block_mask, scale)
    return F.scaled_dot_product_attention(q_BHSK, k_BGTK, v_BGTV, attn_mask=mask.dense_B1ST, scale=scale,
                                          enable_gqa=gqa)


class GroupedQueryAttention(nn.Module):
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
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``cache`` (a ``kv_cache.LayerCache``): positions continue after the cached ones, keys/values are kept.
        ``cos_sin``: this forward's rotary tables (``MoETransformer`` computes them once for all layers)."""
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
        out_BHSK = attend(q_BSHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2), mask)
        return self.wo(out_BHSK.transpose(1, 2).reshape(B, S, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        if self.qk_norm != "none":
            self.q_norm.init_weights()
            self.k_norm.init_weights()
