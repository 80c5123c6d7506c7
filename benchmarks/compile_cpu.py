"""Training steps per second on CPU, eager vs per-block ``torch.compile`` (Inductor), and the compile time.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/compile_cpu.py [--configs tiny small] [--steps 5]

For each config (``configs/<name>.yaml``: model shape, data batch size and sequence length) two copies of
the same initial model run forward, backward and an AdamW step on the same random batch, in fp32: eager,
then compiled with ``moe_lightning.parallel.compile.compile_blocks`` (``fullgraph=True``, Inductor). Compile time is
the compiled model's first step minus an eager step. One JSON line per config, printed as soon as it ends;
``first_loss_rel_diff`` compares the two models' loss on the first step (same weights, same batch).
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from moe_lightning.model import MoETransformer
from moe_lightning.parallel.compile import compile_blocks
from moe_lightning.planner.run_config import load_model_config

ROOT = Path(__file__).resolve().parents[1]


def step(model: MoETransformer, optimizer: torch.optim.Optimizer, tokens_BS: torch.Tensor) -> float:
    loss = F.cross_entropy(model(tokens_BS[:, :-1]).flatten(0, 1), tokens_BS[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def timed_steps(model, optimizer, tokens_BS, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, tokens_BS)
    return steps / (time.perf_counter() - start)


def measure(name: str, steps: int, batch_size: int | None) -> dict:
    path = ROOT / "configs" / f"{name}.yaml"
    config = load_model_config(str(path))
    data = yaml.safe_load(path.read_text())["data"]["init_args"]
    batch = batch_size or data["batch_size"]
    torch.manual_seed(0)
    eager = MoETransformer(config)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled.layers)
    tokens_BS = torch.randint(0, config.vocab_size, (batch, data["seq_len"] + 1))
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)}

    start = time.perf_counter()
    eager_loss = step(eager, optimizers[id(eager)], tokens_BS)
    eager_first = time.perf_counter() - start
    start = time.perf_counter()
    compiled_loss = step(compiled, optimizers[id(compiled)], tokens_BS)
    compiled_first = time.perf_counter() - start
    eager_rate = timed_steps(eager, optimizers[id(eager)], tokens_BS, steps)
    compiled_rate = timed_steps(compiled, optimizers[id(compiled)], tokens_BS, steps)
    return {"config": name, "tokens_per_step": batch * data["seq_len"], "steps_timed": steps,
            "eager_steps_per_s": round(eager_rate, 3), "compiled_steps_per_s": round(compiled_rate, 3),
            "speedup": round(compiled_rate / eager_rate, 3),
            "compile_s": round(compiled_first - 1 / eager_rate, 1), "eager_first_step_s": round(eager_first, 2),
            "first_loss_rel_diff": abs(compiled_loss - eager_loss) / abs(eager_loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None, help="override the configs' data batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.configs:
        print(json.dumps(measure(name, args.steps, args.batch_size)), flush=True)


if __name__ == "__main__":
    main()
