"""Hierarchical vs flat expert dispatch on 2 "nodes" x 2 gloo ranks (two torchrun agents on one machine).

``benchmarks/ep_dispatch.py`` counts every byte each rank sends to another node or inside its node, the host
reads per MoE forward, and compares outputs and every gradient with the flat dispatcher and with one process
(the whole layer over the rank's tokens; expert gradients averaged over ranks). Tolerance: fp32 outputs and
gradients differ only by the order of sums (a token's expert outputs added per node then across nodes; an
expert's weight gradient over its rows in another order), so 1e-5 relative to the largest entry (measured:
~6e-7); with top-2 the forward sums are in the same order and the outputs are bitwise equal.
"""

import csv
import json

import pytest
import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import (AllToAllTokenDispatcher, expert_positions, node_identity, node_reach,
                                                    plan_layout)
from tests.support.collectives import recorded_schedule
from tests.support.distributed import REPO_ROOT, run_nodes, run_ranks


def run_two_nodes(*args: str, timeout: float = 300) -> list[dict]:
    logs = run_nodes([str(REPO_ROOT / "benchmarks" / "ep_dispatch.py"), *args], nodes=2, per_node=2, cwd=REPO_ROOT,
                     timeout=timeout)
    return [json.loads(line) for line in logs[0].splitlines() if line.startswith("{")]


def check(result: dict, tolerance: float) -> None:
    for kind in ("flat", "hierarchical"):
        r = result[kind]
        assert r["inter_bytes_per_rank"] == r["plan_inter_bytes_per_rank"], (kind, r)  # plan's count is exact
        assert r["intra_bytes_per_rank"] == r["plan_intra_bytes_per_rank"], (kind, r)
        assert r["host_reads_per_forward"] == 1, (kind, r)  # the one split-size read
    assert max(result["relative_max_differences"].values()) < tolerance, result
    assert result["hierarchical"]["inter_bytes_per_rank"] < result["flat"]["inter_bytes_per_rank"]


@pytest.mark.slow  # 2 processes as 2 nodes, profiled
def test_hierarchical_dispatch_crosses_nodes_once_per_node_and_equals_flat():
    """The one lean multi-process check: node-limited top-2 routing, fp32, one step of one MoE layer."""
    (result,) = run_two_nodes("--routing", "node-limited", "--tokens", "128")
    assert (result["nodes"], result["ranks_per_node"]) == (2, 2)
    check(result, 1e-5)
    assert result["forward_bitwise_equal"]
    # one node per token: flat sends both copies of a remote token, hierarchical one row (+ 16 B of routing)
    assert result["hierarchical_over_flat_inter"] <= 0.55, result
    # the step's 4 crossings of each token's row to its one remote node, plus routing metadata and counts
    assert result["crossings_per_step"] == 4
    minimum = result["minimum_inter_bytes_per_token_step"]
    assert minimum == 4 * result["minimum_bytes_per_token_one_way"]
    assert minimum <= result["hierarchical"]["inter_bytes_per_token"] <= 1.05 * minimum, result


@pytest.mark.extended  # multi-process, three routings twice
@pytest.mark.parametrize("options", [["--recompute"], ["--dtype", "bf16"]], ids=["fp32-recompute", "bf16"])
def test_every_routing_with_recompute_and_bf16(options):
    results = run_two_nodes("--tokens", "128", *options)
    assert [r["routing"] for r in results] == ["unrestricted", "node-limited", "empty-rank"]
    for result in results:
        # bf16: the one-process reference rounds its sums differently; hierarchical vs flat differ by the order
        # of a bf16 sum (a token's expert outputs per node, then across nodes): within one bf16 eps, 2^-7
        # (measured 1.4e-3 to 2.5e-3 relative to the largest entry, 256 tokens per rank)
        check(result, 1e-5 if "bf16" not in options else 2e-2)
        if "bf16" in options:
            assert result["relative_max_differences"]["hierarchical_vs_flat"] <= 8e-3, result


@pytest.mark.extended  # 4 processes; FP8 rounding and dispatch on one rank stay in the main suite
def test_fp8_dispatch_halves_the_dispatch_bytes_between_nodes():
    """bf16 layer, 2 x 2, node-limited top-2, FP8 dispatch: the forward dispatch hops' inter-node bytes (hidden row,
    routing weights and node-local expert ids; counted on the wire) are (D + 4 D/128 + 8K) / (2 D + 8K) of the
    bf16 run's: 148 / 272 = 0.544 at D = 128, K = 2 (<= 0.55). The combine and the backward stay bf16, so the
    step's inter-node bytes fall less (measured 0.88). Outputs vs the bf16 dispatch: within 2^-3 of the largest
    entry, e4m3's step (measured 3e-2)."""
    (result,) = run_two_nodes("--routing", "node-limited", "--tokens", "128", "--dtype", "bf16", "--fp8")
    check(result, 2e-2)
    assert result["fp8_over_hierarchical_dispatch_inter"] == pytest.approx((128 + 4 + 16) / (256 + 16), rel=1e-12)
    assert result["fp8_over_hierarchical_dispatch_inter"] <= 0.55
    assert result["fp8_over_hierarchical_inter"] < 0.95, result
    diffs = result["fp8_relative_max_differences"]
    assert 0 < diffs["y"] < 2 ** -3 and max(diffs.values()) < 2 ** -3, diffs


@pytest.mark.extended  # 2 processes, 8 cases of 6 profiled forwards each (~30-50 s on a loaded machine)
def test_transient_memory_falls_with_chunks_and_matches_the_hand_count():
    """``ep_dispatch.py --memory`` on 2 ranks (flat), fp32, dim 256, expert hidden 64, top-2, 2,048 tokens per rank;
    even routing and skewed (nearly every copy to rank 0: imbalance 1.99 of 2). Peak bytes allocated during one dispatcher
    forward (torch's CPU memory profiler, least of 5 runs): with 4 chunks below 1 chunk on every rank, and at 1
    chunk between the hand counts of ``ep_dispatch.hand_count`` without and with the combine's send buffer still
    held by gloo's worker thread when the output is allocated (a race the worker often loses on a loaded machine),
    plus 3 % for the index tensors it leaves out (measured 0.5 to 1.0 % above the matching count)."""
    logs = run_ranks(REPO_ROOT / "benchmarks" / "ep_dispatch.py", 2, "--memory", "--chunks", "4", "--tokens", "2048",
                     "--dim", "256", "--hidden", "64")
    results = {(r["memory"], r["chunks"]): r for r in map(json.loads, filter(lambda l: l.startswith("{"),
                                                                                 logs[0].splitlines()))}
    assert results[("skewed", 1)]["imbalance"] > 1.8 and results[("even", 1)]["imbalance"] < 1.1
    for routing in ("even", "skewed"):
        one, four = results[(routing, 1)], results[(routing, 4)]
        assert all(n < o for n, o in zip(four["peak_bytes"], one["peak_bytes"])), (one, four)
        for measured, (low, high) in zip(one["peak_bytes"], one["hand_count"]):
            assert low <= measured <= 1.03 * high, one
    busy, even = results[("skewed", 1)]["peak_bytes"][0], results[("even", 1)]["peak_bytes"][0]
    assert busy > 1.5 * even  # the busy receiver pays for the imbalance


def test_every_rank_plans_every_group_from_the_same_table():
    """6 ranks, 3 per node, ep 2 (the layout that hung): the group straddling the nodes is hierarchical 2 x 1, the
    others flat, decided from the whole table, so every rank creates the same sub-groups."""
    nodes = ["a", "a", "a", "b", "b", "b"]
    table = [(n, (2 * (r // 2), 2 * (r // 2) + 1)) for r, n in enumerate(nodes)]
    assert plan_layout(table) == {(0, 1): "within one node of 2 ranks", (2, 3): [[2], [3]],
                                  (4, 5): "within one node of 2 ranks"}
    # ep 4 over nodes of 3 ranks: 3 + 1 on the nodes; flat, and the reason names the field and the sizes that work
    why = plan_layout([("a", (0, 1, 2, 3))] * 3 + [("b", (0, 1, 2, 3))])[(0, 1, 2, 3)]
    assert "strategy.expert_parallel_size=4 puts 3 + 1 ranks" in why and "(1/3 GPUs per node)" in why
    assert "dividing or a multiple of the GPUs per node" in why
    # SLURM's cyclic placement: ranks 0, 2, 4, 6 on one node, 1, 3, 5, 7 on the other; ep 8 = 2 nodes x 4
    cyclic = [("node0" if r % 2 == 0 else "node1", tuple(range(8))) for r in range(8)]
    assert plan_layout(cyclic) == {tuple(range(8)): [[0, 2, 4, 6], [1, 3, 5, 7]]}


def test_expert_positions_number_experts_node_major_for_any_placement():
    """Rank 2 of a cyclic 2 x 2 group ([0, 2] on one node, [1, 3] on the other), 1 expert per rank: its node's
    experts (0 and 2) come first, then the other node's (1 and 3); node-major groups need no renumbering."""
    assert expert_positions([[0, 2], [1, 3]], [0, 1, 2, 3], 1, me=2) == [0, 2, 1, 3]
    assert expert_positions([[0, 1], [2, 3]], [0, 1, 2, 3], 2, me=3) is None
    # [0, 3] and [1, 2]: local index 1 sees node order (rank 2 < rank 3) reversed
    assert expert_positions([[0, 3], [1, 2]], [0, 1, 2, 3], 1, me=3) == [2, 0, 1, 3]


def test_node_identity_is_the_launchers(monkeypatch):
    for name in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NODE_RANK", "3")
    assert node_identity() == "NODE_RANK=3"
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's wins
    assert node_identity() == "GROUP_RANK=1"


def test_node_reach_warns_when_groups_straddle_nodes():
    """configs/1t.yaml's former 8 groups of 48 experts over 24 nodes of 16: each group spans 3 nodes."""
    reach, warning = node_reach(8, 4, 384, 8, 24)
    assert "up to 8 of 24 nodes" in reach
    assert "n_expert_groups=8" in warning and "set n_expert_groups=24" in warning and "changes the model" in warning
    assert node_reach(24, 4, 384, 8, 24) == ("node-limited routing: 24 groups of 16 experts, each within one node; "
                                             "a token reaches at most 4 of 24 nodes", None)
    assert node_reach(48, 4, 384, 8, 24)[1] is None  # two groups per node still bound the nodes
    assert node_reach(1, 1, 384, 8, 24) == ("unrestricted routing: a token reaches up to 8 of 24 nodes", None)


def fit(tmp, name: str, nodes: int, per_node: int, *args: str) -> list[float]:
    """configs/tiny-fsdp.yaml as ``nodes`` torchrun agents of ``per_node`` processes; returns the logged losses."""
    command = ["-m", "moe_lightning", "fit", "--config", str(REPO_ROOT / "configs" / "tiny-fsdp.yaml"),
               f"--trainer.num_nodes={nodes}", f"--trainer.devices={per_node}", "--trainer.max_steps=3",
               "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
               f"--trainer.logger.init_args.save_dir={tmp / name}", "--data.init_args.max_tokens=40000",
               "--data.init_args.batch_size=2", "--trainer.strategy.init_args.expert_parallel_size=4",
               "--model.init_args.config.n_expert_groups=2", "--model.init_args.config.n_limited_groups=1", *args]
    logs = run_nodes(command, nodes, per_node, cwd=tmp)
    with open(next((tmp / name).rglob("metrics.csv"))) as f:
        return logs[0], [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.mark.extended  # three 4-process Lightning fits
def test_fit_on_two_nodes_equals_one_node_with_mtp_and_activation_offload(tmp_path):
    """Hierarchical (2 nodes x 2) and flat (1 node x 4) dispatch train the same steps: MTP block, recompute."""
    extra = ["--model.init_args.config.mtp_layers=1",
             "--trainer.callbacks+=moe_lightning.training.callbacks.ActivationOffload",
             "--trainer.callbacks.min_offload_bytes=0"]
    log, two_nodes = fit(tmp_path, "two", 2, 2, *extra)
    assert "hierarchical dispatch over 2 nodes x 2 ranks" in log and "a token reaches at most 1 of 2 nodes" in log
    log, one_node = fit(tmp_path, "one", 1, 4, *extra)
    assert "flat all-to-all dispatch within one node of 4 ranks" in log
    assert len(two_nodes) == 3 and two_nodes == pytest.approx(one_node, rel=1e-5)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_shared_experts_run_while_the_token_exchange_is_in_flight_forward_and_backward(one_rank_group, monkeypatch):
    """The order a GPU would overlap in: the token exchange is launched, the shared experts run (forward, and in
    backward their backward), then the exchange is awaited. One gloo rank; the routing weights travel with the
    rows (one exchange of packed rows, not two), and one host read per forward."""
    events = []
    recorded_schedule(monkeypatch, events, describe=lambda rows: f"{rows.shape[0]}x{rows.shape[1]} {rows.dtype}")
    torch.manual_seed(0)
    config = MoEConfig(dim=16, num_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1)
    moe = MoELayer(config)
    moe.init_weights(std=16 ** -0.5, out_std=8 ** -0.5)
    moe.dispatcher = AllToAllTokenDispatcher(one_rank_group)
    shared = moe.shared_experts
    shared.register_forward_hook(lambda *_: events.append("shared forward"))
    shared.register_full_backward_hook(lambda *_: events.append("shared backward"))
    x = torch.randn(1, 5, 16, requires_grad=True)
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, _orig=torch.Tensor.tolist: reads.append(1) or _orig(t))
    y = moe(x)
    assert len(reads) == 1
    assert events == ["counts", "launch 10x68 torch.uint8", "shared forward", "wait 10",  # 16 fp32 + weight: 68 B
                      "launch 10x16 torch.float32", "wait 10"]  # the experts' outputs back
    events.clear()
    (y * torch.randn_like(y)).sum().backward()
    assert events == ["launch 10x16 torch.float32", "wait 10",  # the outputs' gradients to the experts
                      "launch 10x68 torch.uint8", "shared backward", "wait 10"]  # rows' and weights' back
    reference = MoELayer(config)
    reference.load_state_dict(moe.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(reference(x_ref), y, rtol=0, atol=0)


@pytest.mark.extended  # a 2-process Lightning fit
def test_host_reads_with_hierarchical_dispatch_are_one_split_size_read_per_moe_forward():
    """tests/training/test_host_syncs.py's harness at ep = 2 over 2 nodes of 1 rank (the intra-node hop is the rank itself):
    per step, one read per MoE layer per forward (forward and ActivationOffload's recompute) and no other read
    from the MoE layer or the dispatcher."""
    logs = run_nodes([str(REPO_ROOT / "tests" / "launchers" / "ep_host_syncs_run.py")], nodes=2, per_node=1, cwd=REPO_ROOT)
    assert "hierarchical dispatch over 2 nodes x 1 ranks" in logs[0]
    result = json.loads(next(line for line in logs[0].splitlines() if line.startswith("{")))
    assert len(result["steps"]) == 3
    for reads in result["steps"]:
        ours = {site: n for site, n in reads.items() if "expert_parallel.py" in site or "moe.py" in site}
        assert ours == {"tolist expert_parallel.py:__call__": 2 * result["moe_layers"]}, reads
