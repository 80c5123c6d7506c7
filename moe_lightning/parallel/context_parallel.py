"""Context parallelism: the N ranks of a group share every sequence of their batch, each computing 1/N of its
positions, and exchange only attention's key side (GQA: the grouped K and V; MLA: the normalised latent and the
rotated shared rotary key, C + R values a token instead of H x (N + R + V)).

Who holds what (head-tail chunks): a sequence of S positions is cut into 2N chunks of S / 2N; rank r computes
chunks r and 2N-1-r. Under causal attention chunk j's queries see ``c * (c * j + (c + 1) / 2)`` pairs, so
every rank's two chunks sum to the same count (exact balance without documents; see ``attended_pairs``).

The exchange (``ContextParallelShard.gather``): one all-gather of the key-side tensors packed side by side in
forward, one reduce-scatter of their gradients in backward (rank r's tokens serve every rank's queries, so the
gradient of its key side is the sum over ranks). The pieces travel in one dtype, the autocast dtype when autocast
is on (what the up-projection computes in; ``torch.cat`` would promote a bf16 rotary key and an fp32 latent to
fp32, twice the bytes), else the pieces' own; the gradients are summed in fp32, as FSDP reduces parameter
gradients. On the wire per layer each rank sends ``B * S * width * element size * (N - 1) / N`` bytes per
all-gather and ``B * S * width * 4 * (N - 1) / N`` in the reduce-scatter.

The loss (``context_parallel_mean``): rank r returns ``N * (its targets' cross-entropy sum) / (the sequence
group's target count)``. The gradients the ranks compute sum to the gradient of ``N x`` the group's mean, and
FSDP averages over its dp x cp ranks, dividing by N once more: exactly the gradient without context parallelism.

The balancing losses (``ContextParallelShard.sum_over_sequence``): the MoE layers' per-sequence sums (expert counts,
routing probabilities, squared log-sum-exps, positions) are all-reduced over the group, so every rank computes the
whole sequences' losses, and each rank's positions receive the sum of the N ranks' (equal) gradients of them, N x
one (no second all-reduce): again N x the gradient without context parallelism, as the main loss's.
"""

import functools

import torch
import torch.distributed as dist

from moe_lightning.model.attention import SequenceShard


def check_sequence_length(seq_len: int, size: int) -> None:
    """Head-tail chunks need ``seq_len`` divisible by ``2 * size``: say so before any work."""
    if seq_len % (2 * size):
        raise ValueError(f"context_parallel_size={size} splits each sequence into {2 * size} equal chunks; the "
                         f"model's sequence length {seq_len} (data.seq_len) is not a multiple of {2 * size}: "
                         f"choose data.seq_len from multiples of {2 * size}, e.g. {seq_len // (2 * size) * 2 * size + 2 * size}.")


def head_tail_positions(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Rank ``rank``'s positions ``[seq_len / size]``, ascending: chunks ``rank`` and ``2 * size - 1 - rank``."""
    check_sequence_length(seq_len, size)
    c = seq_len // (2 * size)
    head, tail = rank * c, (2 * size - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c, device=device), torch.arange(tail, tail + c, device=device)])


def attended_pairs(doc_S: torch.Tensor, positions_S: torch.Tensor) -> int:
    """(query, key) pairs the queries at ``positions_S`` attend under causal document masking (``doc_S``: the
    sequence's document ids, ascending): query q sees the keys from its document's first position to q."""
    T = len(doc_S)
    first_S = torch.searchsorted(doc_S.contiguous(), doc_S, right=False)  # first position of each one's document
    return int((positions_S - first_S[positions_S] + 1).sum()) if T else 0


def exchange_dtype(*key_side_BS: torch.Tensor) -> torch.dtype:
    """The one dtype the key side travels in: autocast's when it is on (the dtype the up-projection and attention
    compute in), else the pieces' own (they must agree: no silent promotion)."""
    device = key_side_BS[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtypes = {x.dtype for x in key_side_BS}
    if len(dtypes) > 1:
        raise ValueError(f"ContextParallelShard.gather: key-side tensors of dtypes {sorted(map(str, dtypes))} outside "
                         "autocast; they travel in one buffer: give them one dtype.")
    return dtypes.pop()


class _GatherSequence(torch.autograd.Function):
    """All-gather of the shards' key-side tensors into global order; reduce-scatter of their gradients."""

    @staticmethod
    def forward(ctx, group, dtype, *local_BS):
        N = dist.get_world_size(group)
        B, s = local_BS[0].shape[:2]
        c = s // 2
        widths = [x[0, 0].numel() for x in local_BS]
        packed_BSX = torch.cat([x.reshape(B, s, -1).to(dtype) for x in local_BS], dim=-1).contiguous()
        gathered_NBSX = packed_BSX.new_empty(N * B, s, packed_BSX.shape[-1])  # gloo: ranks stacked on dim 0
        dist.all_gather_into_tensor(gathered_NBSX, packed_BSX, group=group)
        # rank r's rows are chunks r and 2N-1-r: heads in rank order, then tails in reverse rank order
        halves_B2NcX = gathered_NBSX.view(N, B, 2, c, -1).permute(1, 2, 0, 3, 4)
        global_BTX = torch.cat([halves_B2NcX[:, 0], halves_B2NcX[:, 1].flip(1)], dim=1).reshape(B, N * s, -1)
        ctx.group, ctx.N, ctx.shapes, ctx.widths = group, N, [x.shape for x in local_BS], widths
        ctx.dtypes = [x.dtype for x in local_BS]
        return tuple(part.reshape(B, N * s, *x.shape[2:])
                     for part, x in zip(global_BTX.split(widths, dim=-1), local_BS))

    @staticmethod
    def backward(ctx, *grad_BT):
        N, shapes = ctx.N, ctx.shapes
        B, s = shapes[0][:2]
        c = s // 2
        some = next(g for g in grad_BT if g is not None)
        grads = [some.new_zeros(B, N * s, w) if g is None else g for g, w in zip(grad_BT, ctx.widths)]
        summed = torch.promote_types(some.dtype, torch.float32)  # at least fp32 (a float64 check keeps float64)
        chunks_B2NcX = torch.cat([g.reshape(B, N * s, -1).to(summed) for g in grads], dim=-1).view(B, 2 * N, c, -1)
        per_rank_NB2cX = torch.stack([chunks_B2NcX[:, :N], chunks_B2NcX[:, N:].flip(1)], dim=2).transpose(0, 1)
        send_NBSX = per_rank_NB2cX.reshape(N * B, s, -1)  # a copy, ranks stacked on dim 0
        mine_BSX = send_NBSX.new_empty(B, s, send_NBSX.shape[-1])
        dist.reduce_scatter_tensor(mine_BSX, send_NBSX, op=dist.ReduceOp.SUM, group=ctx.group)
        return (None, None, *(part.reshape(shape).to(dtype) for part, shape, dtype
                              in zip(mine_BSX.split(ctx.widths, dim=-1), shapes, ctx.dtypes)))


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum). Every rank uses the sum, so an input's gradient is the sum of the N ranks' gradients of
    the sum; those are equal (the same function of the same all-reduced values), so the backward multiplies by N
    instead of all-reducing again."""

    @staticmethod
    def forward(ctx, group, partial_BX):
        ctx.size = dist.get_world_size(group)
        total_BX = partial_BX.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total_BX, group=group)
        return total_BX

    @staticmethod
    def backward(ctx, grad_BX):
        return None, grad_BX * ctx.size


class ContextParallelShard(SequenceShard):
    """This rank's head-tail share of every sequence, exchanging key-side tensors over ``group`` (the ranks that
    share a sequence: they read the same batches). Install on the model before the first forward::

        model.sequence_shard = ContextParallelShard(cp_group)

    The key-side tensors of one call travel in one buffer, in one dtype (``exchange_dtype``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        return _positions(seq_len, self.size, self.rank, device)

    def local(self, x_BS: torch.Tensor) -> torch.Tensor:
        return x_BS.index_select(1, self.positions(x_BS.shape[1], x_BS.device))

    def gather(self, *key_side_BS: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _GatherSequence.apply(self.group, exchange_dtype(*key_side_BS), *key_side_BS)

    def truncated(self, seq_len: int, length: int) -> SequenceShard:
        return self if length == seq_len else _TruncatedShard(self, seq_len, length)

    def sum_over_sequence(self, sums_BX: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(self.group, sums_BX)


class _TruncatedShard(SequenceShard):
    """A context-parallel shard of the first ``length`` positions: the positions cut off are the largest ones
    (rank 0's tail chunk ends the sequence), so this rank's rows are the first of its shard's, and the exchange
    pads them back to the shard's size with zeros, gathers, and drops the padded positions (their gradient is
    discarded)."""

    def __init__(self, shard: ContextParallelShard, seq_len: int, length: int):
        self.shard, self.seq_len, self.length, self.size = shard, seq_len, length, shard.size

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The shard's positions below ``length``: counted from the chunk bounds, not read back from the device."""
        c = self.seq_len // (2 * self.size)
        head, tail = self.shard.rank * c, (2 * self.size - 1 - self.shard.rank) * c
        below = min(max(self.length - head, 0), c) + min(max(self.length - tail, 0), c)
        return self.shard.positions(self.seq_len, device)[:below]

    def local(self, x_BS: torch.Tensor) -> torch.Tensor:
        return x_BS.index_select(1, self.positions(self.length, x_BS.device))

    def gather(self, *key_side_BS: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = self.seq_len // self.size
        padded = [torch.cat([x, x.new_zeros(x.shape[0], rows - x.shape[1], *x.shape[2:])], dim=1)
                  for x in key_side_BS]
        return tuple(x[:, :self.length] for x in self.shard.gather(*padded))

    def sum_over_sequence(self, sums_BX: torch.Tensor) -> torch.Tensor:
        return self.shard.sum_over_sequence(sums_BX)


@functools.lru_cache(maxsize=16)
def _positions(seq_len: int, size: int, rank: int, device: torch.device) -> torch.Tensor:
    return head_tail_positions(seq_len, size, rank, device)
