"""Expert parallelism: each rank of an ``ep`` group keeps ``E / ep`` experts and exchanges tokens all-to-all.

The model is untouched: the strategy slices every ``GroupedExperts`` to its local experts and swaps the
MoE layer's ``dispatcher`` for :class:`AllToAllTokenDispatcher` (the group fits in one node) or
:class:`HierarchicalTokenDispatcher` (it spans nodes: each token crosses the network once per node).

Every exchange is one ``all_to_all_single`` of packed rows (hidden state, routing weights, expert ids side
by side as bytes), launched asynchronously; the work the MoE layer hands over (its shared experts) runs
while the token exchange is in flight, and in backward while the reverse exchange is. Split sizes are read
back to the host once per MoE forward.
"""

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from moe_lightning.model import GroupedExperts, MoELayer
from moe_lightning.model.moe import sum_into_tokens


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]] | None]:
    """Rows ``[R, c_i]`` of any dtypes side by side in one ``[R, bytes]`` uint8 matrix (one tensor: as is).

    Widest dtype first and the row padded to it, so every piece can be viewed back without a copy."""
    if len(tensors) == 1:
        return tensors[0].contiguous(), None
    tensors = sorted(tensors, key=lambda t: -t.element_size())  # (stable: callers unpack in this order)
    parts = [t.contiguous().view(torch.uint8) for t in tensors]
    layout = [(t.dtype, p.shape[1]) for t, p in zip(tensors, parts)]
    pad = -sum(p.shape[1] for p in parts) % tensors[0].element_size()
    if pad:
        parts.append(parts[0].new_zeros(parts[0].shape[0], pad))
    return torch.cat(parts, 1), layout


def _unpack(buffer: torch.Tensor, layout: list[tuple[torch.dtype, int]] | None) -> list[torch.Tensor]:
    if layout is None:
        return [buffer]
    out, start = [], 0
    for dtype, width in layout:
        out.append(buffer[:, start:start + width].view(dtype))
        start += width
    return out


def _order(tensors) -> list[int]:
    """Where ``_pack`` puts each tensor (it sorts by element size, stably)."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


class _Exchange:
    """One all-to-all of row tensors in flight: launched by :class:`_Launch`, awaited by :class:`_Land`.

    Its backward runs the reverse exchange of the floating-point rows' gradients the same way: launched by
    ``_Land.backward``, awaited by ``_Launch.backward``, so whatever autograd runs in between (the shared
    experts' backward) overlaps it. The gradients are multiplied by ``grad_scale``."""

    def __init__(self, group: dist.ProcessGroup, send_splits: list[int], recv_splits: list[int], grad_scale: float):
        self.group, self.send_splits, self.recv_splits, self.grad_scale = group, send_splits, recv_splits, grad_scale
        self._work = self._buffers = self._layout = self._where = None

    def launch(self, tensors: list[torch.Tensor], send: list[int], recv: list[int]) -> None:
        buffer, self._layout = _pack(tensors)
        self._where = _order(tensors)
        out = buffer.new_empty((sum(recv), *buffer.shape[1:]))
        self._work = dist.all_to_all_single(out, buffer, recv, send, group=self.group, async_op=True)
        self._buffers = (buffer, out)  # the send buffer lives until the exchange completes

    def land(self) -> list[torch.Tensor]:
        self._work.wait()
        pieces = _unpack(self._buffers[1], self._layout)
        out = [None] * len(pieces)
        for piece, i in zip(pieces, self._where):
            out[i] = piece
        self._work = self._buffers = None
        return out


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange: _Exchange, *rows: torch.Tensor) -> torch.Tensor:
        ctx.exchange, ctx.floating = exchange, [r.is_floating_point() for r in rows]
        exchange.launch(list(rows), exchange.send_splits, exchange.recv_splits)
        return rows[0].new_empty(0)  # a token linking _Land to the rows in the graph

    @staticmethod
    def backward(ctx, _):
        grads = iter(ctx.exchange.land())
        scale = ctx.exchange.grad_scale
        return None, *((next(grads) * scale if scale != 1 else next(grads)) if f else None for f in ctx.floating)


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange: _Exchange, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.exchange, ctx.token = exchange, (token.dtype, token.device)
        rows = exchange.land()
        ctx.floating = [r.is_floating_point() for r in rows]
        ctx.mark_non_differentiable(*(r for r in rows if not r.is_floating_point()))
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g for g, f in zip(grads, ctx.floating) if f]
        ctx.exchange.launch(grads, ctx.exchange.recv_splits, ctx.exchange.send_splits)
        dtype, device = ctx.token
        return None, torch.empty(0, dtype=dtype, device=device)


def _exchange(group, send_splits, recv_splits, grad_scale, rows, overlap=None):
    """All-to-all ``rows`` (one exchange); ``overlap()`` runs while it is in flight. Returns (rows, its result)."""
    exchange = _Exchange(group, send_splits, recv_splits, grad_scale)
    token = _Launch.apply(exchange, *rows)
    extra = overlap() if overlap is not None else None
    return _Land.apply(exchange, token), extra


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row ``p`` of ``counts`` to rank ``p``; returns what each rank sent here (no host sync)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _through_experts(group, grad_scale, x_RD, weights_RK, experts_RK, send_splits, recv_splits, recv_counts_PE,
                     experts: GroupedExperts, overlap=None):
    """One copy of each row per chosen expert (``experts_RK`` indexes this group's experts; -1: none) to the
    expert's rank, through the experts (weighted), back, and summed into the rows.

    The dispatch exchange's backward multiplies by ``grad_scale`` and the return's by its inverse (see
    :class:`AllToAllTokenDispatcher` for why). Returns ``y_RD``, plus overlap's result when given."""
    P, local, K = len(recv_splits), experts.num_experts, experts_RK.shape[1]
    choice = torch.where(experts_RK >= 0, experts_RK, P * local).flatten()  # "none" sorts last and is cut
    order = choice.argsort(stable=True)[:sum(send_splits)]
    row_of_copy = order // K
    (x_recv, weight_recv), extra = _exchange(group, send_splits, recv_splits, grad_scale,
                                             [x_RD[row_of_copy], weights_RK.flatten()[order, None]], overlap)
    # Received rows are grouped [source rank][local expert]; the experts want [local expert][source rank].
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=x_RD.device).repeat(P),
                                            recv_counts_PE.flatten(), output_size=sum(recv_splits))
    by_expert = expert_of_row.argsort(stable=True)
    x_by_expert, weight_by_expert = x_recv[by_expert], weight_recv[by_expert]
    del x_recv, weight_recv
    y_by_expert = experts(x_by_expert, recv_counts_PE.sum(0), weight_by_expert)
    del x_by_expert
    # Undo the regrouping without a second sort; index_put_ keeps only the indices (index_copy_ the rows too).
    y_recv = torch.empty_like(y_by_expert).index_put_((by_expert,), y_by_expert)
    del y_by_expert
    (y_copies,), _ = _exchange(group, recv_splits, send_splits, 1.0 / grad_scale, [y_recv])
    del y_recv
    return _with(sum_into_tokens(y_copies, row_of_copy, x_RD), extra)


def _with(y_TD: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    return y_TD if extra is None else y_TD + extra


class AllToAllTokenDispatcher:
    """Token dispatch across an expert-parallel group (the ``TokenDispatcher`` protocol of ``model/moe.py``).

    Steps: exchange per-expert counts, read the split sizes once, sort token copies by global expert and send
    them with their routing weights (one packed exchange; ``overlap`` runs meanwhile), regroup them by local
    expert, run the local experts (weighted), undo the regrouping, send back and sum into the token rows.
    Each intermediate buffer is dropped as soon as the next one exists.

    Gradient scale: an expert's weight gradient sums the contributions of all ``ep`` ranks' tokens,
    and FSDP then averages it over the ``world / ep`` ranks holding the same experts, which is ``ep``
    times the data-parallel mean. The return exchange scales its backward by ``1/ep`` (shrinking the
    expert weight and input gradients) and the dispatch exchange scales by ``ep`` (restoring the input
    and routing-weight gradients), so every gradient equals the ``ep = 1`` run. Powers of two make both
    scalings exact.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)

    @torch.compiler.disable  # host-side split sizes: a compiled block runs this part eagerly
    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts,
                 overlap: Callable[[], torch.Tensor] | None = None):
        send_counts_PE = tokens_per_expert_E.view(self.ep, experts.num_experts)
        recv_counts_PE = _exchange_counts(send_counts_PE, self.group)
        send_splits, recv_splits = torch.stack([send_counts_PE.sum(1), recv_counts_PE.sum(1)]).tolist()  # one sync
        return _through_experts(self.group, float(self.ep), x_TD, weights_TK, experts_TK, send_splits, recv_splits,
                                recv_counts_PE, experts, overlap)


class HierarchicalTokenDispatcher:
    """Token dispatch across an expert-parallel group of ``nodes x local`` ranks (node-major): DeepEP's pattern.

    A token's hidden state crosses the network once per node holding any of its experts: to the rank of
    that node with the sender's local index, with its ``K`` routing weights and node-local expert ids (one
    packed exchange over the ``inter`` group; ``overlap`` runs meanwhile). That rank fans it out to the
    node's experts over the ``intra`` group (:func:`_through_experts`), sums their weighted outputs, and
    sends one row back. Counts for both hops are exchanged first and read back together (one host sync).

    Equal to :class:`AllToAllTokenDispatcher` up to the order of two sums: a token's expert outputs are added
    per node, then across nodes (the flat one adds them in expert order; identical for ``top_k <= 2``), and
    an expert's weight gradient adds its rows in another order. Gradient scaling as there (on the inter hop).
    """

    def __init__(self, group: dist.ProcessGroup, inter: dist.ProcessGroup, intra: dist.ProcessGroup,
                 nodes: int, local: int):
        self.group, self.inter, self.intra, self.nodes, self.local = group, inter, intra, nodes, local
        self.ep = nodes * local

    @torch.compiler.disable  # host-side split sizes: a compiled block runs this part eagerly
    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts,
                 overlap: Callable[[], torch.Tensor] | None = None):
        N, L, T = self.nodes, self.local, x_TD.shape[0]
        per_node = L * experts.num_experts
        node_TK = experts_TK // per_node
        wanted_NT = torch.zeros(N, T, dtype=torch.bool, device=x_TD.device).scatter_(0, node_TK.T, True)
        # Per destination node: rows (distinct tokens), then tokens per expert of that node.
        send_meta_NC = torch.cat([wanted_NT.sum(1, keepdim=True), tokens_per_expert_E.view(N, per_node)], 1)
        recv_meta_NC = _exchange_counts(send_meta_NC, self.inter)
        node_counts_PE = recv_meta_NC[:, 1:].sum(0).view(L, -1)  # what this rank sends to each local rank
        recv_counts_PE = _exchange_counts(node_counts_PE, self.intra)
        splits = torch.cat([send_meta_NC[:, 0], recv_meta_NC[:, 0], node_counts_PE.sum(1),
                            recv_counts_PE.sum(1)]).tolist()  # one sync
        inter_send, inter_recv, intra_send, intra_recv = (splits[:N], splits[N:2 * N], splits[2 * N:2 * N + L],
                                                          splits[2 * N + L:])

        # One row per (destination node, token), node-major: the token, its weights, its experts on that node.
        order = (~wanted_NT).flatten().to(torch.uint8).argsort(stable=True)[:sum(inter_send)]
        node_of_row, token_of_row = order // T, order % T
        on_node_RK = node_TK[token_of_row] == node_of_row[:, None]
        node_experts_RK = torch.where(on_node_RK, experts_TK[token_of_row] - node_of_row[:, None] * per_node, -1)
        (x_RD, weights_RK, node_experts_RK), extra = _exchange(
            self.inter, inter_send, inter_recv, float(self.ep),
            [x_TD[token_of_row], weights_TK[token_of_row], node_experts_RK.to(torch.int32)], overlap)
        y_RD = _through_experts(self.intra, 1.0, x_RD, weights_RK, node_experts_RK, intra_send, intra_recv,
                                recv_counts_PE, experts)
        del x_RD, weights_RK
        (y_rows,), _ = _exchange(self.inter, inter_recv, inter_send, 1.0 / self.ep, [y_RD])
        return _with(sum_into_tokens(y_rows, token_of_row, x_TD), extra)


def node_layout(group: dist.ProcessGroup, ranks_per_node: int) -> tuple[int, int] | str:
    """``(nodes, ranks per node)`` of a group laid out node-major with equal ranks per node, else why not."""
    return ranks_layout(dist.get_process_group_ranks(group), ranks_per_node)


def ranks_layout(ranks: list[int], ranks_per_node: int) -> tuple[int, int] | str:
    """``node_layout`` of the global ``ranks`` of a group."""
    nodes = [r // ranks_per_node for r in ranks]
    distinct = sorted(set(nodes), key=nodes.index)
    local = len(ranks) // len(distinct)
    if len(ranks) % len(distinct) or nodes != [n for n in distinct for _ in range(local)]:
        return (f"its ranks {ranks} are not whole node-major blocks of equal size on nodes of {ranks_per_node} "
                f"ranks; hierarchical dispatch needs strategy.expert_parallel_size (now {len(ranks)}) to be a "
                f"multiple of the devices per node ({ranks_per_node}), each group's ranks node-major")
    return len(distinct), local


def _subgroups(group: dist.ProcessGroup, nodes: int, local: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's inter-node group (same local index on every node) and intra-node group.

    ``new_group`` is collective over the world, so every rank creates every expert-parallel group's
    subgroups in one order (learnt with one ``all_gather_object``)."""
    groups = [None] * dist.get_world_size()
    dist.all_gather_object(groups, dist.get_process_group_ranks(group))
    mine, inter, intra = dist.get_rank(), None, None
    for ranks in sorted(set(map(tuple, groups))):
        grid = [list(ranks[n * local:(n + 1) * local]) for n in range(nodes)]
        for l in range(local):
            made = dist.new_group([row[l] for row in grid])
            inter = made if mine in (row[l] for row in grid) else inter
        for row in grid:
            made = dist.new_group(row)
            intra = made if mine in row else intra
    return inter, intra


def node_reach(n_groups: int, n_limited_groups: int, num_experts: int, top_k: int, nodes: int
               ) -> tuple[str, str | None]:
    """How many of ``nodes`` (node-major experts) a token can reach under group-limited routing, and a warning
    when the groups straddle nodes (then the groups do not bound the nodes: not DeepSeek-V3's node limit)."""
    if n_groups == 1:
        return f"unrestricted routing: a token reaches up to {min(top_k, nodes)} of {nodes} nodes", None
    per_group, per_node = num_experts // n_groups, num_experts // nodes
    span = max(len({e // per_node for e in range(g * per_group, (g + 1) * per_group)}) for g in range(n_groups))
    reach = min(n_limited_groups * span, top_k, nodes)
    if span == 1:
        return (f"node-limited routing: {n_groups} groups of {per_group} experts, each within one node; a token "
                f"reaches at most {reach} of {nodes} nodes"), None
    return (f"group-limited routing not aligned with nodes: a token reaches up to {reach} of {nodes} nodes",
            f"model.config.n_expert_groups={n_groups} ({per_group} experts per group) does not align with the "
            f"expert-parallel layout's nodes ({per_node} experts per node, {nodes} nodes): a group spans up to {span} "
            f"nodes, so n_limited_groups={n_limited_groups} bounds a token only to {reach} nodes. For node-limited "
            f"routing (DeepSeek-V3's M) set n_expert_groups={nodes} (one group per node) and n_limited_groups to "
            f"the node bound M; this changes the model (its routing).")


@torch.no_grad()
def apply_expert_parallel(moe_layers: list[MoELayer], group: dist.ProcessGroup, ranks_per_node: int | None = None
                          ) -> str:
    """Keep this rank's contiguous block of ``E / ep`` experts and install the dispatcher; returns which, for the log.

    ``ranks_per_node`` (the launcher's ``LOCAL_WORLD_SIZE``, Lightning's ``devices``) picks it: hierarchical
    when the group spans several nodes, flat within one node (or when not given)."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    layout = node_layout(group, ranks_per_node) if ranks_per_node else (1, ep)
    hierarchical = isinstance(layout, tuple) and layout[0] > 1
    if hierarchical:
        inter, intra = _subgroups(group, *layout)
        dispatcher = HierarchicalTokenDispatcher(group, inter, intra, *layout)
        how = (f"hierarchical dispatch over {layout[0]} nodes x {layout[1]} ranks (each token crosses the network "
               f"once per destination node)")
    else:
        dispatcher = AllToAllTokenDispatcher(group)
        how = "flat all-to-all dispatch" + (f" (not hierarchical: {layout})" if isinstance(layout, str) else
                                            f" within one node of {ep} ranks")
    for moe in moe_layers:
        experts = moe.experts
        local = experts.num_experts // ep
        for name, param in list(experts.named_parameters(recurse=False)):
            block = param[ep_rank * local:(ep_rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(block, requires_grad=param.requires_grad))
        moe.dispatcher = dispatcher
    if moe_layers and hierarchical:
        moe = moe_layers[0]
        reach, warning = node_reach(moe.router.n_groups, moe.router.n_limited_groups, moe.num_experts, moe.top_k,
                                    layout[0])
        how += "; " + reach
        if warning and dist.get_rank() == 0:
            warnings.warn(warning)
    return f"expert parallelism over {ep} ranks: {how}."
