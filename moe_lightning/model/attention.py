"""Causal grouped-query attention with rotary position embeddings, and the one kernel choice all attention shares.

Document masking (packed sequences): token ``i`` belongs to document ``#EODs strictly before i``, so an
end-of-document token is the last token of the document it ends. A query sees a key when both are in the
same document and the key is not in the future. Rotary positions stay those of the packed sequence: rotary
scores depend only on the distance between query and key, so a document scores as it would alone.
"""

import torch
import torch.nn.functional as F
from torch import nn
# FlexAttention and create_block_mask(_compile=...) exist since torch 2.5 (read here in the 2.13 source).
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .config import MoEConfig
from .layers import RMSNorm
from .rotary import Rotary, apply_rotary


def document_ids(tokens_BS: torch.Tensor, eod_token_id: int, eods_before_B: torch.Tensor | None = None) -> torch.Tensor:
    """Document index of every token: end-of-document tokens strictly before it (plus ``eods_before_B``)."""
    is_eod_BS = (tokens_BS == eod_token_id).int()
    doc_BS = is_eod_BS.cumsum(1) - is_eod_BS
    return doc_BS if eods_before_B is None else doc_BS + eods_before_B[:, None]


class DocumentMask:
    """Which keys each query sees: same document, not in the future. Built once per forward, shared by all blocks.

    ``doc_kv_BT`` holds the document ids of all ``T`` keys (with a KV cache: cached ones first); the ``S``
    queries are the last ``S`` of those positions.
    """

    def __init__(self, doc_kv_BT: torch.Tensor):
        self.doc_kv_BT = doc_kv_BT
        self._block_mask: BlockMask | None = None
        self._dense: dict[int, torch.Tensor] = {}

    def mask_mod(self):
        """FlexAttention's predicate for a square ``S == T`` mask (training, prefill); a plain function of
        four indices, as ``create_block_mask`` requires."""
        doc_BT = self.doc_kv_BT

        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc_BT[b, q_idx] == doc_BT[b, kv_idx])
        return same_document_causal

    def dense(self, q_len: int) -> torch.Tensor:
        """Boolean ``[B, 1, S, T]`` mask (``True`` = attend) for the last ``q_len`` query positions (built once)."""
        if q_len not in self._dense:
            T = self.doc_kv_BT.shape[1]
            q_pos_S = torch.arange(T - q_len, T, device=self.doc_kv_BT.device)
            causal_ST = q_pos_S[:, None] >= torch.arange(T, device=self.doc_kv_BT.device)
            same_doc_BST = self.doc_kv_BT[:, T - q_len:, None] == self.doc_kv_BT[:, None, :]
            self._dense[q_len] = (causal_ST & same_doc_BST)[:, None]
        return self._dense[q_len]

    def block_mask(self) -> BlockMask:
        """FlexAttention block mask, built once (compiled on CUDA, so the ``S x S`` mask never exists)."""
        if self._block_mask is None:
            B, T = self.doc_kv_BT.shape
            device = self.doc_kv_BT.device
            self._block_mask = create_block_mask(self.mask_mod(), B, None, T, T, device=device,
                                                 _compile=device.type == "cuda")
        return self._block_mask


_compiled_flex_attention = None


def flex_attend(q_BHSK, k_BGSK, v_BGSV, mask: DocumentMask, scale: float | None) -> torch.Tensor:
    """FlexAttention with the document block mask; compiled on CUDA (fused kernel), eager elsewhere (tests)."""
    global _compiled_flex_attention
    kernel = flex_attention
    if q_BHSK.is_cuda:
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention)
        kernel = _compiled_flex_attention
    return kernel(q_BHSK, k_BGSK, v_BGSV, block_mask=mask.block_mask(), scale=scale,
                  enable_gqa=q_BHSK.shape[1] != k_BGSK.shape[1])


def attend(q_BHSK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTV: torch.Tensor, mask: DocumentMask | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Causal attention of the ``S`` queries (the last ``S`` of ``T`` positions) over ``T`` keys: the kernel choice.

    - no document mask, ``S == T`` or a single query: SDPA's own causal flag (fused kernels);
    - document mask on CUDA, ``S == T``: FlexAttention with a block mask (never builds ``S x S``);
    - otherwise (CPU, or queries after cached keys): SDPA with an exact boolean mask.
    """
    S, T = q_BHSK.shape[2], k_BGTK.shape[2]
    gqa = q_BHSK.shape[1] != k_BGTK.shape[1]
    if mask is None and S in (1, T):
        return F.scaled_dot_product_attention(q_BHSK, k_BGTK, v_BGTV, is_causal=S == T, scale=scale, enable_gqa=gqa)
    if mask is not None and q_BHSK.is_cuda and S == T:
        return flex_attend(q_BHSK, k_BGTK, v_BGTV, mask, scale)
    if mask is None:  # queries after cached keys, one document
        mask = DocumentMask(torch.zeros(q_BHSK.shape[0], T, dtype=torch.long, device=q_BHSK.device))
    return F.scaled_dot_product_attention(q_BHSK, k_BGTK, v_BGTV, attn_mask=mask.dense(S), scale=scale,
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

    def forward(self, x_BSD: torch.Tensor, mask: DocumentMask | None = None, cache=None) -> torch.Tensor:
        """``cache`` (a ``kv_cache.LayerCache``): positions continue after the cached ones, keys/values are kept."""
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
        cos, sin = self.rotary.cos_sin(0 if cache is None else cache.length, S, device=x_BSD.device)
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
