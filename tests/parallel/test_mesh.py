"""``ParallelMesh``: every named dimension's group, built from one device mesh layout on real gloo processes, checked
against the rank arithmetic written out here (``g = r * shard + s``; ``s = f * ep + p``; ``s = d * cp + c``)."""

import json

import pytest
import torch

from moe_lightning.parallel.mesh import MeshLayout, ParallelMesh
from tests.support.distributed import LAUNCHERS, run_ranks


def expected_groups(g: int, world: int, replicate: int, ep: int, cp: int, pp: int = 1) -> dict:
    """``g = (r * pp + p) * shard + s``: every group but ``replicate`` lies inside one stage ``(r, p)``."""
    shard = world // (replicate * pp)
    r, p, s = g // (shard * pp), g // shard % pp, g % shard
    stage = (r * pp + p) * shard
    return {
        "replicate": [(q * pp + p) * shard + s for q in range(replicate)] if replicate > 1 else None,
        "shard": [stage + t for t in range(shard)],
        "ep": [stage + s // ep * ep + e for e in range(ep)] if ep > 1 else None,
        "efsdp": [stage + f * ep + s % ep for f in range(shard // ep)] if ep > 1 else None,
        "cp": [stage + s // cp * cp + c for c in range(cp)] if cp > 1 else None,
    }


def expected_expert_meshes(g: int, world: int, replicate: int, ep: int, pp: int) -> tuple[list, list]:
    """Rank ``g``'s stage's expert mesh ``[replicate][ep][efsdp]`` (``s = f * ep + e``) and the mesh that FSDP-shards
    its expert block: ``[efsdp]``, or ``[replicate][efsdp]`` with replicas."""
    shard = world // (replicate * pp)
    p, e = g // shard % pp, g % shard % ep
    expert_R_E_F = [[[(q * pp + p) * shard + f * ep + e_ for f in range(shard // ep)] for e_ in range(ep)]
                    for q in range(replicate)]
    efsdp_R_F = [row[e] for row in expert_R_E_F]
    return expert_R_E_F, efsdp_R_F[0] if replicate == 1 else efsdp_R_F


@pytest.mark.parametrize("world, replicate, ep, cp, pp", [
    pytest.param(4, 2, 2, 1, 1, marks=pytest.mark.slow), pytest.param(4, 1, 2, 2, 1, marks=pytest.mark.extended),
    (4, 1, 2, 2, 2),  # the main suite's case: EP and CP groups inside 2 stages (without stages: above)
    pytest.param(8, 1, 2, 2, 2, marks=pytest.mark.extended), pytest.param(8, 2, 2, 1, 2, marks=pytest.mark.extended)])
def test_every_named_group_is_the_ranks_the_layout_says(world, replicate, ep, cp, pp):
    """Under stages (``pp`` 2) the expert and context groups are one stage's neighbouring shard ranks, and the
    checkpoint's expert mesh is that stage's 3-D ``(replicate, ep, efsdp)`` one."""
    outputs = run_ranks(LAUNCHERS / "mesh_run.py", world, "--replicate", str(replicate), "--ep", str(ep),
                        "--cp", str(cp), "--pp", str(pp))
    shard = world // (replicate * pp)
    for g, out in enumerate(outputs):
        report = json.loads(out.strip().splitlines()[-1])
        groups = expected_groups(g, world, replicate, ep, cp, pp)
        assert {n: report["groups"][n] for n in groups} == groups, g
        world_ranks = list(range(world))  # a group over the whole world is torch's default one: not ours to name
        assert report["names"] == {n: (None if ranks == world_ranks else n)
                                   for n, ranks in report["groups"].items() if ranks is not None}
        replica = g // (shard * pp)  # what the sampler reads: a pipeline's stages and a CP group read one replica
        assert report["data_parallel"] == [(replica * shard + g % shard) // cp, world // (cp * pp)]
        assert report["side"] == [world_ranks] * len(ParallelMesh.SIDE_CHANNELS)  # gloo side channels over the world
        if ep > 1:
            assert report["expert"] == [["replicate", "ep", "efsdp"], *expected_expert_meshes(g, world, replicate,
                                                                                               ep, pp)], g


@pytest.mark.extended
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


def test_a_ranks_place_in_its_replica_is_shared_by_the_replicas_alone():
    """What a meta-device build seeds each rank's initialisation with: HSDP replicas draw the same weights; every
    stage and shard rank of a replica its own (with the shard rank alone, two stages drew the same blocks)."""
    layout = MeshLayout.resolve(16, 2, "auto", 2, 8, 1, pipeline_parallel_size=2)  # 2 replicas x 2 stages x 4
    places = [layout.rank_in_replica(g) for g in range(16)]
    for g in range(16):
        c = layout.coordinates(g)
        same = [h for h in range(16) if places[h] == places[g]]
        assert same == [h for h in range(16) if layout.coordinates(h) | {"replicate": c["replicate"]} == c]
        assert len(same) == 2


LAYOUTS = [  # nodes, GPUs per node, replicate, ep, cp, pp, experts, expert_hidden, seq_len; the refusal or None
    (2, 4, 1, 4, 2, 1, 8, 32, 64, None),
    (2, 4, 2, 2, 1, 1, 8, 32, 64, None),
    (1, 4, 1, 2, 2, 2, 8, 32, 64, None),  # EP and CP within each of 2 stages
    (1, 6, 1, 4, 1, 1, 8, 32, 64, "strategy.expert_parallel_size=4 must divide strategy.shard_size=6"),
    (1, 4, 1, 4, 1, 2, 8, 32, 64, "strategy.expert_parallel_size=4 must divide strategy.shard_size=2"),  # a stage's
    (1, 8, 1, 1, 1, 2, 4, 12, 64, None),  # 4 experts over a stage's 4 ranks; over all 8 they would not divide
    (1, 4, 3, 1, 1, 1, 8, 32, 64, "strategy.replicate_size=3 does not divide the world size 4"),
    (1, 4, 1, 1, 4, 1, 8, 32, 60, "not a multiple of 8"),
    (1, 4, 1, 4, 1, 1, 6, 32, 64, "must divide the model's num_experts=6"),
    (2, 4, 1, 1, 1, 1, 4, 12, 64, "neither whole experts nor their rows [12, 64] divide evenly"),
]


@pytest.mark.parametrize("nodes, per_node, replicate, ep, cp, pp, experts, hidden, seq_len, refusal", LAYOUTS)
def test_plan_and_fit_accept_and_refuse_the_same_layouts(nodes, per_node, replicate, ep, cp, pp, experts, hidden,
                                                         seq_len, refusal):
    """One validation for both: ``plan``'s verdict on a layout (with ``pp`` stages: its pipeline rows) is ``fit``'s
    (the strategy's ``setup_environment``, stopped where it would create the process groups), refusals in the same
    words."""
    from types import SimpleNamespace

    from moe_lightning.model import MoEConfig
    from moe_lightning.planner.plan import Cluster, Workload, plan, plan_with_stages
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
        strategy = MoEFSDPStrategy(replicate_size=replicate, expert_parallel_size=ep, context_parallel_size=cp,
                                   pipeline_parallel_size=pp)
        strategy.num_nodes, strategy.parallel_devices = nodes, [torch.device("cpu")] * per_node
        module = MoELanguageModel(config)
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seq_len=seq_len), accumulate_grad_batches=1,
                                          callbacks=[])
        strategy._lightning_module = module
        strategy._setup_distributed = lambda: (_ for _ in ()).throw(Reached())
        strategy.setup_environment()

    cluster = Cluster(nodes=nodes, gpus_per_node=per_node, replicate_size=replicate, expert_parallel_size=ep,
                      context_parallel_size=cp)
    def planned_run():
        work = Workload(seq_len=seq_len)
        if pp > 1:
            plan_with_stages(config, cluster, work, pp, "1F1B", None)
        else:
            plan(config, cluster, work)

    planned, fitted = verdict(planned_run), verdict(fit)
    assert planned == fitted
    assert (fitted is None) if refusal is None else (refusal in fitted)
