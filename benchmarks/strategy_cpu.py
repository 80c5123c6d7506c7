"""CPU (gloo) step time and bytes communicated per optimizer step for FSDP, HSDP and expert parallelism.

    python benchmarks/strategy_cpu.py            # the table below, ~2-3 minutes on 2 cores
    python benchmarks/strategy_cpu.py --steps 10 --dim 256

Every layout trains the same small model on the same global batch (real processes, the run script
of the strategy tests). Bytes are per rank and per optimizer step: the gathered output of each
all-gather, the full input of each reduce-scatter, all-reduce and all-to-all buffers. On CPU the
processes share the cores, so step times compare layouts' overheads, not GPU speed.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.support.distributed import run_ranks  # noqa: E402

RUN = REPO / "tests" / "strategy_run.py"
LAYOUTS = [  # name, world size, strategy arguments
    ("FSDP", 2, []),
    ("FSDP", 4, []),
    ("HSDP 2x2", 4, ["--replicate", "2"]),
    ("EP=2", 2, ["--ep", "2"]),
    ("EP=2 x efsdp 2", 4, ["--ep", "2"]),
]
KINDS = {"all-gather": ("all_gather_single", "all_gather_into_tensor"),
         "reduce-scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
         "all-reduce": ("all_reduce",), "all-to-all": ("all_to_all_single",)}


def measure(world: int, extra: list[str], args, out: Path) -> dict:
    config = dict(dim=args.dim, n_layers=args.layers, num_experts=args.experts, expert_hidden=args.dim,
                  ffn_hidden=2 * args.dim, max_seq_len=args.seq_len)
    run_ranks(RUN, world, "--batch-size", str(args.global_batch // world), "--seq-len", str(args.seq_len),
              "--max-steps", str(args.steps), "--config", json.dumps(config), *extra, "--out", str(out),
              timeout=1200)
    rows = json.loads(out.read_text())["batches"][1:]  # the first step includes lazy initialisation
    mib = {kind: statistics.mean(sum(r["bytes"].get(n, 0) for n in names) for r in rows) / 2**20
           for kind, names in KINDS.items()}
    return {"step_s": statistics.median(r["seconds"] for r in rows), "MiB": mib}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, world, extra in LAYOUTS:
            results.append({"layout": name, "world": world, **measure(world, extra, args, Path(tmp) / "out.json")})
    print(f"dim={args.dim} layers={args.layers} experts={args.experts} seq={args.seq_len} "
          f"global batch={args.global_batch}; MiB per rank per optimizer step")
    header = "| layout | ranks | step (s) | " + " | ".join(KINDS) + " | total |"
    print(header + "\n" + "|---" * (header.count("|") - 1) + "|")
    for r in results:
        cells = " | ".join(f"{r['MiB'][k]:.2f}" for k in KINDS)
        print(f"| {r['layout']} | {r['world']} | {r['step_s']:.3f} | {cells} | {sum(r['MiB'].values()):.2f} |")
    return results


if __name__ == "__main__":
    main()
