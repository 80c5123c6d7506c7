"""``ParallelMesh``: every named dimension's group, built from one device mesh layout on real gloo processes, checked
against the rank arithmetic written out here (``g = r * shard + s``; ``s = f * ep + p``; ``s = d * cp + c``)."""

import json

import pytest
import torch

from moe_lightning.parallel.mesh import MeshLayout
from tests.support.distributed import LAUNCHERS, run_ranks


def expected_groups(g: int, world: int, replicate: int, ep: int, cp: int) -> dict:
    shard = world // replicate
    r, s = divmod(g, shard)
    return {
        "replicate": [q * shard + s for q in range(replicate)] if replicate > 1 else None,
        "shard": [r * shard + t for t in range(shard)],
        "ep": [r * shard + s // ep * ep + p for p in range(ep)] if ep > 1 else None,
        "efsdp": [r * shard + f * ep + s % ep for f in range(shard // ep)] if ep > 1 else None,
        "cp": [r * shard + s // cp * cp + c for c in range(cp)] if cp > 1 else None,
    }


@pytest.mark.parametrize("replicate, ep, cp", [pytest.param(2, 2, 1, marks=pytest.mark.slow), (1, 2, 2)])
def test_every_named_group_is_the_ranks_the_layout_says(replicate, ep, cp):
    world = 4
    outputs = run_ranks(LAUNCHERS / "mesh_run.py", world, "--replicate", str(replicate), "--ep", str(ep),
                        "--cp", str(cp))
    for g, out in enumerate(outputs):
        report = json.loads(out.strip().splitlines()[-1])
        assert report["groups"] == expected_groups(g, world, replicate, ep, cp), g
        world_ranks = list(range(world))  # a group over the whole world is torch's default one: not ours to name
        assert report["names"] == {n: (None if ranks == world_ranks else n)
                                   for n, ranks in report["groups"].items() if ranks is not None}
        assert report["data_parallel"] == [g // cp, world // cp]  # what the sampler reads
        assert report["side"] == [list(range(world))] * 3  # gloo side channels over the world


@pytest.mark.slow
def test_hierarchical_node_groups_come_from_the_mesh_module():
    """ep 4 over 2 "nodes" of 2 ranks: inter-node groups are the ranks with the same index in their node, intra-node
    groups one node's ranks; both named as the expert exchange's dimensions."""
    outputs = run_ranks(LAUNCHERS / "mesh_run.py", 4, "--ep", "4", "--per-node", "2")
    for g, out in enumerate(outputs):
        nodes = json.loads(out.strip().splitlines()[-1])["nodes"]
        assert nodes["inter"] == [g % 2, g % 2 + 2] and nodes["intra"] == [g // 2 * 2, g // 2 * 2 + 1]
        assert nodes["names"] == ["ep_node", "ep_local"]


@pytest.mark.slow
def test_pipeline_groups_are_the_stage_the_pipeline_and_its_two_ends():
    """4 stages of 1 rank: a stage's group is the rank itself, the pipeline all 4, the ends group ranks 0 and 3 (the
    embedding's two copies), none on the middle stages; all made by the mesh module."""
    outputs = run_ranks(LAUNCHERS / "mesh_run.py", 4, "--pp", "4")
    for g, out in enumerate(outputs):
        groups = json.loads(out.strip().splitlines()[-1])["groups"]
        assert groups["stage"] == [g] and groups["pp"] == [0, 1, 2, 3]
        assert groups["pp_ends"] == ([0, 3] if g in (0, 3) else None)
        assert report_data_parallel(out) == [0, 1]


def report_data_parallel(out: str) -> list[int]:
    return json.loads(out.strip().splitlines()[-1])["data_parallel"]


def test_coordinates_invert_the_rank_arithmetic():
    layout = MeshLayout.resolve(16, 2, "auto", 4, 8, 2)
    for g in range(16):
        c = layout.coordinates(g)
        assert g == c["replicate"] * 8 + c["shard"]
        assert c["shard"] == c["expert_shard"] * 4 + c["expert"] and c["context"] == c["shard"] % 2


LAYOUTS = [  # nodes, GPUs per node, replicate, ep, cp, experts, expert_hidden, seq_len; the refusal or None
    (2, 4, 1, 4, 2, 8, 32, 64, None),
    (2, 4, 2, 2, 1, 8, 32, 64, None),
    (1, 6, 1, 4, 1, 8, 32, 64, "strategy.expert_parallel_size=4 must divide strategy.shard_size=6"),
    (1, 4, 3, 1, 1, 8, 32, 64, "strategy.replicate_size=3 does not divide the world size 4"),
    (1, 4, 1, 1, 4, 8, 32, 60, "not a multiple of 8"),
    (1, 4, 1, 4, 1, 6, 32, 64, "must divide the model's num_experts=6"),
    (2, 4, 1, 1, 1, 4, 12, 64, "neither whole experts nor their rows [12, 64] divide evenly"),
]


@pytest.mark.parametrize("nodes, per_node, replicate, ep, cp, experts, hidden, seq_len, refusal", LAYOUTS)
def test_plan_and_fit_accept_and_refuse_the_same_layouts(nodes, per_node, replicate, ep, cp, experts, hidden,
                                                         seq_len, refusal):
    """One validation for both: ``plan``'s verdict on a layout is ``fit``'s (the strategy's ``setup_environment``,
    stopped where it would create the process groups), refusals in the same words."""
    from types import SimpleNamespace

    from moe_lightning.model import MoEConfig
    from moe_lightning.planner.plan import Cluster, Workload, plan
    from moe_lightning.training.module import MoELanguageModel
    from moe_lightning.training.strategy import MoEFSDPStrategy

    config = MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=experts, expert_hidden=hidden,
                       ffn_hidden=64)

    class Reached(Exception):
        pass

    def verdict(run) -> str | None:
        try:
            run()
        except Reached:
            return None
        except ValueError as error:
            return str(error)
        return None

    def fit():
        strategy = MoEFSDPStrategy(replicate_size=replicate, expert_parallel_size=ep, context_parallel_size=cp)
        strategy.num_nodes, strategy.parallel_devices = nodes, [torch.device("cpu")] * per_node
        module = MoELanguageModel(config)
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=seq_len))
        strategy._lightning_module = module
        strategy._setup_distributed = lambda: (_ for _ in ()).throw(Reached())
        strategy.setup_environment()

    cluster = Cluster(nodes=nodes, gpus_per_node=per_node, replicate_size=replicate, expert_parallel_size=ep,
                      context_parallel_size=cp)
    planned, fitted = verdict(lambda: plan(config, cluster, Workload(seq_len=seq_len))), verdict(fit)
    assert planned == fitted
    assert (fitted is None) if refusal is None else (refusal in fitted)
