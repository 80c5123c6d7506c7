"""Bytes per token one block keeps for backward, per half, before and after the lean autograd functions.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/block_memory.py [--shapes tiny 16b 1t] [--tokens 64]

Method. One block of each config (``configs/{tiny,16b,1t}.yaml``) is built in bf16, as FSDP's mixed
precision hands parameters to the compute, and run forward on random bf16 input inside saved-tensor hooks
that record every distinct storage autograd keeps (a storage and its views counted once; parameters
excluded, and the attention half's input, which is the block input: a boundary activation counted apart).
"Before" runs the same modules through the plain-autograd forwards of commit 437294b
(``tests/support/block_reference.py``). Halves: attention = ``x + attention(attention_norm(x))``; FFN =
``h + ffn(ffn_norm(h))`` with a MoE or dense FFN.

- Per-token bytes are the difference between two token counts (``T`` and ``2T``) divided by ``T``; the
  constant (what does not grow with tokens, e.g. the router weight's fp32 copy before) is what remains.
- Routed experts: the 16b and 1t layers are built with fewer experts than configured (16 instead of
  64/384, keeping group-limited routing valid) so their weights fit in host memory (the 1t layer's 384
  experts are 34 GB in bf16). The only per-token tensor whose size depends on E is the router's fp32
  score row, ``4·E`` bytes, so the printed MoE figures add ``4·(E_config - E_built)`` per token exactly;
  per-expert constants (offsets) are left out.
- Attention: on CPU, SDPA takes the math kernel for MLA (query/key and value widths differ) and keeps the
  ``S × S`` probabilities, which GPU fused kernels never store. SDPA is therefore replaced during the
  measurement by an autograd function keeping what the fused kernels keep (q, k, v, the output and an fp32
  log-sum-exp, ``[B, H, S]``), so the attention figures are what a GPU run keeps.
- "plan" is ``plan.block_working_set_bytes`` per token for the configured shape.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_lightning.model import MoEConfig  # noqa: E402
from moe_lightning.model.transformer import Block  # noqa: E402
from moe_lightning.planner.plan import block_working_set_bytes
from moe_lightning.planner.run_config import load_model_config  # noqa: E402
from tests.support.block_reference import half_saved_bytes  # noqa: E402

BUILT_EXPERTS = 16


def build_block(config: MoEConfig, moe: bool) -> Block:
    with torch.device("meta"):
        block = Block(config, config.n_dense_layers if moe else 0)
    block.to_empty(device="cpu").to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 1 / p.shape[-1] ** 0.5) if p.dim() > 1 else p.fill_(1.0)
        for b in block.buffers():
            b.zero_()
    return block


def half_bytes(block: Block, tokens: int, half: str, plain: bool) -> int:
    x = torch.randn(1, tokens, block.ffn_norm.weight.shape[0], dtype=torch.bfloat16, requires_grad=True)
    return half_saved_bytes(block, x, half, plain)


def per_token(block: Block, tokens: int, half: str, plain: bool) -> tuple[float, float]:
    """(bytes per token, constant bytes) from two token counts."""
    one, two = (half_bytes(block, n, half, plain) for n in (tokens, 2 * tokens))
    slope = (two - one) / tokens
    return slope, one - slope * tokens


def shape_config(name: str) -> tuple[MoEConfig, MoEConfig]:
    """The config, and the one actually built (fewer routed experts, see the module docstring)."""
    config = load_model_config(str(ROOT / "configs" / f"{name}.yaml"))
    if config.num_experts <= BUILT_EXPERTS:
        return config, config
    return config, dataclasses.replace(config, num_experts=BUILT_EXPERTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "16b", "1t"])
    parser.add_argument("--tokens", type=int, default=64, help="T: measured at T and 2T tokens")
    args = parser.parse_args()
    print(f"{'shape':<6}{'half':<11}{'before B/token':>16}{'after B/token':>15}{'after/before':>14}"
          f"{'plan B/token':>14}{'const before':>14}{'const after':>13}")
    for name in args.shapes:
        config, built = shape_config(name)
        halves = [("moe", True)] + ([("dense", False)] if config.n_dense_layers else [])
        for label, moe in halves:
            block = build_block(built, moe)
            parts = [("attention", "attention")] if moe else []
            parts.append((label, "ffn"))
            for row, half in parts:
                extra = 4 * (config.num_experts - built.num_experts) if half == "ffn" and moe else 0
                before, const_before = per_token(block, args.tokens, half, plain=True)
                after, const_after = per_token(block, args.tokens, half, plain=False)
                before, after = before + extra, after + extra
                plan = block_working_set_bytes(config, 1, moe, part=half)
                print(f"{name:<6}{row:<11}{before:>16,.0f}{after:>15,.0f}{after / before:>14.3f}"
                      f"{plan:>14,}{const_before:>14,.0f}{const_after:>13,.0f}", flush=True)
            del block


if __name__ == "__main__":
    main()
