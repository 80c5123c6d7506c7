"""Distributed pieces of the FSDP2 strategy: mesh layout, expert parallelism, FSDP units (``fsdp``), gradient
clipping (``clip``), resharding a full checkpoint (``reshard``), checkpoints."""

from moe_lightning.parallel.expert_parallel import AllToAllTokenDispatcher, apply_expert_parallel
from moe_lightning.parallel.mesh import MeshError, MeshLayout

__all__ = ["AllToAllTokenDispatcher", "apply_expert_parallel", "MeshError", "MeshLayout"]
