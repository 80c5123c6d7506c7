"""Device-mesh layout: HSDP (replicas x shards) with expert and context parallelism carved out of the shard ranks.

Global rank ``g = r * shard + s``. Dense parameters are sharded over ``s`` and replicated over ``r``.
For experts the shard index splits as ``s = f * ep + p``: ``p`` (the expert-parallel rank, fastest
varying so an ``ep`` group is a set of neighbouring ranks, e.g. one node) picks a contiguous block
of ``E / ep`` experts, and ``f`` (the expert-FSDP rank) shards those experts FSDP-style.

Context parallelism is folded into the shard ranks too (as TorchTitan folds it into its FSDP dimension): the shard
index also splits as ``s = d * cp + c``, ``c`` fastest, so a context-parallel group (the ``cp`` ranks that share
every sequence of one batch) is ``cp`` neighbouring ranks, one node's NVLink. Its ranks still shard parameters and
reduce gradients with the others; the data-parallel replica a rank reads is ``g // cp`` of ``world / cp``.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard


class MeshError(ValueError):
    """A parallel size does not fit the world or the model; the message names the argument and the fix."""


def _check_ep_divides_shard(shard_size: int, expert_parallel_size: int) -> None:
    if shard_size % expert_parallel_size:
        raise MeshError(
            f"strategy.expert_parallel_size={expert_parallel_size} must divide strategy.shard_size="
            f"{shard_size} (expert parallelism is carved out of the shard ranks): choose it from "
            f"{_divisors(shard_size)}.")


def _check_cp_divides_shard(shard_size: int, context_parallel_size: int, seq_len: int | None = None) -> None:
    """The sizes offered are those the data's ``seq_len`` (when known) also takes: a multiple of ``2N``."""
    if shard_size % context_parallel_size:
        sizes = [d for d in _divisors(shard_size) if d == 1 or seq_len is None or seq_len % (2 * d) == 0]
        raise MeshError(
            f"strategy.context_parallel_size={context_parallel_size} must divide strategy.shard_size={shard_size} "
            f"(a context-parallel group is folded into the shard ranks, so it also divides the world): choose it "
            f"from {sizes}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshLayout:
    """Validated sizes. ``expert_shard`` is the number of ranks that FSDP-shard one expert block."""

    world_size: int
    replicate: int
    shard: int
    ep: int
    cp: int = 1  # context-parallel ranks sharing each sequence (neighbouring shard ranks)

    @property
    def expert_shard(self) -> int:
        return self.shard // self.ep

    @property
    def data_parallel(self) -> int:
        """Replicas of the data: the ranks that read different sequences (a context-parallel group reads one)."""
        return self.world_size // self.cp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits in every named dimension (what a report about one rank prints)."""
        s = rank % self.shard
        return {"replicate": rank // self.shard, "shard": s, "context": s % self.cp, "expert": s % self.ep,
                "expert_shard": s // self.ep}

    @staticmethod
    def check_arguments(replicate_size: int, shard_size: int | str, expert_parallel_size: int,
                        context_parallel_size: int = 1) -> None:
        """What can be checked without knowing the world size (at strategy construction)."""
        for name, value in (("replicate_size", replicate_size), ("expert_parallel_size", expert_parallel_size),
                            ("context_parallel_size", context_parallel_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"strategy.{name}={value!r}: must be a positive integer.")
        if shard_size != "auto" and (not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1):
            raise MeshError(f"strategy.shard_size={shard_size!r}: must be a positive integer or 'auto'.")
        if isinstance(shard_size, int):
            _check_ep_divides_shard(shard_size, expert_parallel_size)
            _check_cp_divides_shard(shard_size, context_parallel_size)

    @classmethod
    def resolve(cls, world_size: int, replicate_size: int, shard_size: int | str,
                expert_parallel_size: int, num_experts: int | None = None,
                context_parallel_size: int = 1, seq_len: int | None = None) -> "MeshLayout":
        """Check every size against the world, the model and the data's ``seq_len`` (when known) before any
        process group exists."""
        cls.check_arguments(replicate_size, shard_size, expert_parallel_size, context_parallel_size)
        if shard_size == "auto":
            if world_size % replicate_size:
                raise MeshError(
                    f"strategy.replicate_size={replicate_size} does not divide the world size {world_size} "
                    f"(num_nodes x devices): choose replicate_size from {_divisors(world_size)}.")
            shard_size = world_size // replicate_size
        if replicate_size * shard_size != world_size:
            raise MeshError(
                f"strategy.replicate_size={replicate_size} x strategy.shard_size={shard_size} = "
                f"{replicate_size * shard_size}, but the world size (num_nodes x devices) is {world_size}: "
                f"make the product equal {world_size}, e.g. shard_size='auto'.")
        _check_ep_divides_shard(shard_size, expert_parallel_size)
        _check_cp_divides_shard(shard_size, context_parallel_size, seq_len)
        if num_experts is not None and num_experts % expert_parallel_size:
            raise MeshError(
                f"strategy.expert_parallel_size={expert_parallel_size} must divide the model's "
                f"num_experts={num_experts}: choose it from "
                f"{[d for d in _divisors(num_experts) if shard_size % d == 0]}.")
        return cls(world_size, replicate_size, shard_size, expert_parallel_size, context_parallel_size)

    def dense_mesh(self, device_type: str) -> DeviceMesh:
        """``("shard",)`` for plain FSDP, ``("replicate", "shard")`` for HSDP."""
        if self.replicate == 1:
            return init_device_mesh(device_type, (self.shard,), mesh_dim_names=("shard",))
        return init_device_mesh(device_type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """``("replicate", "ep", "efsdp")``: the DTensor order that splits experts by ``ep`` first."""
        ranks = torch.arange(self.world_size).view(self.replicate, self.expert_shard, self.ep).transpose(1, 2)
        return DeviceMesh(device_type, ranks, mesh_dim_names=("replicate", "ep", "efsdp"))

    def groups(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None, dist.ProcessGroup | None]:
        """The dense mesh, the expert mesh (``ep > 1``) and this rank's context-parallel group (``cp > 1``)."""
        return (self.dense_mesh(device_type), self.expert_mesh(device_type) if self.ep > 1 else None,
                self.context_parallel_group())

    def context_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's context-parallel group (``cp`` neighbouring ranks), or None at ``cp == 1``. Every rank
        creates every group, in the same order (``new_group`` is a world collective)."""
        if self.cp == 1:
            return None
        mine = None
        for first in range(0, self.world_size, self.cp):
            group = dist.new_group(list(range(first, first + self.cp)))
            mine = group if first <= dist.get_rank() < first + self.cp else mine
        return mine

    def expert_placement(self, num_experts: int) -> tuple[Shard, str]:
        """``Shard(0)`` (whole experts per rank) when the local experts divide evenly, else ``Shard(1)``."""
        local, ranks = num_experts // self.ep, self.expert_shard
        if local % ranks == 0:
            return Shard(0), (f"expert stacks Shard(0): {local} local experts over {ranks} expert-shard ranks, "
                              f"{local // ranks} whole experts per rank.")
        return Shard(1), (f"expert stacks Shard(1) (fallback): {local} local experts do not divide over {ranks} "
                          f"expert-shard ranks, so each expert's output rows are sharded instead (balanced memory; "
                          f"optimizers that need whole matrices must gather them). For whole experts per rank make "
                          f"shard_size / expert_parallel_size divide num_experts / expert_parallel_size.")

    def check_expert_shard(self, num_experts: int, rows: tuple[int, ...]) -> None:
        """Refuse, before any parameter is sharded, an expert layout FSDP2 cannot shard: the ``Shard(1)`` fallback
        needs every expert stack's dim 1 (``rows``: the expert hidden size and the model dim) to divide over the
        expert-shard ranks (FSDP2 shards only dim 0 unevenly). Names ``expert_parallel_size`` and the sizes that
        work."""
        if self._fits(num_experts, rows, self.ep):
            return
        working = [d for d in _divisors(self.shard) if num_experts % d == 0 and self._fits(num_experts, rows, d)]
        raise MeshError(
            f"strategy.expert_parallel_size={self.ep} leaves {num_experts // self.ep} experts per rank to shard over "
            f"{self.expert_shard} ranks (shard_size {self.shard} / expert_parallel_size): neither whole experts nor "
            f"their rows {list(rows)} divide evenly, which FSDP2 cannot shard. Choose "
            f"{f'expert_parallel_size from {working}' if working else 'another shard_size'}, or num_experts with num_experts / expert_parallel_size a multiple of {self.expert_shard}.")

    def _fits(self, num_experts: int, rows: tuple[int, ...], ep: int) -> bool:
        ranks = self.shard // ep
        return (num_experts // ep) % ranks == 0 or all(r % ranks == 0 for r in rows)

    @staticmethod
    def expert_fsdp_mesh(expert_mesh: DeviceMesh) -> DeviceMesh:
        """The ranks that FSDP-shard (and HSDP-replicate) one block of experts."""
        if expert_mesh["replicate"].size() == 1:
            return expert_mesh["efsdp"]
        return expert_mesh["replicate", "efsdp"]
