"""Muon vs AdamW at equal steps on the tiny config: validation loss curves, as a table and a PNG.

    python benchmarks/muon_vs_adamw.py                       # trains configs/tiny.yaml and tiny-muon.yaml
    python benchmarks/muon_vs_adamw.py --logs lightning_logs # only plot runs already logged (CSVLogger)
    python benchmarks/muon_vs_adamw.py --logs DIR --runs "AdamW=tiny,Muon=tiny-muon,Muon lr 0.003=other"

Both runs share data, seed, schedule and step count; they differ only in the optimizer. The plot goes to
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=Path, default=None, help="read existing CSV logs instead of training")
    parser.add_argument("--runs", default=RUNS, help="label=logger name pairs, comma-separated")
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "muon_vs_adamw.png")
    args = parser.parse_args()
    runs = dict(pair.split("=") for pair in args.runs.split(","))
    logs = args.logs
    if logs is None:
        logs = REPO / "lightning_logs"
        for config in runs.values():
            subprocess.run([sys.executable, "-m", "moe_lightning", "fit", "--config", f"configs/{config}.yaml",
                            f"--trainer.val_check_interval={args.val_every}",
                            f"--trainer.logger.init_args.save_dir={logs}", "--trainer.enable_checkpointing=false"],
                           cwd=REPO, check=True)
    curves = {label: val_curve(latest_metrics(logs, name)) for label, name in runs.items()}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    base = next(iter(curves))
    print("validation loss; in brackets: minus " + base)
    print(f"{'step':>6s} " + " ".join(f"{label:>24s}" for label in curves))
    for step in steps:
        print(f"{step:6d} " + " ".join(f"{c[step]:14.4f} ({c[step] - curves[base][step]:+.4f})"
                                       for c in curves.values()))
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
