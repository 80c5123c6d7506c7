"""The block activations each pipeline rank holds at its peak under each schedule, counted from torch's own action
order (``planner.pipeline.schedule_actions``), in micro-batches through the whole model.

    PYTHONPATH=$PWD python benchmarks/pipeline_activations.py [--size 2] [--microbatches 4]

A stage holds a micro-batch's activations from its forward (F) to its last backward for it: the full backward (B),
or the weight pass (W) where the schedule splits backward into I and W (the weight gradients read the inputs of
every matmul). With ``V`` stages a rank, each of the ``P·V`` stages holds ``1/(P·V)`` of the blocks (equal stages),
so a rank's count is its stages' micro-batches held together, over ``P·V``. Counted, not timed: no process runs.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_lightning.parallel.pipeline import SCHEDULES  # noqa: E402
from moe_lightning.planner.pipeline import schedule_actions  # noqa: E402


def peak_held(order: list[tuple[str, int, int]], stages: int) -> float:
    """The most micro-batches' activations one rank's ``order`` holds at once, over ``stages`` equal stages."""
    splits = any(kind == "W" for kind, _, _ in order)
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind == "B" or (splits and kind == "W") else 0
        peak = max(peak, held)
    return peak / stages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    for name, (_, style) in SCHEDULES.items():
        per_rank = 1 if style == "single" else 2
        orders = schedule_actions(name, args.size, args.microbatches, per_rank)
        peaks = [peak_held(order, args.size * per_rank) for order in orders]
        print(f"{name:<22} stages per rank {per_rank}: peak per rank " + ", ".join(f"{p:.3f}" for p in peaks))


if __name__ == "__main__":
    main()
