"""Block-FP8 releases (DeepSeek-V3, Kimi K2): every Linear weight of attention and the FFNs is ``float8_e4m3fn``
with a float32 ``<name>_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]`` that multiplies each 128 x 128
block back to its value; ``quantization_config`` in config.json says so.

Read: a region of such a weight is the FP8 region times the scales of the blocks it touches, computed in float32
(one rounding) and then cast, so a rank that reads its slice never reads more than that slice's blocks. Written:
DeepSeek's rule, ``scale_inv = amax(block) / 448`` in float32 and ``weight / scale_inv`` rounded to e4m3.
"""

import math
import re

import torch
import torch.nn.functional as F

from moe_lightning.hf.mapping import HFFormatError

BLOCK = 128  # the released block: weight_block_size [128, 128]
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK]}
# Our tensors the releases store in FP8: attention projections, dense FFNs, shared and routed experts. Embeddings,
# head, norms, router gate, balancing bias and the MTP layers' eh_proj stay in bf16/fp32, as released.
QUANTIZED = re.compile(r"(^|\.)(attention\.w\w+\.weight|ffn\.(shared_experts\.)?w[123]\.weight|"
                       r"ffn\.experts\.w[123]_E[DF][DF])$")


def block_fp8(hf: dict) -> bool:
    """Whether config.json declares block-FP8 weights; any other ``quantization_config`` is refused, naming the
    field (before any tensor is read)."""
    quant = hf.get("quantization_config")
    if not quant:
        return False

    def refuse(key: str, value, why: str):
        raise HFFormatError(f"config.json quantization_config.{key}={value!r} is not supported: {why}.")

    if not isinstance(quant, dict):
        raise HFFormatError(f"config.json quantization_config={quant!r} is not supported: expected an object with "
                            f"quant_method 'fp8' and weight_block_size [128, 128].")
    if quant.get("quant_method") != "fp8":
        refuse("quant_method", quant.get("quant_method"), "only 'fp8' 128 x 128 block weights (the DeepSeek-V3 and "
               "Kimi K2 releases) are read; dequantise other formats to bf16 first")
    if list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        refuse("weight_block_size", quant.get("weight_block_size"), f"only [{BLOCK}, {BLOCK}] blocks (the released "
               "format) are read; dequantise to bf16 first")
    if quant.get("fmt", "e4m3") != "e4m3":
        refuse("fmt", quant.get("fmt"), "only e4m3 (float8_e4m3fn) weights are read")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        refuse("activation_scheme", quant.get("activation_scheme"), "static activation scales (input_scale "
               "tensors) serve FP8 inference only and are not read; use a release with 'dynamic'")
    return True


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


class Dequantized:
    """A ``SafetensorsDir`` whose FP8 weights read as ``dtype`` (weight x scale_inv, block by block); the scales
    themselves are not keys. ``check`` refuses, before any read, an FP8 tensor without its scale, a scale without
    its FP8 weight, or a scale of the wrong shape."""

    def __init__(self, files, dtype: torch.dtype):
        self.files, self.dtype = files, dtype
        self.path = files.path
        self.scales = {key[:-len(SCALE_SUFFIX)]: key for key in files.keys() if key.endswith(SCALE_SUFFIX)}

    def check(self) -> None:
        for weight, scale in self.scales.items():
            if weight not in self.files.keys():
                raise HFFormatError(f"{str(self.path)!r} holds the scale {scale!r} but not its weight {weight!r}.")
            if self.files.dtype(weight) != FP8:
                raise HFFormatError(f"{str(self.path)!r}: {weight!r} has a {scale!r} but is stored as "
                                    f"{self.files.dtype(weight)}, not float8_e4m3fn: the checkpoint is not the "
                                    f"block-FP8 format its quantization_config declares.")
            shape = self.files.shape(weight)
            if len(shape) != 2 or self.files.shape(scale) != scale_shape(shape):
                raise HFFormatError(f"{str(self.path)!r}: {scale!r} has shape {self.files.shape(scale)}, but a "
                                    f"{shape} weight in {BLOCK} x {BLOCK} blocks needs "
                                    f"{scale_shape(shape) if len(shape) == 2 else 'a 2-D weight'}.")
        for key in self.files.keys():
            if key not in self.scales and not key.endswith(SCALE_SUFFIX) and self.files.dtype(key) == FP8:
                raise HFFormatError(f"{str(self.path)!r}: {key!r} is float8_e4m3fn but has no {key + SCALE_SUFFIX!r}: "
                                    f"its values cannot be dequantised.")

    def keys(self) -> set[str]:
        return self.files.keys() - set(self.scales.values())

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files.shape(key)

    def get(self, key: str):
        if key not in self.scales:
            return self.files.get(key)
        return Blocks(self.files.get(key), self.files.get(self.scales[key]), self.dtype, self.scales[key])


class Blocks:
    """``Blocks(weight, scale, dtype, name)[rows, cols]``: that region of one FP8 weight, dequantised; only the
    region's FP8 values and the scales of the blocks it touches are read.

    A scale multiplies a whole 128 x 128 block: inf or NaN would make 16,384 non-finite weights, 0 a block of zeros,
    a negative one a sign-flipped block, so a scale read that is not finite and positive is refused, naming the
    scale tensor ``name`` (checked as read: a rank reads only its own blocks' scales). A zero scale over values that
    are all zero (in the region read) loses nothing and is read."""

    def __init__(self, weight, scale, dtype: torch.dtype, name: str):
        self.weight, self.scale, self.dtype, self.name = weight, scale, dtype, name

    def get_shape(self):
        return self.weight.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        (r0, r1), (c0, c1) = (_bounds(s, n) for s, n in
                              zip(index + (slice(None),) * (2 - len(index)), self.get_shape()))
        out_RC = self.weight[r0:r1, c0:c1].to(torch.float32)
        s_rc = self.scale[r0 // BLOCK:-(-r1 // BLOCK), c0 // BLOCK:-(-c1 // BLOCK)].to(torch.float32)
        bad_rc = ~(torch.isfinite(s_rc) & (s_rc >= 0))
        for i, j in (s_rc == 0).nonzero().tolist():  # lossless over a block of zeros: refused only over a value
            rows = slice(max((r0 // BLOCK + i) * BLOCK, r0) - r0, min((r0 // BLOCK + i + 1) * BLOCK, r1) - r0)
            cols = slice(max((c0 // BLOCK + j) * BLOCK, c0) - c0, min((c0 // BLOCK + j + 1) * BLOCK, c1) - c0)
            bad_rc[i, j] = out_RC[rows, cols].any()
        if bad_rc.any():
            at = [int(i) for i in bad_rc.nonzero()[0]]
            raise HFFormatError(f"{self.name!r} holds {int(bad_rc.sum())} scale(s) that are not finite and positive, e.g. "
                                f"{s_rc[tuple(at)].item()} at block {[r0 // BLOCK + at[0], c0 // BLOCK + at[1]]}: the "
                                f"weights cannot be dequantised from it; the file is damaged (download it again).")
        s_rC = s_rc.repeat_interleave(BLOCK, dim=1)[:, c0 % BLOCK:c0 % BLOCK + c1 - c0]
        for i, start in enumerate(range(r0 - r0 % BLOCK, r1, BLOCK)):  # one block row at a time: no [R, C] scales
            out_RC[max(start, r0) - r0:min(start + BLOCK, r1) - r0] *= s_rC[i]
        return out_RC.to(self.dtype)


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"FP8 block reads take contiguous regions, not step {step}.")
    return start, max(start, stop)


def quantized(name: str) -> bool:
    """Whether the releases store this tensor of ours (``MoETransformer`` name) in FP8."""
    return QUANTIZED.search(name) is not None


@torch.no_grad()
def quantize(weight_OI: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale_inv)`` by DeepSeek's rule: ``scale_inv = amax(block) / 448`` in float32,
    ``weight / scale_inv`` rounded to nearest e4m3. An all-zero block gets ``scale_inv = 1`` (amax / 448 would be 0,
    and 0 / 0 NaN): its FP8 values are zeros, dequantising to exactly 0. Partial edge blocks take the amax of the
    values they hold."""
    if weight_OI.ndim != 2:
        raise HFFormatError(f"{key} has shape {tuple(weight_OI.shape)}: only 2-D weights are stored in FP8 blocks.")
    w_OI = weight_OI.detach().to("cpu", torch.float32)
    O, I = w_OI.shape
    (Ob, Ib) = scale_shape((O, I))
    padded = F.pad(w_OI, (0, Ib * BLOCK - I, 0, Ob * BLOCK - O))  # zeros change no amax
    amax_ObIb = padded.view(Ob, BLOCK, Ib, BLOCK).abs().amax(dim=(1, 3))
    if not torch.isfinite(amax_ObIb).all():
        raise HFFormatError(f"{key} holds non-finite values (inf or NaN): it cannot be written in FP8 blocks.")
    scale_ObIb = amax_ObIb / E4M3_MAX
    scale_ObIb[amax_ObIb == 0] = 1.0
    q = (padded.view(Ob, BLOCK, Ib, BLOCK) / scale_ObIb[:, None, :, None]).to(FP8)
    return q.view(Ob * BLOCK, Ib * BLOCK)[:O, :I].contiguous(), scale_ObIb
