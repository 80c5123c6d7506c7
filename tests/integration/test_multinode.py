"""Two "nodes" on localhost: two torchrun agents (one process each) train the tiny config under FSDP2.

This is the documented multi-node launch, run for real: static rendezvous on 127.0.0.1, node ranks 0
and 1, the ``moe-lightning`` CLI with ``trainer.num_nodes=2`` and the FSDP2 strategy (gloo on CPU).
"""

import csv
import os
import re
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from lightning.fabric.plugins.environments import SLURMEnvironment

from tests.support.distributed import REPO_ROOT, run_nodes

STEPS = 2


def fit_tiny(tmp_path: Path, name: str, nodes: int, per_node: int) -> tuple[list[str], list[float]]:
    """``moe-lightning fit`` of configs/tiny.yaml under FSDP2 as ``nodes`` torchrun agents of ``per_node`` ranks;
    each agent's output and the logged per-step losses (the mean over ranks)."""
    cwd = tmp_path / name
    cwd.mkdir()
    fit = ["-m", "moe_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"),
           f"--trainer.num_nodes={nodes}", f"--trainer.devices={per_node}",
           "--trainer.strategy.class_path=moe_lightning.training.strategy.MoEFSDPStrategy",
           f"--trainer.max_steps={STEPS}", "--trainer.log_every_n_steps=1", "--trainer.enable_checkpointing=false",
           "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={cwd / 'logs'}",
           "--data.init_args.max_tokens=40000", "--data.init_args.batch_size=4"]
    logs = run_nodes(fit, nodes, per_node, cwd=cwd, timeout=300)
    with open(next((cwd / "logs").rglob("metrics.csv"))) as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    return logs, losses


@pytest.mark.slow  # multi-process; .ci/run runs it after the main suite
def test_two_nodes_one_process_each_train_tiny_with_fsdp2_as_one_node_of_two(tmp_path):
    logs, losses = fit_tiny(tmp_path, "two_nodes", nodes=2, per_node=1)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    assert "MoEFSDPStrategy: 1 replica(s) x 2 shard ranks" in logs[0]
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached." in logs[0]
    # Reference: the same 2 ranks on one node (same shards, same data per rank, same gloo reductions); only the
    # rendezvous and node ranks differ, so every step's loss agrees to fp32 round-off of a 2-rank mean.
    _, reference = fit_tiny(tmp_path, "one_node", nodes=1, per_node=2)
    assert len(losses) == len(reference) == STEPS
    assert losses == pytest.approx(reference, rel=1e-6, abs=0)  # measured: bit-identical


def test_slurm_script_gives_lightning_one_task_per_gpu():
    """The example batch script parses, and the environment srun gives its tasks satisfies SLURMEnvironment."""
    script = REPO_ROOT / "configs" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), flags=re.M))
    nodes, tasks_per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert tasks_per_node == int(options["gpus-per-node"])
    assert options["job-name"] not in ("bash", "interactive")
    rank = (nodes - 1) * tasks_per_node + 1  # the second task on the last node, as srun sets it up
    srun_env = dict(SLURM_NTASKS=nodes * tasks_per_node, SLURM_PROCID=rank, SLURM_LOCALID=1, SLURM_NODEID=nodes - 1,
                    SLURM_NODELIST="gpu[001-099]", SLURM_JOB_ID=4242, SLURM_NTASKS_PER_NODE=tasks_per_node,
                    SLURM_NNODES=nodes, SLURM_JOB_NAME=options["job-name"])
    with mock.patch.dict(os.environ, {k: str(v) for k, v in srun_env.items()}):  # restores MASTER_* too
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
        env = SLURMEnvironment()
        assert SLURMEnvironment.detect()
        env.validate_settings(num_devices=tasks_per_node, num_nodes=nodes)
        assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == \
            (nodes * tasks_per_node, rank, 1, nodes - 1)
        assert env.main_address == "gpu001"
