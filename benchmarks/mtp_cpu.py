"""Multi-token prediction on CPU: what one MTP module costs per training step, and what it learns.

Two copies of the ``configs/tiny.yaml`` model (same seed, same batches of the stdlib corpus) train side by side,
one with ``mtp_layers: 1``; steps alternate between them so both see the same machine load. Prints the step-time
ratio, the main next-token loss of both (``train/loss`` stays the main loss with MTP) and the depth-1 loss.

    python benchmarks/mtp_cpu.py [--steps 60]
"""

import argparse
import os
import time
import warnings

import torch
import yaml

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule

warnings.filterwarnings("ignore", message=".*self.log.*")  # no Trainer here: the module's logging is skipped


def build(mtp_layers: int) -> tuple[MoELanguageModel, torch.optim.Optimizer]:
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")) as f:
        fields = yaml.safe_load(f)["model"]["init_args"]["config"]
    torch.manual_seed(0)
    module = MoELanguageModel(MoEConfig(**{**fields, "mtp_layers": mtp_layers}))
    module.configure_model()
    return module.train(), torch.optim.AdamW(module.parameters(), lr=3e-3, betas=(0.9, 0.95))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=args.batch_size, max_tokens=400_000)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    runs = {0: build(0), 1: build(1)}
    seconds, main_loss, mtp_loss = {0: 0.0, 1: 0.0}, {0: [], 1: []}, []
    for step in range(args.steps):
        batch = next(loader)
        for depth, (module, optimizer) in runs.items():
            start = time.perf_counter()
            module._main_loss = None
            loss = module._loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:  # the first step warms up allocator and kernels
                seconds[depth] += time.perf_counter() - start
            main = loss if module._main_loss is None else module._main_loss
            main_loss[depth].append(main.item())
            if depth:
                mtp_loss.append((loss.item() - main.item()) / module.config.mtp_loss_weight)
    tail = max(1, args.steps // 6)
    print(f"steps {args.steps}, batch {args.batch_size} x 128 tokens, tiny config (dim 128, 4 layers, 8 experts)")
    timed = max(1, args.steps - 1)
    print(f"step time: no MTP {seconds[0] / timed * 1e3:.1f} ms, MTP depth 1 {seconds[1] / timed * 1e3:.1f} ms"
          f" (ratio {seconds[1] / seconds[0]:.2f})")
    for depth in (0, 1):
        print(f"main loss, mtp_layers={depth}: first {main_loss[depth][0]:.3f}, "
              f"mean of the last {tail} steps {sum(main_loss[depth][-tail:]) / tail:.3f}")
    print(f"depth-1 loss (token 2 ahead): first {mtp_loss[0]:.3f}, mean of the last {tail} {sum(mtp_loss[-tail:]) / tail:.3f}")


if __name__ == "__main__":
    main()
