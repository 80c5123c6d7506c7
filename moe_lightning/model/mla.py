"""Multi-head latent attention (DeepSeek-V2/V3): keys and values pass through a small shared latent.

Shapes: H heads, N = ``qk_nope_head_dim``, R = ``qk_rope_head_dim``, V = ``v_head_dim``,
Q = ``q_lora_rank``, C = ``kv_lora_rank``. Rotary position lives only in the R decoupled dims, with
one rotary key per token shared by every head, so the compressed latent itself carries no position.
"""

import torch
from torch import nn

from .attention import DocumentMask, attend
from .config import MoEConfig
from .layers import RMSNorm
from .rotary import Rotary, apply_rotary, mla_softmax_scale


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA with low-rank query (optional, ``q_lora_rank > 0``) and key/value projections."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        latent_eps = config.norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        if self.q_lora_rank:
            self.wq_a = nn.Linear(config.dim, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, latent_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(config.dim, self.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, latent_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, config.dim, bias=False)
        self.rotary = Rotary(config, self.rope_dim)
        self.scale = mla_softmax_scale(config)

    def forward(self, x_BSD: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H = self.n_heads
        q_BSX = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if self.q_lora_rank else self.wq(x_BSD)
        q_nope_BSHN, q_rope_BSHR = q_BSX.view(B, S, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(0, S, device=x_BSD.device)
        q_rope_BSHR = apply_rotary(q_rope_BSHR, cos, sin)
        k_rope_BS1R = apply_rotary(k_rope_BSR.unsqueeze(2), cos, sin)
        kv_BSHX = self.wkv_b(self.kv_norm(kv_BSC)).view(B, S, H, -1)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([self.nope_dim, self.v_dim], dim=-1)
        q_BSHK = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        k_BSHK = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(-1, -1, H, -1)], dim=-1)
        out_BHSV = attend(q_BSHK.transpose(1, 2), k_BSHK.transpose(1, 2), v_BSHV.transpose(1, 2), mask, self.scale)
        return self.wo(out_BHSV.transpose(1, 2).reshape(B, S, H * self.v_dim))

    def init_weights(self, std: float, out_std: float) -> None:
        for module in self.children():
            if isinstance(module, RMSNorm):
                module.init_weights()
            elif module is not self.wo:
                nn.init.normal_(module.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
