"""Muon vs AdamW at equal steps on the tiny config: validation loss curves, as a table and a PNG.

    python benchmarks/muon_vs_adamw.py                       # trains configs/tiny.yaml and tiny-muon.yaml
    python benchmarks/muon_vs_adamw.py --adamw-lrs 3e-3,6e-3,1e-2,1.5e-2   # AdamW swept, Muon against the best
    python benchmarks/muon_vs_adamw.py --logs lightning_logs # only plot runs already logged (CSVLogger)
    python benchmarks/muon_vs_adamw.py --logs DIR --runs "AdamW=tiny,Muon=tiny-muon,Muon lr 0.003=other"

All runs share data, seed, schedule and step count; they differ only in the optimizer (and, swept, AdamW's
learning rate: tiny.yaml with ``--model.init_args.optimizer.init_args.lr``, logged as ``tiny-adamw-lr<lr>``). With
a sweep the baseline is the AdamW of lowest final validation loss, and the last line says how many tokens Muon took
to reach that loss (validation curves linearly interpolated between evaluations). The plot goes to
benchmarks/muon_vs_adamw.png when matplotlib is installed.
"""

import argparse
import csv
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = "AdamW=tiny,Muon=tiny-muon"  # label=logger name; the first is the baseline of the differences


def val_curve(metrics_csv: Path) -> dict[int, float]:
    """``{step: val/loss}`` from a CSVLogger metrics file (the step is the last step before validation)."""
    with metrics_csv.open() as f:
        return {int(row["step"]) + 1: float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")}


def latest_metrics(logs: Path, name: str) -> Path:
    versions = sorted((logs / name).glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not versions:
        raise SystemExit(f"no {logs / name}/version_*/metrics.csv: run without --logs to train it first")
    return versions[-1]


TOKENS_PER_STEP = 16 * 128  # tiny.yaml: data.batch_size x data.seq_len, one device


def steps_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The first step where ``curve`` (linearly interpolated between evaluations) is at or below ``target``."""
    points = sorted(curve.items())
    for (s0, l0), (s1, l1) in zip([(0, float("inf"))] + points, points):
        if l1 <= target:
            return float(s1) if l0 == float("inf") else s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, default=None, help="read existing CSV logs instead of training")
    parser.add_argument("--runs", default=RUNS, help="label=logger name pairs, comma-separated")
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--adamw-lrs", default=None, help="comma-separated AdamW learning rates to sweep on "
                        "tiny.yaml (replaces the AdamW run); Muon is compared with the best")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "muon_vs_adamw.png")
    args = parser.parse_args()
    runs = dict(pair.split("=") for pair in args.runs.split(","))
    commands = {name: [f"--config=configs/{name}.yaml"] for name in runs.values()}
    if args.adamw_lrs:
        sweep = {f"AdamW lr {lr}": f"tiny-adamw-lr{lr}" for lr in args.adamw_lrs.split(",")}
        commands = {name: ["--config=configs/tiny.yaml", f"--model.init_args.optimizer.init_args.lr={lr}",
                           f"--trainer.logger.init_args.name={name}"] for lr, name in
                    zip(args.adamw_lrs.split(","), sweep.values())} | {"tiny-muon": commands["tiny-muon"]}
        runs = sweep | {"Muon": "tiny-muon"}
    logs = args.logs
    if logs is None:
        logs = REPO / "lightning_logs"
        for words in commands.values():
            subprocess.run([sys.executable, "-m", "moe_lightning", "fit", *words,
                            f"--trainer.val_check_interval={args.val_every}", "--trainer.enable_progress_bar=false",
                            f"--trainer.logger.init_args.save_dir={logs}", "--trainer.enable_checkpointing=false"],
                           cwd=REPO, check=True)
    curves = {label: val_curve(latest_metrics(logs, name)) for label, name in runs.items()}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    finals = {label: curve[steps[-1]] for label, curve in curves.items()}
    adamw = [label for label in curves if label.startswith("AdamW")]
    base = min(adamw, key=finals.get) if args.adamw_lrs else next(iter(curves))
    curves = {base: curves[base]} | curves  # the baseline first
    print("validation loss; in brackets: minus " + base)
    print(f"{'step':>6s} " + " ".join(f"{label:>24s}" for label in curves))
    for step in steps:
        print(f"{step:6d} " + " ".join(f"{c[step]:14.4f} ({c[step] - curves[base][step]:+.4f})"
                                       for c in curves.values()))
    if args.adamw_lrs and "Muon" in curves:
        reached = steps_to_reach(curves["Muon"], finals[base])
        total = steps[-1] * TOKENS_PER_STEP
        said = "never" if reached is None else \
            f"at step {reached:.0f}: {reached * TOKENS_PER_STEP / 1e6:.2f}M tokens of {base}'s {total / 1e6:.2f}M"
        print(f"best AdamW: {base} (final {finals[base]:.4f}); Muon (final {finals['Muon']:.4f}) reaches "
              f"{finals[base]:.4f} {said}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, curve in curves.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=label)
    ax.set(xlabel="optimizer step", ylabel="validation loss (nats per token)", title="tiny config: Muon vs AdamW")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
