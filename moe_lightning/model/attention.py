"""Causal grouped-query attention with rotary position embeddings."""

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layers import apply_rotary, rotary_cos_sin


class GroupedQueryAttention(nn.Module):
    """``n_heads`` query heads share ``n_kv_heads`` key/value heads; SDPA picks the fused kernel."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BSHK = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k_BSGK = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v_BSGK = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        cos, sin = rotary_cos_sin(S, self.head_dim, self.rope_theta, device=x_BSD.device)
        q_BSHK, k_BSGK = apply_rotary(q_BSHK, cos, sin), apply_rotary(k_BSGK, cos, sin)
        out_BHSK = F.scaled_dot_product_attention(
            q_BSHK.transpose(1, 2), k_BSGK.transpose(1, 2), v_BSGK.transpose(1, 2),
            is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(out_BHSK.transpose(1, 2).reshape(B, S, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
