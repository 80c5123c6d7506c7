"""The parallel layout: every dimension's size (``MeshLayout``, validated once by ``resolve_layout``) and the device
meshes and process groups built from it (``ParallelMesh``, once per process). This is the only module that creates
device meshes or process groups; every consumer takes its sub-mesh or group from ``ParallelMesh`` by name.

Global rank ``g = r * shard + s``. Dense parameters are sharded over ``s`` and replicated over ``r``.
For experts the shard index splits as ``s = f * ep + p``: ``p`` (the expert-parallel rank, fastest
varying so an ``ep`` group is a set of neighbouring ranks, e.g. one node) picks a contiguous block
of ``E / ep`` experts, and ``f`` (the expert-FSDP rank) shards those experts FSDP-style.

Context parallelism is folded into the shard ranks too (as TorchTitan folds it into its FSDP dimension): the shard
index also splits as ``s = d * cp + c``, ``c`` fastest, so a context-parallel group (the ``cp`` ranks that share
every sequence of one batch) is ``cp`` neighbouring ranks, one node's NVLink. Its ranks still shard parameters and
reduce gradients with the others; without stages the data-parallel replica a rank reads is ``g // cp`` of
``world / cp`` (``MeshLayout.data_parallel_rank``).

Pipeline parallelism (``pp`` stages, ``parallel/pipeline.py``) sits between the two: ``g = (r * pp + p) * shard + s``,
so one stage's shard ranks are neighbours (a node: FSDP, EP and CP inside it) and the ``pp`` ranks of one pipeline are
``shard`` apart (across nodes, as the peers place PP). The ``pp`` ranks of a pipeline read the same batches.

Adding a dimension is one field of ``MeshLayout``, its rule in ``resolve``, its mesh in ``ParallelMesh`` and its step
in ``parallelize_moe``.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from moe_lightning.parallel.context_parallel import check_sequence_length


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
    pp: int = 1  # pipeline stages (ranks ``shard`` apart); each stage is ``replicate x shard`` ranks

    @property
    def expert_shard(self) -> int:
        return self.shard // self.ep

    @property
    def data_parallel(self) -> int:
        """Replicas of the data: the ranks that read different sequences (a context-parallel group reads one)."""
        return self.world_size // (self.cp * self.pp)

    def data_parallel_rank(self, rank: int) -> int:
        """The data replica global ``rank`` reads: a pipeline's stages read the same batches, a context-parallel
        group the same sequences."""
        replica, s = rank // (self.shard * self.pp), rank % self.shard
        return (replica * self.shard + s) // self.cp

    def rank_in_replica(self, rank: int) -> int:
        """Global ``rank``'s place in its replica (stage and shard rank): HSDP replicas hold the same weights, every
        other rank its own (a meta-device build seeds its initialisation with it)."""
        return rank % (self.pp * self.shard)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global ``rank`` sits in every named dimension (what a report about one rank prints)."""
        s = rank % self.shard
        return {"replicate": rank // (self.shard * self.pp), "shard": s, "context": s % self.cp,
                "expert": s % self.ep, "expert_shard": s // self.ep} | (
            {"pipeline": rank // self.shard % self.pp} if self.pp > 1 else {})

    @staticmethod
    def check_arguments(replicate_size: int, shard_size: int | str, expert_parallel_size: int,
                        context_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
        """What can be checked without knowing the world size (at strategy construction)."""
        for name, value in (("replicate_size", replicate_size), ("expert_parallel_size", expert_parallel_size),
                            ("context_parallel_size", context_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size)):
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
                context_parallel_size: int = 1, seq_len: int | None = None,
                pipeline_parallel_size: int = 1) -> "MeshLayout":
        """Check every size against the world, the model and the data's ``seq_len`` (when known) before any
        process group exists."""
        cls.check_arguments(replicate_size, shard_size, expert_parallel_size, context_parallel_size,
                            pipeline_parallel_size)
        pp = pipeline_parallel_size
        if shard_size == "auto":
            if world_size % (replicate_size * pp):
                pp_words = f" x pipeline_parallel_size={pp}" if pp > 1 else ""
                fits = [d for d in _divisors(world_size) if (world_size // pp) % d == 0] if world_size % pp == 0 \
                    else _divisors(world_size)
                raise MeshError(
                    f"strategy.replicate_size={replicate_size}{pp_words} does not divide the world size {world_size} "
                    f"(num_nodes x devices): choose replicate_size from {fits}"
                    + (f" and pipeline_parallel_size from {_divisors(world_size)}" if pp > 1 else "") + ".")
            shard_size = world_size // (replicate_size * pp)
        if replicate_size * pp * shard_size != world_size:
            pp_words = f" x strategy.pipeline_parallel_size={pp}" if pp > 1 else ""
            raise MeshError(
                f"strategy.replicate_size={replicate_size}{pp_words} x strategy.shard_size={shard_size} = "
                f"{replicate_size * pp * shard_size}, but the world size (num_nodes x devices) is {world_size}: "
                f"make the product equal {world_size}, e.g. shard_size='auto'.")
        _check_ep_divides_shard(shard_size, expert_parallel_size)
        _check_cp_divides_shard(shard_size, context_parallel_size, seq_len)
        if num_experts is not None and num_experts % expert_parallel_size:
            raise MeshError(
                f"strategy.expert_parallel_size={expert_parallel_size} must divide the model's "
                f"num_experts={num_experts}: choose it from "
                f"{[d for d in _divisors(num_experts) if shard_size % d == 0]}.")
        return cls(world_size, replicate_size, shard_size, expert_parallel_size, context_parallel_size, pp)

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


def resolve_layout(world_size: int, replicate_size: int, shard_size: int | str, expert_parallel_size: int,
                   context_parallel_size: int, config: Any | None, seq_len: int | None,
                   pipeline_parallel_size: int = 1) -> MeshLayout:
    """The one validation of a layout, shared by ``MoEFSDPStrategy`` and ``plan`` (a layout one accepts, the other
    does): checked against the world, the model's ``config`` (a ``MoEConfig``) and the data's ``seq_len`` (when
    known) before any process group exists or the model is built; one-line refusals naming the field and the fix."""
    E = getattr(config, "num_experts", None)
    layout = MeshLayout.resolve(world_size, replicate_size, shard_size, expert_parallel_size, E, context_parallel_size,
                                seq_len, pipeline_parallel_size)
    if E:
        layout.check_expert_shard(E, (config.expert_hidden, config.dim))
    if layout.cp > 1 and seq_len is not None:
        check_sequence_length(seq_len, layout.cp)
    return layout


def world_side_channel() -> dist.ProcessGroup:
    """A gloo group over the whole world, for small CPU flags that must never wait behind (or sync) the training
    collectives on the accelerator. A world collective: every rank calls it, in the same order."""
    return dist.new_group(backend="gloo")


_GROUP_NAMES: dict[dist.ProcessGroup, str] = {}  # every group made here, by the dimension it belongs to


def name_of(group: dist.ProcessGroup | None) -> str | None:
    """The dimension a process group made here belongs to (what a report about a collective names), else None."""
    return _GROUP_NAMES.get(group)


def _mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A mesh over ``ranks`` (every rank calls this for every mesh: each dimension's groups are world collectives;
    a rank outside ``ranks`` takes part in their creation and gets no coordinate)."""
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    if mesh.get_coordinate() is not None:
        for name in names:  # a dimension over the whole world is torch's default group: not named after one of ours
            group = mesh[name].get_group()
            if group is not dist.group.WORLD:
                _GROUP_NAMES.setdefault(group, name)
    return mesh


def node_groups(plans: dict[tuple[int, ...], list[list[int]] | str], device_type: str
                ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's inter-node group (its index within the node, on every node of its expert group) and intra-node
    group for hierarchical expert dispatch, from every expert group's plan (``expert_parallel.plan_layout``: ranks
    per node, or a sentence when flat). Every rank builds every hierarchical group's ``("ep_node", "ep_local")``
    mesh, in the order of ``plans``; a rank of a flat group gets ``(None, None)``."""
    mine, inter, intra = dist.get_rank(), None, None
    for blocks in plans.values():
        if isinstance(blocks, str):
            continue
        mesh = _mesh(device_type, torch.tensor(blocks), ("ep_node", "ep_local"))
        if mesh.get_coordinate() is not None:
            inter, intra = mesh["ep_node"].get_group(), mesh["ep_local"].get_group()
    return inter, intra


class ParallelMesh:
    """The run's meshes, built once per process from a validated ``MeshLayout``; consumers ask by name.

    ========================  ======================================  ==========================================
    name                      ranks (``g = (r * pp + p) * shard + s``)  used by
    ========================  ======================================  ==========================================
    ``"replicate"``           same ``s``, every ``r``                 HSDP gradient all-reduce
    ``"shard"``               same ``r``: one replica                 FSDP units, gradient clipping, Muon
    ``"ep"``                  ``ep`` neighbouring shard ranks         expert dispatch, checkpoint expert views
    ``"efsdp"``               same ``p``, stride ``ep``               FSDP of the expert stacks, FlexShard
    ``"cp"``                  ``cp`` neighbouring shard ranks         the context-parallel exchange
    ``"pp"``                  same ``r`` and ``s``, every stage       pipeline sends and receives (``pp > 1``)
    ``"stage"``               same stage: every ``r`` and ``s``       expert counts of the stage's layers
    ``"pp_ends"``             the first and last stage, same r, s     the token embedding's two copies (MTP, tied)
    ========================  ======================================  ==========================================

    Under expert parallelism ``expert`` is the ``("replicate", "ep", "efsdp")`` mesh of this rank's stage (experts
    split by ``ep`` first, the DTensor order of a checkpoint's global expert views); ``dense`` is ``("shard",)`` or
    ``("replicate", "shard")``, a stage's under pipeline parallelism. The node groups of hierarchical expert
    dispatch (``node_groups``) and the gloo side channels (``side_channel``) come from here too; ``name_of(group)``
    names any group made here. ``data_parallel_rank`` / ``data_parallel_size`` are what the sampler reads: a
    context-parallel group, and a pipeline's stages, read one replica of the data.
    """

    SIDE_CHANNELS = ("preemption", "checkpoint", "checkpoint_writer", "stragglers")

    def __init__(self, layout: MeshLayout, device_type: str):
        self.layout, self.device_type = layout, device_type
        r, s, ep, cp, pp = layout.replicate, layout.shard, layout.ep, layout.cp, layout.pp
        world_R_P_S = torch.arange(layout.world_size).view(r, pp, s)
        self.pipeline, self._stage, self._ends = None, None, None
        if pp > 1:  # every stage's dense mesh is a sub-mesh of one ("replicate", "pp", "shard") mesh
            self.pipeline = _mesh(device_type, world_R_P_S, ("replicate", "pp", "shard"))
            self.dense = self.pipeline["shard"] if r == 1 else self.pipeline["replicate", "shard"]
            self._stage, self._ends = self._stage_group(layout, device_type), self._ends_group(layout, device_type)
        else:
            self.dense = _mesh(device_type, world_R_P_S[0, 0] if r == 1 else world_R_P_S[:, 0],
                               ("shard",) if r == 1 else ("replicate", "shard"))
        self.expert = None if ep == 1 else self._expert_mesh(world_R_P_S, ep, device_type)
        self.context = None if cp == 1 else _mesh(device_type, world_R_P_S.view(-1, cp), ("cp_replica", "cp"))
        self._side = {name: world_side_channel() for name in self.SIDE_CHANNELS} if layout.world_size > 1 else {}

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group of dimension ``name`` (see the table); None where the dimension has size 1 and so no
        group (``"shard"`` always has one)."""
        if name in ("replicate", "shard"):
            return self.dense[name].get_group() if name in self.dense.mesh_dim_names else None
        if name in ("ep", "efsdp"):
            return None if self.expert is None else self.expert[name].get_group()
        if name == "cp":
            return None if self.context is None else self.context["cp"].get_group()
        if name == "pp":
            return None if self.pipeline is None else self.pipeline["pp"].get_group()
        if name == "stage":
            return self._stage
        if name == "pp_ends":
            return self._ends
        raise KeyError(f"no mesh dimension {name!r}: the dimensions are replicate, shard, ep, efsdp, cp, pp, stage, "
                       "pp_ends")

    @staticmethod
    def _expert_mesh(world_R_P_S: torch.Tensor, ep: int, device_type: str) -> DeviceMesh:
        """This stage's ``("replicate", "ep", "efsdp")`` mesh (``s = f * ep + e``: ``ep`` neighbouring shard
        ranks, ``efsdp`` stride ``ep``). Under stages every rank builds one root 3-D mesh per stage, in stage order,
        and keeps its own: each stage's expert groups hold that stage's ranks only, a checkpoint's expert views stay
        3-D, and ``expert["replicate", "efsdp"]`` slices as at ``pp == 1`` (torch 2.11 refuses the slice of a 4-D
        ``(replicate, pp, ep, efsdp)`` mesh: ``ep`` has a smaller rank stride than ``efsdp``)."""
        r, pp, s = world_R_P_S.shape
        ranks_R_P_E_F = world_R_P_S.view(r, pp, s // ep, ep).transpose(2, 3)
        stage_meshes = [_mesh(device_type, ranks_R_P_E_F[:, p], ("replicate", "ep", "efsdp")) for p in range(pp)]
        return next(mesh for mesh in stage_meshes if mesh.get_coordinate() is not None)

    @staticmethod
    def _stage_group(layout: MeshLayout, device_type: str) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline stage (every replica and shard rank of it)."""
        ranks_P_RS = torch.arange(layout.world_size).view(layout.replicate, layout.pp, layout.shard).transpose(0, 1)
        return _mesh(device_type, ranks_P_RS.reshape(layout.pp, -1), ("stage_line", "stage"))["stage"].get_group()

    @staticmethod
    def _ends_group(layout: MeshLayout, device_type: str) -> dist.ProcessGroup | None:
        """This rank's pair of first and last stage (same replica and shard rank), None on the stages between."""
        ranks_R_P_S = torch.arange(layout.world_size).view(layout.replicate, layout.pp, layout.shard)
        ends_RS_2 = torch.stack([ranks_R_P_S[:, 0], ranks_R_P_S[:, -1]], dim=-1).reshape(-1, 2)
        mesh = _mesh(device_type, ends_RS_2, ("ends_line", "pp_ends"))
        return None if mesh.get_coordinate() is None else mesh["pp_ends"].get_group()

    @property
    def pipeline_rank(self) -> int:
        """This rank's stage (0 without pipeline parallelism)."""
        return dist.get_rank() // self.layout.shard % self.layout.pp

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """The ranks that FSDP-shard (and HSDP-replicate) one block of experts."""
        if self.expert is None:
            return None
        return self.expert["efsdp"] if self.layout.replicate == 1 else self.expert["replicate", "efsdp"]

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(dist.get_rank())

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel

    def side_channel(self, name: str) -> dist.ProcessGroup | None:
        """A gloo world group of its own for ``name`` (one of ``SIDE_CHANNELS``); None on one process."""
        if name not in self.SIDE_CHANNELS:
            raise KeyError(f"no side channel {name!r}: the channels are {', '.join(self.SIDE_CHANNELS)}")
        return self._side.get(name)
