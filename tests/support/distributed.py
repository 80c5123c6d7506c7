"""Launch real multi-process jobs from tests: subprocesses, clean environment, a free port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO_ROOT / "tests" / "launchers"


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
    return outputs_of(procs, timeout, "rank", f"distributed run of {script}")


def outputs_of(procs: list[subprocess.Popen], timeout: float, each: str, what: str) -> list[str]:
    """Every process's output; none outlives this call. Raises with all outputs if any process failed, so the real
    error shows in the test report."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode != 0 for p in procs):
        report = "\n".join(f"--- {each} {r} (exit {p.returncode}) ---\n{out[-4000:]}"
                           for r, (p, out) in enumerate(zip(procs, outputs)))
        raise RuntimeError(f"{what} failed:\n{report}")
    return outputs


def run_nodes(command: list[str], nodes: int, per_node: int, cwd: Path, timeout: float = 600) -> list[str]:
    """Run ``python <command>`` under ``torch.distributed.run`` as ``nodes`` agents of ``per_node`` ranks on this
    machine (a multi-node job in miniature: each agent a node, with its own local ranks); return each agent's
    output, raising with all of them if any failed."""
    port = str(free_port())
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
         f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}", *command],
        cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(nodes)]
    return outputs_of(agents, timeout, "node", f"{nodes}-node run of {' '.join(command)}")
