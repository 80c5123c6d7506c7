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


def test_plan_says_why_it_cannot_price_an_exchange_of_partial_nodes(capsys):
    """ep 12 over nodes of 8: the groups are not whole nodes. It used to print nothing."""
    main(["--config", str(REPO_ROOT / "configs" / "1t.yaml"), "--nodes", "48", "--gpus-per-node", "8",
          "--expert-parallel-size", "12"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("expert exchange   ")]
    assert len(lines) == 1
    assert "expert_parallel_size=12" in lines[0] and "gpus_per_node=8" in lines[0]
    assert "choose expert_parallel_size <= 8 or a multiple of 8" in lines[0]


def test_packed_rows_are_padded_to_the_widest_element():
    assert ep_traffic.packed_row_bytes((7168, 2), (1, 4)) == 14340
    assert ep_traffic.packed_row_bytes((7, 2), (1, 4)) == 20  # 18 bytes padded to a multiple of 4
    assert ep_traffic.packed_row_bytes((7, 2)) == 14
