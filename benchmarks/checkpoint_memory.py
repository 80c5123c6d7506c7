"""Peak host memory of writing a single-file checkpoint and of reading the model out of one.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/checkpoint_memory.py [--mib 400]

A ``.ckpt`` of ``--mib`` MiB (one optimizer tensor, no weights, as in a resumable Lightning checkpoint whose
Adam state dwarfs nothing else) is written with ``checkpoint.save_file`` and then read with
``loading.read_checkpoint`` (what ``generate`` and ``export`` call), each in a fresh process. Printed: the growth
of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the imports) during
the call. Bytes, not time: the figure does not depend on the machine's load. Linux only.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import re, sys
from pathlib import Path
import torch
from moe_lightning.commands.loading import read_checkpoint
from moe_lightning.checkpoint.commit import save_file

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

what, path, mib = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
if what == "save":
    state = {"global_step": 1, "hyper_parameters": {"config": {"dim": 64, "n_layers": 1, "vocab_size": 256}},
             "state_dict": {}, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(mib * 2**18)}}}]}
Path("/proc/self/clear_refs").write_text("5")
before = peak()
save_file(state, path) if what == "save" else read_checkpoint(path)
print(peak() - before)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=400, help="size of the optimizer tensor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big.ckpt"
        for what, label in (("save", "save_file"), ("read", "read_checkpoint (model only)")):
            out = subprocess.run([sys.executable, "-c", CHILD, what, str(path), str(args.mib)], cwd=REPO, text=True,
                                 check=True, capture_output=True).stdout
            print(f"{label:30s} {args.mib} MiB checkpoint: peak RSS +{int(out.split()[-1]) / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()
