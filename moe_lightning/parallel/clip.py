"""Gradient clipping over sharded gradients of several meshes (dense and expert) with one global norm."""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip (possibly sharded) gradients to a global L2 norm of ``max_norm``; returns the norm before clipping.

    Each rank sums the squares of its local shards and divides by how many ranks hold the same values (the
    sizes of the ``Replicate`` mesh dims: HSDP replicas); one all-reduce over the world on ``device`` then
    gives the global squared norm, dense and expert meshes together (the ``ep`` split of expert stacks is
    outside their DTensor mesh, so its ranks add up as they should). No DTensor collective runs on host
    tensors (NCCL rejects those under ``cpu_offload``), and nothing is read back to the host: the scale
    stays a tensor. (With ``cpu_offload`` the host still waits for it, since the host scales the gradients.)
    """
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}  # (device, copies) -> local shards
    for grad in grads:
        if isinstance(grad, DTensor):
            copies = math.prod(grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate())
            grad = grad.to_local()  # under no_grad: the shard itself, no copy
        else:
            copies = dist.get_world_size() if dist.is_initialized() else 1
        groups.setdefault((grad.device, copies), []).append(grad)
    total_sq = torch.zeros((), device=device)
    for (_, copies), local in groups.items():
        norms = torch._foreach_norm(local)  # fp32 for fp32 shards (FSDP keeps gradients in the sharded dtype)
        total_sq += (torch.stack(norms).float().square().sum() / copies).to(device)
    if dist.is_initialized():
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (grad_device, _), local in groups.items():
        torch._foreach_mul_(local, scale.to(grad_device))
    return total
