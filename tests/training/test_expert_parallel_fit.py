"""``moe-lightning fit`` (configs/tiny-fsdp.yaml, gloo) with several expert-parallel groups, as configs/1t.yaml runs
them, against one process over the same sequences (ranks take every world-th sequence of the global order, so one
process with the whole global batch sees the same 8 sequences a step).

Tolerance: fp32 on CPU. The runs compute the same terms and sum them in another order (expert rows grouped by
source rank and chunk, gradients reduce-scattered over the ranks), so per-step losses differ by rounding: rel 1e-5
(measured: 1.9e-6 for replicate 2 x EP 2, <= 1.6e-7 for the others, resumed steps bitwise equal to the run they
resume) while a real error is far larger (an expert gradient off by the ep factor, a
group missing from the expert FSDP reduction, or a lost balancing-bias update moves the loss by > 1e-3). A resumed
run repeats the uninterrupted run's arithmetic at another layout: the same tolerance.
"""

import json
from pathlib import Path

import pytest

from moe_lightning.planner.plan import Cluster, Workload, plan
from moe_lightning.planner.run_config import load_model_config
from tests.support.distributed import REPO_ROOT, run_nodes

CONFIG = REPO_ROOT / "configs" / "tiny-fsdp.yaml"
GLOBAL_BATCH, STEPS, RTOL = 8, 4, 1e-5


def fit(tmp: Path, name: str, nodes: int, per_node: int, ep: int, *args: str) -> tuple[str, dict]:
    """``fit`` as ``nodes`` torchrun agents of ``per_node`` processes, ``GLOBAL_BATCH`` sequences a step; returns
    rank 0's log and the probe's record (tests/launchers/ep_fit_probe.py)."""
    out = tmp / name / "run.json"
    out.parent.mkdir()
    world = nodes * per_node
    command = ["-m", "moe_lightning", "fit", "--config", str(CONFIG), f"--trainer.num_nodes={nodes}",
               f"--trainer.devices={per_node}", f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0",
               "--trainer.enable_progress_bar=false", "--trainer.logger=false",
               "--data.init_args.max_tokens=40000", f"--data.init_args.batch_size={GLOBAL_BATCH // world}",
               f"--trainer.strategy.init_args.expert_parallel_size={ep}",
               "--trainer.callbacks+=tests.launchers.ep_fit_probe.EPFitProbe", f"--trainer.callbacks.out={out}",
               *args]
    logs = run_nodes(command, nodes, per_node, cwd=out.parent, timeout=900)
    return logs[0], json.loads(out.read_text())


def losses(run: dict) -> list[float]:
    return [row["loss"] for row in run["rows"]]


def assert_same_losses(got: list[float], want: list[float]) -> None:
    """Per-step losses equal within ``RTOL``; prints the largest relative difference (``pytest -s``)."""
    assert len(got) == len(want) > 0
    print(f"largest relative loss difference: {max(abs(a - b) / abs(b) for a, b in zip(got, want)):.2e}")
    assert got == pytest.approx(want, rel=RTOL)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    """One process, expert parallelism off, the whole global batch."""
    return fit(tmp_path_factory.mktemp("one"), "one", 1, 1, 1)[1]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> dict:
    """EP 2 on 4 ranks, a checkpoint after step 2."""
    tmp = tmp_path_factory.mktemp("ep2")
    log, run = fit(tmp, "ep2", 1, 4, 2, "--trainer.callbacks.save_at_steps=[2]")
    return {"log": log, "run": run, "checkpoint": tmp / "ep2" / "step=2.ckpt"}


@pytest.mark.extended  # a 4-process fit
def test_ep_2_on_4_ranks_shards_experts_across_groups_equals_one_process(ep2, one):
    """Two EP groups ({0, 1}, {2, 3}); each expert block FSDP-sharded over the 2 ranks holding it (one per group).
    Also: the bytes each rank holds of sharded parameters, gradients and AdamW state equal ``plan``'s rows for the
    same configuration (its formula: 4, 4 and 8 bytes per parameter over the shard size; FSDP pads nothing at these
    shapes), so plan's memory rows are checked against a run, not against themselves."""
    log, run = ep2["log"], ep2["run"]
    assert "flat all-to-all dispatch within one node of 2 ranks" in log, log[-3000:]
    assert_same_losses(losses(run), losses(one))
    config = load_model_config(CONFIG)
    rows = plan(config, Cluster(nodes=1, gpus_per_node=4, expert_parallel_size=2),
                Workload(micro_batch=GLOBAL_BATCH // 4, seq_len=128, optimizer="adamw"))["memory"]["without_offload"]
    expected = {"parameters": rows["gpu_bytes"]["sharded parameters (fp32)"],
                "gradients": rows["gpu_bytes"]["gradients (fp32)"],
                "optimizer_state": rows["gpu_bytes"]["optimizer state (adamw)"]}
    assert len(run["held"]) == 4
    for held in run["held"]:
        assert held == expected, (held, expected)


@pytest.mark.slow  # a 4-process fit
def test_replicate_2_by_ep_2_equals_one_process(tmp_path, one):
    """HSDP replicas {0, 1} and {2, 3}, each one EP group of 2: experts and dense layers replicated across them."""
    log, run = fit(tmp_path, "hsdp", 1, 4, 2, "--trainer.strategy.init_args.replicate_size=2")
    assert "flat all-to-all dispatch within one node of 2 ranks" in log, log[-3000:]
    assert_same_losses(losses(run), losses(one))


@pytest.mark.extended  # a 4-process fit
def test_two_hierarchical_groups_across_nodes_equal_one_process(tmp_path, one):
    """4 torchrun agents ("nodes") of 1 rank, EP 2: the groups {0, 1} and {2, 3} each span 2 nodes, so both
    dispatch hierarchically, with the expert blocks FSDP-sharded across the groups (1t.yaml's shape in miniature:
    several hierarchical groups, expert FSDP over them). With node-limited routing (a group per node)."""
    log, run = fit(tmp_path, "hier", 4, 1, 2, "--model.init_args.config.n_expert_groups=2",
                   "--model.init_args.config.n_limited_groups=1")
    assert "hierarchical dispatch over 2 nodes x 1 ranks" in log, log[-3000:]
    _, flat = fit(tmp_path, "flat", 1, 1, 1, "--model.init_args.config.n_expert_groups=2",
                  "--model.init_args.config.n_limited_groups=1")
    assert_same_losses(losses(run), losses(flat))


@pytest.mark.extended  # an 8-process fit
def test_two_hierarchical_groups_of_two_nodes_by_two_equal_one_process(tmp_path):
    """4 torchrun agents of 2 ranks, EP 4: the groups {0..3} and {4..7} each span 2 nodes x 2 ranks (both hops
    real: inter-node between the nodes, intra-node inside each), expert blocks FSDP-sharded across the groups."""
    routing = ("--model.init_args.config.n_expert_groups=2", "--model.init_args.config.n_limited_groups=1")
    log, run = fit(tmp_path, "hier", 4, 2, 4, *routing)
    assert "hierarchical dispatch over 2 nodes x 2 ranks" in log, log[-3000:]
    _, flat = fit(tmp_path, "flat", 1, 1, 1, *routing)
    assert_same_losses(losses(run), losses(flat))


@pytest.mark.extended  # two 2-process fits
def test_a_checkpoint_at_ep_1_resumes_at_ep_2_exactly(tmp_path, one):
    """2 ranks: FSDP only (EP 1), checkpoint after step 2; resumed at EP 2 (each rank keeps half the experts, read
    from the sharded checkpoint): steps 3 and 4 equal the uninterrupted run's and one process's."""
    _, source = fit(tmp_path, "ep1", 1, 2, 1, "--trainer.callbacks.save_at_steps=[2]")
    assert_same_losses(losses(source), losses(one))
    log, resumed = fit(tmp_path, "ep1to2", 1, 2, 2, f"--ckpt_path={tmp_path / 'ep1' / 'step=2.ckpt'}")
    assert [row["step"] for row in resumed["rows"]] == [3, 4]
    assert_same_losses(losses(resumed), losses(source)[2:])


@pytest.mark.extended  # a 4-process fit (and the EP 2 run it resumes)
def test_a_checkpoint_at_ep_2_resumes_at_ep_4_exactly(tmp_path, ep2, one):
    log, resumed = fit(tmp_path, "ep2to4", 1, 4, 4, f"--ckpt_path={ep2['checkpoint']}")
    assert "within one node of 4 ranks" in log
    assert [row["step"] for row in resumed["rows"]] == [3, 4]
    assert_same_losses(losses(resumed), losses(ep2["run"])[2:])
    assert_same_losses(losses(resumed), losses(one)[2:])
