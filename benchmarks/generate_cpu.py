"""Generation speed on CPU: KV cache vs full recomputation, GQA and MLA, at the tiny config's width.

    python benchmarks/generate_cpu.py [--new-tokens 512] [--prompt 16]

The tiny config's model (dim 128, 4 layers, 8 experts top-2) with ``max_seq_len`` raised so prompt and
continuation fit one window: every uncached step recomputes the whole context, every cached step feeds one
token. Both run in the same process on the same weights; the greedy tokens are checked to be identical.
"""

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from moe_lightning import MoETransformer
from moe_lightning.planner.run_config import load_model_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MLA = dict(attention="mla", q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)


def timed_generate(model: MoETransformer, prompt, new_tokens: int, use_cache: bool):
    start = time.perf_counter()
    out = model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
    return out, new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=16)
    args = parser.parse_args()
    base = load_model_config(CONFIGS / "tiny.yaml")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy, fp32")
    for name, overrides in (("gqa", {}), ("mla", MLA)):
        config = dataclasses.replace(base, **overrides, max_seq_len=args.prompt + args.new_tokens, init_std=0.3)
        torch.manual_seed(0)
        model = MoETransformer(config).eval()
        prompt = torch.randint(0, 256, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        cached, cached_tps = timed_generate(model, prompt, args.new_tokens, True)
        uncached, uncached_tps = timed_generate(model, prompt, args.new_tokens, False)
        print(f"{name}: cached {cached_tps:7.1f} tok/s, uncached {uncached_tps:7.1f} tok/s, "
              f"speed-up {cached_tps / uncached_tps:.1f}x, identical tokens: {torch.equal(cached, uncached)}")


if __name__ == "__main__":
    main()
