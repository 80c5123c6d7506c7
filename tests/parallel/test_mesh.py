"""The mesh layout's context-parallel groups: which ranks share a sequence, and that every rank creates the same
groups in the same order (``new_group`` is a world collective: a rank that skipped one would hang the others)."""

import pytest

from moe_lightning.parallel import mesh
from moe_lightning.parallel.mesh import MeshLayout


@pytest.mark.parametrize("world, replicate, cp", [(8, 1, 2), (8, 2, 2), (8, 1, 4), (4, 1, 1)])
def test_context_parallel_groups_are_neighbouring_ranks_created_alike_on_every_rank(world, replicate, cp, monkeypatch):
    """Group of rank g: the ``cp`` ranks ``g // cp * cp ...`` (c fastest), the ones the sampler gives replica g // cp."""
    layout = MeshLayout.resolve(world, replicate, "auto", 1, None, cp)
    created_by_rank = {}
    for rank in range(world):
        created = []
        monkeypatch.setattr(mesh.dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(mesh.dist, "new_group", lambda ranks: created.append(tuple(ranks)) or tuple(ranks))
        group = layout.context_parallel_group()
        created_by_rank[rank] = created
        if cp == 1:
            assert group is None and created == []
            continue
        assert group == tuple(r for r in range(world) if r // cp == rank // cp)
    assert len({tuple(c) for c in created_by_rank.values()}) == 1  # every rank: the same calls, in the same order
    assert layout.data_parallel == world // cp
