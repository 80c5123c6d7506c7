"""Start-up cost of each ``moe-lightning`` command: the import time of the module it runs, in a fresh interpreter.

    python benchmarks/cli_import.py [--repeats 5]

For every command: the median wall time of ``import <its module>`` in a new ``python`` process (what the command
pays before doing any work), and whether that import pulled in Lightning. Also the whole ``moe-lightning --help``
(interpreter start included) and the baselines ``python -c pass`` and ``import torch``. The machine's load
average is printed with the figures, because on a shared machine it moves them more than anything else.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moe_lightning.commands.main import EXTRA_COMMANDS, TRAINER_COMMANDS  # noqa: E402 (light: no torch)

PROBE = ("import sys, time; t = time.perf_counter(); import {module}; "
         "print(time.perf_counter() - t, any(m.split('.')[0] == 'lightning' for m in sys.modules))")


def import_time(module: str) -> tuple[float, bool]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), out[1] == "True"


def wall_time(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    rows = [(command, target.split(":")[0]) for command, target in EXTRA_COMMANDS.items()]
    rows += [("/".join(TRAINER_COMMANDS), "moe_lightning.commands.cli")]
    rows += [("(baseline) import torch", "torch")]
    print(f"{'command':<34} {'module':<30} {'import s (median)':>18}  lightning")
    for command, module in rows:
        runs = [import_time(module) for _ in range(args.repeats)]
        print(f"{command:<34} {module:<30} {statistics.median(t for t, _ in runs):>18.2f}  "
              f"{'yes' if runs[0][1] else 'no'}")
    for label, argv in (("python -c pass", ["-c", "pass"]), ("moe-lightning --help", ["-m", "moe_lightning", "--help"])):
        print(f"{label:<34} {'(whole process)':<30} {statistics.median(wall_time(argv) for _ in range(args.repeats)):>18.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
