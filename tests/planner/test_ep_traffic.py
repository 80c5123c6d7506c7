"""``plan``'s expert exchange (``planner/ep_traffic.py``): distinct nodes per token, bytes per GPU and step at
``configs/1t.yaml`` recomputed by hand, and the layouts it cannot price said in one line. The bytes the dispatchers
really send are compared with these formulas in ``tests/parallel/test_expert_parallel.py``."""

import pytest

from moe_lightning.model import MoEConfig
from moe_lightning.planner import ep_traffic
from moe_lightning.planner.plan import main
from tests.support.distributed import REPO_ROOT


def test_plan_prices_distinct_nodes_exactly_for_uniform_routing():
    """Expected distinct nodes per token: unrestricted top-k over nodes, and node-aligned groups (at most M)."""
    unrestricted = MoEConfig(num_experts=8, top_k=2)
    # 2 nodes of 4 experts, 2 of 8 experts: P(both on one node) = 2 * C(4,2)/C(8,2) = 12/28
    assert ep_traffic.expected_nodes_per_token(unrestricted, 2) == pytest.approx(2 - 12 / 28, rel=1e-12)
    limited = MoEConfig(num_experts=8, top_k=2, n_expert_groups=2, n_limited_groups=1)
    assert ep_traffic.expected_nodes_per_token(limited, 2) == 1
    one_t = MoEConfig(num_experts=384, top_k=8, n_expert_groups=24, n_limited_groups=4)
    assert ep_traffic.expected_nodes_per_token(one_t, 24) <= 4


def test_plan_prints_the_exchange_of_1t_per_gpu_and_step(capsys):
    """1t.yaml: 55 MoE layers, 65,536 tokens per GPU, ep 96 = 24 nodes x 4, bf16 rows; flat by hand."""
    main(["--config", str(REPO_ROOT / "configs" / "1t.yaml"), "--gpu", "GH200", "--ib-gbps", "20"])
    out = capsys.readouterr().out
    assert "expert exchange   ep over 24 node(s) x 4 GPUs" in out and "at 20 GB/s InfiniBand" in out
    tokens, K, D = 65536, 8, 7168
    copies = tokens * K * 23 / 24  # each copy lands on another node with probability 23/24
    forward = copies * ((2 * D + 4) + 2 * D) + 92 * 4 * 8  # rows + weights out, outputs back; counts to 92 ranks
    backward = copies * (2 * D + (2 * D + 4))
    flat = next(line for line in out.splitlines() if line.startswith("flat  "))
    assert float(flat.split()[1]) == pytest.approx(55 * (forward + backward) / 1e9, rel=5e-4)  # 4 digits printed
    assert float(flat.split()[3]) == pytest.approx(55 * (forward + backward) / 20e9, rel=5e-3)
    hier = next(line for line in out.splitlines() if line.startswith("hierarchical + recompute"))
    assert float(hier.split()[3]) < float(flat.split()[1])  # hierarchical with recompute sends less than flat without


def exchange_table(capsys, *flags) -> list[str]:
    main(["--config", str(REPO_ROOT / "configs" / "1t.yaml"), "--gpu", "GH200", *flags])
    return capsys.readouterr().out.splitlines()


def test_groups_across_unequal_node_shares_are_priced_flat_at_their_busiest_sender(capsys):
    """ep 12 over nodes of 8 (384 GPUs): groups [0..11] hold 8 + 4 ranks on two nodes, [12..23] 4 + 8, so the
    dispatcher runs them flat across nodes; a sender with 4 of its group's 12 ranks on its node sends 8/12 of its
    copies to the other node. It used to print "not priced" instead."""
    lines = exchange_table(capsys, "--nodes", "48", "--gpus-per-node", "8", "--expert-parallel-size", "12")
    header = next(line for line in lines if line.startswith("expert exchange   "))
    assert header.startswith("expert exchange   flat across nodes (unequal shares of the group per node: the "
                             "busiest sender has 4 of 12 ranks on its node)")
    tokens, K, D, local_experts = 65536, 8, 7168, 384 // 12
    copies_inter, copies_intra = tokens * K * 8 / 12, tokens * K * 3 / 12
    counts_inter, counts_intra = 8 * local_experts * 8, 3 * local_experts * 8  # int64 counts to each peer
    row, grad = 2 * D + 4, 2 * D + 4  # a bf16 row with its fp32 weight; a gradient row the same
    inter = copies_inter * (row + 2 * D + grad + 2 * D) + counts_inter
    intra = copies_intra * (row + 2 * D + grad + 2 * D) + counts_intra
    flat = next(line for line in lines if line.startswith("flat  ")).split()
    assert float(flat[1]) == pytest.approx(55 * inter / 1e9, rel=5e-4)  # 4 digits printed
    assert float(flat[2]) == pytest.approx(55 * intra / 1e9, rel=5e-4)
    assert not any(line.startswith("hierarchical") for line in lines)


def test_each_group_priced_as_the_dispatcher_lays_it_out(capsys):
    """ep 4 on 6 GPUs per node (2 nodes): ranks 0-3 are a group within node 0, 8-11 within node 1, and 4-7 hold
    2 + 2 ranks on both nodes, which the dispatcher runs hierarchical. The step waits for the slowest: that one.
    It used to price every group as one node (no inter-node bytes)."""
    lines = exchange_table(capsys, "--nodes", "2", "--gpus-per-node", "6", "--expert-parallel-size", "4",
                           "--gpu-memory", "1000")
    assert next(line for line in lines if line.startswith("expert exchange   ")).startswith(
        "expert exchange   ep over 2 node(s) x 2 GPUs")
    groups = next(line for line in lines if line.lstrip().startswith("groups: "))
    assert "2 flat within one node of 4 GPUs; 1 hierarchical over 2 nodes x 2 GPUs" in groups
    assert float(next(line for line in lines if line.startswith("hierarchical  ")).split()[1]) > 0
    # ep 3 on 8 GPUs per node (3 nodes): [6, 7, 8] and [15, 16, 17] straddle two nodes 2 + 1: flat, the lone rank
    # sends 2/3 of its copies off its node
    lines = exchange_table(capsys, "--nodes", "3", "--gpus-per-node", "8", "--expert-parallel-size", "3",
                           "--gpu-memory", "1000")
    assert "busiest sender has 1 of 3 ranks on its node" in next(
        line for line in lines if line.startswith("expert exchange   "))
    assert "2 flat across nodes" in next(line for line in lines if line.lstrip().startswith("groups: "))


def test_shapes_come_from_the_dispatchers_layout_function():
    """``group_shapes`` hands the mesh's groups to ``expert_parallel.plan_layout``, the function the dispatcher
    runs: the same ranks, by hand, get the same decisions."""
    from moe_lightning.parallel import MeshLayout
    from moe_lightning.parallel.expert_parallel import plan_layout

    shapes = ep_traffic.group_shapes(MeshLayout(12, 1, 12, 4), gpus_per_node=6)
    assert shapes == {ep_traffic.GroupShape(False, 1, 4, 4): 2, ep_traffic.GroupShape(True, 2, 2, 4): 1}
    table = [(rank // 6, tuple(range(rank // 4 * 4, rank // 4 * 4 + 4))) for rank in range(12)]
    assert plan_layout(table)[(4, 5, 6, 7)] == [[4, 5], [6, 7]]


def test_packed_rows_are_padded_to_the_widest_element():
    assert ep_traffic.packed_row_bytes((7168, 2), (1, 4)) == 14340
    assert ep_traffic.packed_row_bytes((7, 2), (1, 4)) == 20  # 18 bytes padded to a multiple of 4
    assert ep_traffic.packed_row_bytes((7, 2)) == 14
