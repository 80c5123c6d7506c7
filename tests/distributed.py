"""Launch real multi-process jobs from tests: subprocesses, clean environment, a free port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment minus anything pytest or a launcher set that would confuse children."""
    drop = ("PYTEST_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "TORCHELASTIC",
            "SLURM_", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="", **extra)
    return env


def run_ranks(script: str | Path, world_size: int, *args: str, timeout: float = 300) -> list[str]:
    """Run ``python script args`` as ``world_size`` ranks (env:// rendezvous); return each rank's stdout.

    Raises with every rank's output if any rank fails, so the real error shows in the test report.
    """
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode != 0 for p in procs):
        report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-4000:]}"
                           for r, (p, out) in enumerate(zip(procs, outputs)))
        raise RuntimeError(f"distributed run of {script} failed:\n{report}")
    return outputs
