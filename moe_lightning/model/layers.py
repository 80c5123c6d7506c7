"""Small building blocks shared by attention and FFN code: RMSNorm, rotary embeddings, SwiGLU."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rotary_cos_sin(seq_len: int, rot_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq_len, rot_dim // 2]`` in fp32, computed on demand (meta-device friendly)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    angles_SR = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles_SR.cos(), angles_SR.sin()


def apply_rotary(x_BSHR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of the last dim by position-dependent angles."""
    x_pairs = x_BSHR.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos_SR[:, None, :], sin_SR[:, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x_BSHR)


class SwiGLU(nn.Module):
    """Dense FFN ``w2(silu(w1 x) * w3 x)``; also used for the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)
