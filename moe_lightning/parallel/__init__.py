"""Distributed pieces of the FSDP2 strategy: the parallel layout and its meshes (``mesh``), expert parallelism,
context parallelism, FSDP units (``fsdp``), gradient clipping (``clip``), and ``parallelize_moe``, which applies them."""

from moe_lightning.parallel.expert_parallel import AllToAllTokenDispatcher, apply_expert_parallel
from moe_lightning.parallel.mesh import MeshError, MeshLayout, ParallelMesh

__all__ = ["AllToAllTokenDispatcher", "apply_expert_parallel", "MeshError", "MeshLayout", "ParallelMesh"]
