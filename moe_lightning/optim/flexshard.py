"""FlexShard: where each Muon matrix is orthogonalized, and the communication that placement costs.

Newton–Schulz needs whole matrices. Under FSDP2 a parameter is a DTensor and its placement says
what each rank holds:
- expert stacks ``[E, m, n]`` sharded on dim 0 (or not sharded, or plain tensors such as the
  expert-parallel slice of local experts) hold whole expert matrices: orthogonalized locally, no bytes moved;
- row-sharded matrices ``[m, n]`` (``Shard(0)`` on one mesh dim, ``Replicate`` elsewhere, e.g. HSDP)
  get an owner rank in their shard group; the owner receives every rank's rows, orthogonalizes
  and sends each rank its rows back. All matrices of a shard group share one all-to-all each way.
  Expert stacks row-sharded with ``Shard(1)`` (the strategy's fallback when experts do not divide
  over the expert-shard ranks) are treated the same way, each expert its own matrix.
Any other layout raises, naming the parameter and its placement.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from moe_lightning.optim.newton_schulz import newton_schulz_flops


class FlexShardLayoutError(ValueError):
    """A Muon parameter's placement cannot be orthogonalized without a layout FlexShard does not implement."""


@dataclass
class ShardGroup:
    """Row-sharded matrices sharing one process group, with their owners (group-local ranks)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    indices: list[tuple[int, int | None]] = field(default_factory=list)  # (Muon parameter, expert or None)
    shapes: list[tuple[int, int]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)

    def rows(self, m: int) -> list[int]:
        """Rows per group rank under ``Shard(0)``: ``torch.chunk`` sizes, trailing ranks may get 0."""
        chunk = -(-m // self.size)
        return [max(0, min(chunk, m - r * chunk)) for r in range(self.size)]


def lpt_owners(costs: list[float], n_ranks: int) -> list[int]:
    """Greedy longest-processing-time: biggest job first to the least-loaded rank (ties: lowest index).

    Pure function of ``costs``, so every rank computes the same owners without communicating.
    """
    owners, loads = [0] * len(costs), [0.0] * n_ranks
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(n_ranks), key=lambda r: (loads[r], r))
        owners[i], loads[rank] = rank, loads[rank] + costs[i]
    return owners


def classify(name: str, p: torch.Tensor) -> tuple[int, int] | None:
    """``None`` if ``p`` holds whole matrices locally, else ``(mesh_dim, group_size)`` of its row sharding."""
    if not isinstance(p, DTensor):
        return None
    sharded = [(d, pl) for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    unsupported = [pl for _, pl in sharded if type(pl) is not Shard]
    if unsupported:
        raise FlexShardLayoutError(
            f"Muon parameter {name!r} has placements {p.placements}: FlexShard handles Shard and Replicate "
            f"only ({unsupported} found). Optimize it with AdamW (adamw_patterns) or shard it with plain Shard(0).")
    row_dim = p.ndim - 2  # rows of each matrix: dim 0 of [m, n], dim 1 of [E, m, n]
    if p.ndim == 3 and all(pl.dim == 0 for _, pl in sharded):
        return None  # whole experts on every rank
    if not sharded:
        return None
    if len(sharded) > 1 or sharded[0][1].dim != row_dim:
        if p.ndim == 3:
            raise FlexShardLayoutError(
                f"Muon expert stack {name!r} [E, m, n] has placements {p.placements}: FlexShard needs whole "
                f"experts per rank (Shard(0), no bytes moved) or rows of every expert on one mesh dim (Shard(1)). "
                f"Make the expert-shard size divide the local experts so the strategy can use Shard(0).")
        raise FlexShardLayoutError(
            f"Muon matrix {name!r} has placements {p.placements} on mesh {p.device_mesh.mesh_dim_names}: FlexShard "
            f"gathers row shards (Shard(0) on one mesh dim, Replicate elsewhere, e.g. FSDP or HSDP). "
            f"Use the default FSDP2 row sharding or send it to AdamW with adamw_patterns.")
    mesh_dim = sharded[0][0]
    return mesh_dim, p.device_mesh.size(mesh_dim)


def plan_shard_groups(names: list[str], params: list[torch.Tensor], ns_steps: int) -> list[ShardGroup]:
    """Group row-sharded Muon matrices by process group and pick LPT owners by Newton–Schulz cost."""
    groups: dict[dist.ProcessGroup, ShardGroup] = {}
    for i, (name, p) in enumerate(zip(names, params)):
        where = classify(name, p)
        if where is None:
            continue
        mesh_dim, size = where
        pg = p.device_mesh.get_group(mesh_dim)
        sg = groups.setdefault(pg, ShardGroup(pg, size, p.device_mesh.get_local_rank(mesh_dim)))
        m, n = p.shape[-2:]
        local_rows = p.to_local().shape[-2]
        if local_rows != sg.rows(m)[sg.rank]:
            raise FlexShardLayoutError(
                f"Muon matrix {name!r}: local shard has {local_rows} rows, expected {sg.rows(m)[sg.rank]} of {m} "
                f"(torch.chunk split over {size} ranks); padded or custom row layouts are not supported.")
        for e in range(p.shape[0]) if p.ndim == 3 else [None]:
            sg.indices.append((i, e))
            sg.shapes.append((m, n))
    for sg in groups.values():
        sg.owners = lpt_owners([newton_schulz_flops(m, n, ns_steps) for m, n in sg.shapes], sg.size)
    return list(groups.values())


def check_trainable_agree(trainable: list[str], group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` (default: every rank) must train the same Muon parameters: the row exchanges are
    planned from them, so a parameter frozen (or left out) on some ranks only would make ranks plan exchanges of
    different sizes. One collective over ``group``, when the plan is made (at the first step, before any parameter
    changes). Under pipeline stages ``group`` is the stage's ranks: other stages train other matrices, and a stage
    without a Muon matrix never plans, so a world-wide check would wait for it forever."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(trainable), group=group)
    if any(names != everyone[0] for names in everyone):
        some = sorted(set().union(*everyone) - set.intersection(*map(set, everyone)))
        rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        ranks = {name: [rank(r) for r, names in enumerate(everyone) if name not in names] for name in some}
        raise FlexShardLayoutError(
            f"Muon parameters frozen (requires_grad=False) or left out of the optimizer on some ranks only: {ranks} "
            "(parameter: the ranks that do not train it). Freeze the same parameters on every rank, before the "
            "first step.")


def comm_device(group: dist.ProcessGroup, compute_device: torch.device) -> torch.device:
    """Device whose tensors the group's backend moves: NCCL needs CUDA (even when Newton–Schulz runs on the
    CPU), gloo moves host tensors."""
    if "nccl" in str(dist.get_backend(group)):
        return compute_device if compute_device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RowExchange:
    """One shard group's gather-to-owner and scatter-back, each a single async ``all_to_all_single``, in ``dtype``
    (Newton–Schulz's: the owner's result equals what a local Newton–Schulz of the same rows gives).

    Every matrix travels with one flag per rank: in the gather, whether that rank has a gradient for it (a rank
    without one counts it as zero); in the scatter, whether any rank had one. So the sizes of both exchanges never
    depend on which gradients exist (every rank computes the same ones from the plan), and a matrix no rank has
    a gradient for is left untouched, as optimizers leave a parameter whose ``grad`` is ``None``.

    Host-resident shards (FSDP ``cpu_offload``) exchanged over a device backend (NCCL) are staged: the send buffer
    is assembled in pinned host memory and crosses the bus in one copy, and the received rows come back in one
    copy per group and one host wait per step for all groups (``local_rows``), not a blocking copy each way per
    matrix. ``stage`` (default: when
    the shards are on the host and ``device`` is not) forces it either way; ``trace`` receives ``(operation,
    elements)`` for each copy and wait (tests count them).
    """

    def __init__(self, sg: ShardGroup, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 stage: bool | None = None, trace: list | None = None):
        self.sg, self.device, self.dtype, self.stage, self.trace = sg, device, dtype, stage, trace
        me = sg.rank
        self.rows = rows = [sg.rows(m) for m, _ in sg.shapes]
        self.mine = [k for k, o in enumerate(sg.owners) if o == me]  # matrices this rank orthogonalizes
        # elements this rank sends to each owner, and receives from each rank, in the gather: rows, then flags
        self.by_owner = [[k for k, o in enumerate(sg.owners) if o == dst] for dst in range(sg.size)]
        self.to_owner = [sum(rows[k][me] * sg.shapes[k][1] + 1 for k in ks) for ks in self.by_owner]
        self.from_rank = [sum(rows[k][src] * sg.shapes[k][1] + 1 for k in self.mine) for src in range(sg.size)]
        self.work = None
        self.staged = False
        self._pin = device.type == "cuda"

    def _log(self, operation: str, elements: int) -> None:
        if self.trace is not None:
            self.trace.append((operation, elements))

    def start_gather(self, shards: list[torch.Tensor], present: list[bool]) -> None:
        """Send each local row shard (in the dtype Newton–Schulz runs in) to its owner, with the flag saying
        whether this rank has a gradient for it (a shard without one is its momentum's share of the update)."""
        on_host = all(t.device.type == "cpu" for t in shards)
        self.staged = (on_host and self.device.type != "cpu") if self.stage is None else self.stage
        where = torch.device("cpu") if self.staged else self.device
        pieces = []
        for ks in self.by_owner:
            flags = torch.ones(len(ks), dtype=self.dtype, device=where)  # filled where it is built: no copy
            for j, k in enumerate(ks):
                pieces.append(shards[k].to(where, self.dtype).flatten())
                if not present[k]:
                    flags[j] = 0
            pieces.append(flags)
        if self.staged:  # assembled in pinned memory, one copy in
            send = torch.empty(sum(p.numel() for p in pieces), dtype=self.dtype, pin_memory=self._pin)
            send = torch.cat(pieces, out=send).to(self.device, non_blocking=True)
            self._log("to_device", send.numel())
        else:
            send = torch.cat(pieces)
        self.recv = torch.empty(sum(self.from_rank), dtype=self.dtype, device=self.device)
        self.work = dist.all_to_all_single(self.recv, send, self.from_rank, self.to_owner,
                                           group=self.sg.group, async_op=True)

    def owned_matrices(self) -> list[torch.Tensor]:
        """Wait for the gather; whole ``[m, n]`` matrices this rank owns, rows in rank order (multiplied by the
        any-rank-has-a-gradient flag, which exchanges as ``self.present``, one per owned matrix)."""
        self.work.wait()
        pieces: list[list[torch.Tensor]] = [[] for _ in self.mine]
        flags = []
        for src, chunk in enumerate(self.recv.split(self.from_rank)):
            offset = 0
            for j, k in enumerate(self.mine):
                r, n = self.rows[k][src], self.sg.shapes[k][1]
                pieces[j].append(chunk[offset:offset + r * n].view(r, n))
                offset += r * n
            flags.append(chunk[offset:])
        self.present = torch.stack(flags).amax(0) if flags else torch.empty(0, dtype=self.dtype, device=self.device)
        return [torch.cat(p).mul_(self.present[j]) for j, p in enumerate(pieces)]

    def start_scatter(self, results: list[torch.Tensor]) -> None:
        """Send each rank its rows of the orthogonalized matrices this rank owns, and their flags."""
        rows_by_rank = [result.split(self.rows[k]) for result, k in zip(results, self.mine)]
        send = [piece.flatten().to(self.device, self.dtype) for dst in range(self.sg.size)
                for piece in [rows[dst] for rows in rows_by_rank] + [self.present.to(self.device)]]
        send = torch.cat(send) if send else torch.empty(0, dtype=self.dtype, device=self.device)
        self.recv = torch.empty(sum(self.to_owner), dtype=self.dtype, device=self.device)
        self.work = dist.all_to_all_single(self.recv, send, self.to_owner, self.from_rank, group=self.sg.group,
                                           async_op=True)

    def copy_back(self) -> None:
        """Wait (device-side) for the scatter; staged, issue its one copy back into pinned memory, not waited for."""
        self.work.wait()
        if self.staged:
            self.recv = torch.empty(self.recv.shape, dtype=self.dtype, pin_memory=self._pin).copy_(
                self.recv, non_blocking=True)
            self._log("to_host", self.recv.numel())

    def received_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After ``copy_back`` (and, staged, the host wait): this rank's rows of every matrix of the group and
        whether any rank had a gradient for it (a 0-d tensor, 1 or 0), in group order."""
        me, out = self.sg.rank, [None] * len(self.sg.shapes)
        for ks, chunk in zip(self.by_owner, self.recv.split(self.to_owner)):
            offset = sum(self.rows[k][me] * self.sg.shapes[k][1] for k in ks)
            flags = chunk[offset:]
            offset = 0
            for j, k in enumerate(ks):
                r, n = self.rows[k][me], self.sg.shapes[k][1]
                out[k] = (chunk[offset:offset + r * n].view(r, n), flags[j])
                offset += r * n
        return out


def local_rows(exchanges: list[RowExchange]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``received_rows`` of every exchange: every staged group's copy back is issued before one host wait per step,
    so the copies queue back to back instead of each waiting for the one before."""
    for ex in exchanges:
        ex.copy_back()
    staged = [ex for ex in exchanges if ex.staged]
    for device in {ex.device for ex in staged if ex.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    if staged:
        staged[0]._log("synchronize", 0)
    return [ex.received_rows() for ex in exchanges]
