"""How long the training loop is blocked per sharded checkpoint: synchronous vs asynchronous saves.

    python benchmarks/checkpoint_async.py                  # 2 CPU processes, ~2-3 minutes on 2 busy cores
    python benchmarks/checkpoint_async.py --dim 384 --steps 11

Real processes (the strategy tests' run script), a checkpoint every ``--every`` optimizer steps without
``save_last`` (with it, the second save of a step waits for the first). "Blocked" is the time between the end
of a saving batch and the start of the next one, minus the same gap after a batch that saves nothing (an odd
step count puts no save on the last step, which fit waits for). "Step after save" is the next batch's own
time: on CPU the background write competes with it for the cores.
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


def measure(mode: str, args, tmp: Path) -> dict:
    config = dict(dim=args.dim, n_layers=args.layers, num_experts=args.experts, expert_hidden=args.dim,
                  ffn_hidden=2 * args.dim, max_seq_len=args.seq_len)
    out, ckpt_dir = tmp / f"{mode}.json", tmp / f"{mode}_ckpt"
    extra = ["--async-checkpoint"] if mode == "async" else []
    run_ranks(RUN, 2, "--batch-size", "2", "--seq-len", str(args.seq_len), "--max-steps", str(args.steps),
              "--config", json.dumps(config), "--ckpt-dir", str(ckpt_dir), "--every", str(args.every),
              "--no-save-last", *extra, "--out", str(out), timeout=1200)
    rows = json.loads(out.read_text())["batches"]
    after_save = [r for r in rows[1:] if r["batch"] % args.every == 0]  # batches that follow a save
    quiet = [r for r in rows[2:] if r["batch"] % args.every != 0]  # skip the first two: lazy initialisation
    base_gap = statistics.median(r["gap_before_s"] for r in quiet)
    state_mib = sum(f.stat().st_size for f in (ckpt_dir / f"step={args.every}.ckpt").iterdir()) / 2**20
    return {"mode": mode, "checkpoint_MiB": round(state_mib, 1),
            "blocked_s": round(statistics.median(r["gap_before_s"] for r in after_save) - base_gap, 3),
            "step_after_save_s": round(statistics.median(r["seconds"] for r in after_save), 3),
            "step_s": round(statistics.median(r["seconds"] for r in quiet), 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            results.append(measure(mode, args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    print(f"\nblocked per checkpoint ({results[0]['checkpoint_MiB']} MiB on disk, 2 processes): "
          f"sync {results[0]['blocked_s']:.3f} s, async {results[1]['blocked_s']:.3f} s")
    return results


if __name__ == "__main__":
    main()
