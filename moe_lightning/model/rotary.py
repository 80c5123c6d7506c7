"""Rotary position embeddings and their scaling rules: plain, or YaRN (extending a model's context).

Pairs are interleaved: ``(x[2j], x[2j+1])`` rotates by ``position * inv_freq[j]``. Nothing is stored as
a buffer: tables are computed per forward, so meta-device construction and any dtype work unchanged.

YaRN (Peng et al. 2023), as DeepSeek-V3/Qwen3 checkpoints configure it: frequencies that turn fewer than
``beta_slow`` times over the original context are interpolated (divided by ``factor``), those turning more
than ``beta_fast`` times are kept, a linear ramp blends the dims between; cos/sin are multiplied by an
attention factor (``mscale``), and MLA multiplies its softmax scale by ``mscale(factor, mscale_all_dim)²``.
"""

import math

import torch

from moe_lightning.model.config import MoEConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Rotary:
    """Rotary tables for one rotary width ``rot_dim`` under the config's scaling rule."""

    def __init__(self, config: MoEConfig, rot_dim: int):
        self.config, self.rot_dim = config, rot_dim
        self.attention_factor = 1.0
        if config.rope_scaling == "yarn":
            if config.rope_attention_factor is not None:
                self.attention_factor = config.rope_attention_factor
            elif config.rope_mscale and config.rope_mscale_all_dim:
                self.attention_factor = (yarn_mscale(config.rope_factor, config.rope_mscale)
                                         / yarn_mscale(config.rope_factor, config.rope_mscale_all_dim))
            else:
                self.attention_factor = yarn_mscale(config.rope_factor)

    def inv_freq(self, device=None) -> torch.Tensor:
        """``[rot_dim // 2]`` angular frequencies (fp32)."""
        c, dim = self.config, self.rot_dim
        inv_freq_R = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        if c.rope_scaling != "yarn":
            return inv_freq_R

        def dim_turning(turns: float) -> float:  # the rotary dim whose frequency turns `turns` times in context
            return dim * math.log(c.rope_original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(c.rope_theta))

        low, high = dim_turning(c.rope_beta_fast), dim_turning(c.rope_beta_slow)
        if c.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high if high != low else high + 0.001
        interpolate_R = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return inv_freq_R / c.rope_factor * interpolate_R + inv_freq_R * (1 - interpolate_R)

    def cos_sin(self, start: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[length, rot_dim // 2]`` (fp32, times the attention factor) for positions ``start..``."""
        return self.cos_sin_at(torch.arange(start, start + length, device=device, dtype=torch.float32))

    def cos_sin_at(self, positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at any positions (a context-parallel rank's tokens are not contiguous in its sequence)."""
        angles_SR = torch.outer(positions_S.float(), self.inv_freq(positions_S.device))
        return angles_SR.cos() * self.attention_factor, angles_SR.sin() * self.attention_factor


def mla_softmax_scale(config: MoEConfig) -> float:
    """MLA's ``1/sqrt(qk head dim)``, times ``mscale(factor, mscale_all_dim)²`` under YaRN (DeepSeek-V2/V3)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if config.rope_scaling == "yarn" and config.rope_mscale_all_dim:
        scale *= yarn_mscale(config.rope_factor, config.rope_mscale_all_dim) ** 2
    return scale


def apply_rotary(x_BSHR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of the last dim by position-dependent angles."""
    x_pairs = x_BSHR.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos_SR[:, None, :], sin_SR[:, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x_BSHR)
