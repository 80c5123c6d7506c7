"""The decoder-only MoE transformer, readable top to bottom. No distributed code lives here."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import GroupedQueryAttention
from .config import MoEConfig
from .layers import RMSNorm, SwiGLU
from .mla import MultiHeadLatentAttention
from .moe import MoELayer


def build_attention(config: MoEConfig) -> nn.Module:
    return MultiHeadLatentAttention(config) if config.attention == "mla" else GroupedQueryAttention(config)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; FFN dense or MoE."""

    def __init__(self, config: MoEConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = build_attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.is_moe = layer_id >= config.n_dense_layers
        self.ffn = MoELayer(config) if self.is_moe else SwiGLU(config.dim, config.ffn_hidden)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD))
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class MoETransformer(nn.Module):
    """Embedding → ``layers`` (the repeated blocks every plug-in wraps) → final norm → output head."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings.weight.device.type != "meta":
            self.init_weights()

    def forward(self, tokens_BS: torch.Tensor, *, return_hidden: bool = False) -> torch.Tensor:
        """Logits ``[B, S, V]``, or with ``return_hidden`` the final-normed hidden states ``[B, S, D]`` (for a
        loss that applies ``self.output`` itself, e.g. chunk by chunk)."""
        h_BSD = self.tok_embeddings(tokens_BS)
        for layer in self.layers:
            h_BSD = layer(h_BSD)
        h_BSD = self.norm(h_BSD)
        return h_BSD if return_hidden else self.output(h_BSD)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer; called after materialising from the meta device."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.config.tie_embeddings else std)
        for block in self.layers:
            block.attention_norm.init_weights()
            block.ffn_norm.init_weights()
            block.attention.init_weights(std, out_std)
            block.ffn.init_weights(std, out_std)
        self.norm.init_weights()
        if not self.config.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.config.dim ** -0.5)

    def moe_layers(self) -> list[MoELayer]:
        return [block.ffn for block in self.layers if block.is_moe]

    def num_parameters(self, active: bool = False) -> int:
        """Total parameters, or those one token touches (routed experts scaled by top_k/num_experts)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        routed = sum(p.numel() for moe in self.moe_layers() for p in moe.experts.parameters())
        return total - routed + routed * self.config.top_k // self.config.num_experts

    @torch.no_grad()
    def generate(self, tokens_BS: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample continuations autoregressively (no KV cache: recomputes the cropped context)."""
        for _ in range(max_new_tokens):
            context_BS = tokens_BS[:, -self.config.max_seq_len:]
            logits_BV = self(context_BS)[:, -1].float()
            if temperature <= 0:
                next_B1 = logits_BV.argmax(-1, keepdim=True)
            else:
                logits_BV = logits_BV / temperature
                if top_k is not None:
                    kth_B1 = logits_BV.topk(min(top_k, logits_BV.shape[-1])).values[:, -1:]
                    logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
                next_B1 = torch.multinomial(F.softmax(logits_BV, -1), 1, generator=generator)
            tokens_BS = torch.cat([tokens_BS, next_B1.to(tokens_BS.dtype)], dim=1)
        return tokens_BS
