"""The expert-shard layout FSDP2 cannot shard is refused before building, naming the field and what works."""

import pytest

from moe_lightning.parallel.mesh import MeshError, MeshLayout


def test_uneven_expert_rows_are_refused_with_the_sizes_that_work():
    """tiny-fsdp's 8 experts on 2 nodes x 3, ep 2: 4 local experts over 3 ranks, rows 128 over 3 (the traceback)."""
    with pytest.raises(MeshError, match=r"strategy.expert_parallel_size=2 leaves 4 experts per rank to shard over 3 "
                                        r"ranks .* Choose another shard_size, or num_experts with num_experts / "
                                        r"expert_parallel_size a multiple of 3"):
        MeshLayout.resolve(6, 1, "auto", 2, 8).check_expert_shard(8, (128, 128))
    # 12 experts: 6 local over 3 ranks, whole experts
    MeshLayout.resolve(6, 1, "auto", 2, 12).check_expert_shard(12, (128, 128))
    # rows that divide: the Shard(1) fallback is valid
    MeshLayout.resolve(6, 1, "auto", 2, 8).check_expert_shard(8, (96, 96))
    # 16 experts on 12 ranks, rows of 99: ep 2 leaves 8 experts (rows 99) over 6 ranks; ep 4 shards 99 rows over 3
    with pytest.raises(MeshError, match=r"Choose expert_parallel_size from \[4\]"):
        MeshLayout.resolve(12, 1, "auto", 2, 16).check_expert_shard(16, (99, 99))
