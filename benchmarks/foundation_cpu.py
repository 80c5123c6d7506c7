"""CPU throughput of the shipped tiny/small configs, and grouped-mm experts vs the per-expert loop.

    python benchmarks/foundation_cpu.py [--steps 10]

Both comparisons run side by side in one process, so their ratio is meaningful on a noisy machine.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from moe_lightning import MoEConfig, MoETransformer
from moe_lightning.model import GroupedExperts
from moe_lightning.planner.run_config import load_model_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load_config(name: str) -> tuple[MoEConfig, int, int]:
    raw = yaml.safe_load((CONFIGS / name).read_text())
    data = raw["data"]["init_args"]
    return load_model_config(CONFIGS / name), data["batch_size"], data["seq_len"]


def tokens_per_second(name: str, steps: int) -> float:
    config, batch, seq = load_config(name)
    torch.manual_seed(0)
    model = MoETransformer(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))

    def step():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * seq / (time.perf_counter() - start)


def experts_time(forward, x, counts, grad, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        torch.autograd.grad(forward(x, counts), x, grad)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in ("tiny.yaml", "small.yaml"):
        print(f"{name:12s} forward+backward: {tokens_per_second(name, args.steps):9.0f} tokens/s")

    config, batch, seq = load_config("small.yaml")
    experts = GroupedExperts(config.num_experts, config.dim, config.expert_hidden)
    experts.init_weights(0.02, 0.02)
    routed = batch * seq * config.top_k
    counts = torch.bincount(torch.randint(0, config.num_experts, (routed,)), minlength=config.num_experts)
    x = torch.randn(routed, config.dim, requires_grad=True)
    grad = torch.randn(routed, config.dim)
    for forward in (experts.forward, experts.forward_loop):  # warm-up both
        experts_time(forward, x, counts, grad, 1)
    grouped = experts_time(experts.forward, x, counts, grad, args.steps)
    loop = experts_time(experts.forward_loop, x, counts, grad, args.steps)
    print(f"experts ({config.num_experts} x [{config.dim}->{config.expert_hidden}], {routed} routed tokens), "
          f"forward+backward: grouped_mm {grouped * 1e3:.1f} ms, loop {loop * 1e3:.1f} ms, "
          f"speed-up {loop / grouped:.2f}x")


if __name__ == "__main__":
    main()
