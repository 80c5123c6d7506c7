"""Expert parallelism: each rank of an ``ep`` group keeps ``E / ep`` experts and exchanges tokens all-to-all.

The model is untouched: :func:`apply_expert_parallel` slices every ``GroupedExperts`` to its local experts and swaps
the MoE layer's ``dispatcher`` for :class:`AllToAllTokenDispatcher` (the group sits in one node) or
:class:`HierarchicalTokenDispatcher` (it spans nodes: each token crosses the network once per node).

Every exchange is one ``all_to_all_single`` of packed rows (hidden state, routing weights, expert ids side by side
as bytes, gathered straight into the send buffer), launched asynchronously. The layer's tokens go through in
``overlap_chunks`` chunks, software-pipelined: while chunk ``i`` runs its experts, chunk ``i + 1``'s dispatch and
chunk ``i - 1``'s combine are in flight; autograd runs the mirror image in backward. The work the MoE layer hands
over (its shared experts) runs while the first dispatch is in flight. The split sizes of every chunk are read back
to the host once per MoE forward.

``dispatch_dtype=float8_e4m3fn`` sends the dispatch hops' hidden rows as e4m3 with a power-of-two fp32 scale per 128
columns, in the same packed buffer (DeepEP's FP8 dispatch); the combine and every gradient stay in the training
dtype. Transient memory: a hop's send buffer lives until its wait, the rows it was packed from are dropped before
(the hierarchical inter hop's landed rows once the intra hop has them); the peak at 1 chunk is the experts' output
and its copy in source order, ``2 x rows received x dim`` above the saved activations, and N chunks divide it
(``benchmarks/ep_dispatch.py --memory`` measures it).

Which dispatcher a group gets is decided from the whole job's layout (every rank's node and group, learnt in one
world collective every rank enters), so every rank takes the same decisions and creates the same sub-groups.
"""

import os
import socket
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe_lightning.model import GroupedExperts, MoELayer
from moe_lightning.model.moe import sum_into_tokens
from moe_lightning.run import heartbeat
from moe_lightning.parallel.mesh import node_groups


def _pack(pieces: list[tuple[torch.Tensor, torch.Tensor | None]]
          ) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]] | None, list[int]]:
    """Rows ``t[index]`` (``[R, c_i]``, any dtypes) side by side in one ``[R, bytes]`` uint8 send buffer, gathered
    straight into it (no gathered copy, no concatenation). One piece: its rows as they are.

    Widest dtype first and the row padded to it, so every piece is viewed back without a copy. Returns the buffer,
    the layout (dtype, bytes) in buffer order, and where each piece went."""
    rows = [(t if t.dim() == 2 else t[:, None], index) for t, index in pieces]
    R = rows[0][1].numel() if rows[0][1] is not None else rows[0][0].shape[0]
    if len(rows) == 1:
        t, index = rows[0]
        return (t.contiguous() if index is None else t.index_select(0, index)), None, [0]
    where = sorted(range(len(rows)), key=lambda i: -rows[i][0].element_size())  # stable
    layout = [(rows[i][0].dtype, rows[i][0].shape[1] * rows[i][0].element_size()) for i in where]
    width = sum(w for _, w in layout)
    width += -width % rows[where[0]][0].element_size()
    buffer = torch.empty(R, width, dtype=torch.uint8, device=rows[0][0].device)
    start = 0
    for i, (dtype, w) in zip(where, layout):
        t, index = rows[i]
        view = buffer[:, start:start + w].view(dtype)
        if index is None:
            view.copy_(t)
        else:
            torch.index_select(t, 0, index, out=view)
        start += w
    return buffer, layout, where


FP8_BLOCK = 128  # columns sharing one scale, as DeepEP's FP8 dispatch


def quantize_rows(x_RD: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_RD`` as ``dtype`` (float8) with one fp32 scale per 128-column block (the last block may be narrower).

    Scales are powers of two (the block's absolute maximum over the format's largest value, rounded up to one): the
    dequantized values are exact in bf16/fp32 and quantizing them again gives the same values, so the
    hierarchical dispatcher's second hop adds no error. Costs up to one bit of range against an exact ``amax / 448`` scale.
    A block holding inf or NaN gets that amax as its scale, so it lands non-finite (NaN) and the NaN guard sees it
    as it would the training dtype's rows (a finite scale would saturate it to +-448 silently)."""
    R, D = x_RD.shape
    B = -(-D // FP8_BLOCK)
    padded_RBb = torch.nn.functional.pad(x_RD.float(), (0, B * FP8_BLOCK - D)).view(R, B, FP8_BLOCK)
    amax_RB = padded_RBb.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / torch.finfo(dtype).max
    mantissa, exponent = torch.frexp(amax_RB)  # amax = m * 2^e, m in [0.5, 1): 2^e, or 2^(e-1) when m = 0.5
    scale_RB = torch.ldexp(torch.ones_like(amax_RB), exponent - (mantissa == 0.5).to(exponent.dtype))
    scale_RB = torch.where(amax_RB.isfinite(), scale_RB, amax_RB)  # frexp gives inf and NaN exponent 0: scale 1
    q_RD = (padded_RBb / scale_RB[..., None]).view(R, B * FP8_BLOCK)[:, :D].to(dtype)
    return q_RD, scale_RB


def dequantize_rows(q_RD: torch.Tensor, scale_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    D = q_RD.shape[1]
    return (q_RD.float() * scale_RB.repeat_interleave(FP8_BLOCK, 1)[:, :D]).to(dtype)


# The busiest rank's received rows over the mean that `plan` prices the exchange's transient buffers at (its
# --ep-imbalance default); measured skew reached 3.97x (docs/benchmarks.md), so a run past it is told.
PLANNED_IMBALANCE = 1.5


class SkewWarning:
    """Warns once per process when this rank's experts receive more rows than ``PLANNED_IMBALANCE`` x its own
    tokens x top-k (the mean under equal tokens per rank), naming the MoE layer and the factor: the exchange is
    dropless, so its receive buffers grow with the skew beyond what `plan` priced. Reads only the split sizes the
    dispatcher already has on the host (no extra sync). ``layer_names``: MoE layer names by their experts module
    (``name_layers``)."""

    def __init__(self):
        self.layer_names: dict[int, str] = {}
        self.warned = False

    def name_layers(self, moe_layers: list[MoELayer]) -> None:
        self.layer_names = {id(moe.experts): f"MoE layer {i}" for i, moe in enumerate(moe_layers)}

    def check(self, received_rows: int, tokens: int, top_k: int, experts: GroupedExperts) -> None:
        if self.warned or not tokens or received_rows <= PLANNED_IMBALANCE * tokens * top_k:
            return
        self.warned = True
        name = self.layer_names.get(id(experts), "a MoE layer")
        factor = received_rows / (tokens * top_k)
        warnings.warn(f"expert parallelism: {name} received {received_rows} rows on rank {dist.get_rank()}, "
                      f"{factor:.2f}x its {tokens} tokens x top-{top_k}, above the {PLANNED_IMBALANCE}x imbalance "
                      f"plan prices the exchange's buffers at (dropless: they grow with the skew; plan "
                      f"--ep-imbalance {factor:.2f} prices it). Warned once.", stacklevel=3)


def _unpack(buffer: torch.Tensor, layout: list[tuple[torch.dtype, int]] | None, where: list[int]
            ) -> list[torch.Tensor]:
    if layout is None:
        return [buffer]
    out, start = [None] * len(where), 0
    for i, (dtype, width) in zip(where, layout):
        out[i] = buffer[:, start:start + width].view(dtype)
        start += width
    return out


class _Exchange:
    """One all-to-all of row tensors in flight: launched by :class:`_Launch`, awaited by :class:`_Land`.

    Its backward runs the reverse exchange of the floating-point rows' gradients the same way: launched by
    ``_Land.backward``, awaited by ``_Launch.backward``, so whatever autograd runs in between overlaps it. The
    gradients are multiplied by ``grad_scale``.

    ``quantize`` (a float8 dtype): the forward sends the first piece's rows in it with their block scales
    (:func:`quantize_rows`) and lands them dequantized to the piece's dtype; the backward sends the gradients in
    the training dtype (the quantization's gradient is taken as the identity)."""

    def __init__(self, group: dist.ProcessGroup, send_splits: list[int], recv_splits: list[int], grad_scale: float,
                 quantize: torch.dtype | None = None):
        self.group, self.send_splits, self.recv_splits, self.grad_scale = group, send_splits, recv_splits, grad_scale
        self.quantize, self._dequantize_to = quantize, None
        self._work = self._buffers = self._layout = self._where = None

    def launch(self, pieces: list[tuple[torch.Tensor, torch.Tensor | None]], send: list[int], recv: list[int],
               forward: bool = False):
        if forward and self.quantize is not None:
            (x, index), *rest = pieces
            q, scale = quantize_rows(x.detach().flatten(1), self.quantize)  # 0 rows too: an empty chunk
            self._dequantize_to = x.dtype
            pieces = [(q.view(torch.uint8), index), (scale, index), *rest]
            del q, scale  # the packed buffer holds them; nothing else must
        buffer, self._layout, self._where = _pack(pieces)
        del pieces
        out = buffer.new_empty((sum(recv), *buffer.shape[1:]))
        heartbeat.entered("all_to_all", self.group)  # the stall watchdog's record (no-op without one)
        self._work = dist.all_to_all_single(out, buffer, recv, send, group=self.group, async_op=True)
        self._buffers = (buffer, out)  # the send buffer lives until the exchange completes

    def land(self) -> list[torch.Tensor]:
        started = time.perf_counter()
        self._work.wait()  # only this blocks: the compute run since the launch is not waiting
        heartbeat.waited(time.perf_counter() - started)
        heartbeat.finished(self._buffers[1])  # on CUDA: an event tells the watchdog when the device completes it
        out = _unpack(self._buffers[1], self._layout, self._where)
        self._work = self._buffers = None  # the send buffer is released here, the received rows live on in `out`
        if self._dequantize_to is not None:
            q, scale, *rest = out
            out = [dequantize_rows(q.view(self.quantize), scale, self._dequantize_to), *rest]
            self._dequantize_to = None
        return out


class _Launch(torch.autograd.Function):
    """Send ``sources[i][indices[i]]`` (``None``: all rows); backward adds the returned gradients into the sources."""

    @staticmethod
    def forward(ctx, exchange: _Exchange, indices: tuple, *sources: torch.Tensor) -> torch.Tensor:
        ctx.exchange, ctx.floating = exchange, [s.is_floating_point() for s in sources]
        ctx.shapes = [s.shape for s in sources]
        ctx.save_for_backward(*(i for i in indices if i is not None))
        ctx.has_index = [i is not None for i in indices]
        exchange.launch(list(zip(sources, indices)), exchange.send_splits, exchange.recv_splits, forward=True)
        return sources[0].new_empty(0)  # a token linking _Land to the sources in the graph

    @staticmethod
    def backward(ctx, _):
        grads = iter(ctx.exchange.land())
        indices = iter(ctx.saved_tensors)
        scale, out = ctx.exchange.grad_scale, []
        for floating, has_index, shape in zip(ctx.floating, ctx.has_index, ctx.shapes):
            index = next(indices) if has_index else None
            if not floating:
                out.append(None)
                continue
            g = next(grads)
            g = g * scale if scale != 1 else g
            if index is not None:
                g = g.new_zeros(shape[0], g.shape[1]).index_add_(0, index, g)
            out.append(g.view(shape))
        return None, None, *out


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
        grads = [(g, None) for g, f in zip(grads, ctx.floating) if f]
        ctx.exchange.launch(grads, ctx.exchange.recv_splits, ctx.exchange.send_splits)
        dtype, device = ctx.token
        return None, torch.empty(0, dtype=dtype, device=device)


def _launch(group, send_splits, recv_splits, grad_scale, *pieces: tuple[torch.Tensor, torch.Tensor | None],
            quantize: torch.dtype | None = None):
    """Start exchanging rows ``tensor[index]`` of each piece (the first in ``quantize`` when given); returns the
    handle :func:`_land` takes."""
    exchange = _Exchange(group, send_splits, recv_splits, grad_scale, quantize)
    return exchange, _Launch.apply(exchange, tuple(i for _, i in pieces), *(t for t, _ in pieces))


def _land(handle) -> tuple[torch.Tensor, ...]:
    return _Land.apply(*handle)


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row ``p`` of ``counts`` to rank ``p``; returns what each rank sent here (no host sync)."""
    out = torch.empty_like(counts)
    with heartbeat.collective("all_to_all", group):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _chunk_counts(experts_TK: torch.Tensor, bounds: list[tuple[int, int]], num_experts: int,
                  tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Tokens per expert of each chunk, ``[chunks, E]`` (no host sync)."""
    if len(bounds) == 1:
        return tokens_per_expert_E[None]
    counts_CE = experts_TK.new_zeros(len(bounds), num_experts)
    for c, (a, b) in enumerate(bounds):
        flat = experts_TK[a:b].flatten()
        counts_CE[c].scatter_add_(0, flat, torch.ones_like(flat))
    return counts_CE


def _bounds(T: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous token ranges of (nearly) equal size, known without reading anything back."""
    edges = [T * c // chunks for c in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _through_experts(group, grad_scale, x_RD, weights_RK, experts_RK, send_splits, recv_splits, recv_counts_PE,
                     experts: GroupedExperts, quantize: torch.dtype | None = None) -> Iterator[None]:
    """One copy of each row per chosen expert (``experts_RK`` indexes this group's experts; -1: none) to the
    expert's rank, through the experts (weighted), back, and summed into the rows. A generator: it yields after
    each launch (the scheduler runs other chunks meanwhile) and returns ``y_RD``.

    The dispatch exchange's backward multiplies by ``grad_scale`` and the return's by its inverse; ``quantize``:
    the dispatch's hidden rows go in that float8 dtype (the return and all gradients in the rows' dtype)."""
    P, local, K = len(recv_splits), experts.num_experts, experts_RK.shape[1]
    choice = torch.where(experts_RK >= 0, experts_RK, P * local).flatten()  # "none" sorts last and is cut
    order = choice.argsort(stable=True)[:sum(send_splits)]
    del choice, experts_RK
    row_of_copy = order // K
    handle = _launch(group, send_splits, recv_splits, grad_scale, (x_RD, row_of_copy),
                     (weights_RK.reshape(-1, 1), order), quantize=quantize)
    # The rows are in the send buffer: drop them before waiting (the hierarchical dispatcher's received rows are
    # freed here, not after this chunk's experts). What the output needs of them: shape, dtype, device.
    shape_of, device = x_RD.new_empty(1, 1).expand(x_RD.shape), x_RD.device
    del x_RD, weights_RK, order
    yield
    x_recv, weight_recv = _land(handle)
    del handle
    # Received rows are grouped [source rank][local expert]; the experts want [local expert][source rank].
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=device).repeat(P),
                                            recv_counts_PE.flatten(), output_size=sum(recv_splits))
    by_expert = expert_of_row.argsort(stable=True)
    del expert_of_row
    x_by_expert, weight_by_expert = x_recv[by_expert], weight_recv[by_expert]
    del x_recv, weight_recv
    y_by_expert = experts(x_by_expert, recv_counts_PE.sum(0), weight_by_expert)
    del x_by_expert
    # Undo the regrouping without a second sort; index_put_ keeps only the indices (index_copy_ the rows too).
    y_recv = torch.empty_like(y_by_expert).index_put_((by_expert,), y_by_expert)
    del y_by_expert
    handle = _launch(group, recv_splits, send_splits, 1.0 / grad_scale, (y_recv, None))
    del y_recv
    yield
    (y_copies,) = _land(handle)
    return sum_into_tokens(y_copies, row_of_copy, shape_of)


def _pipeline(flows: list[Iterator[None]], overlap: Callable[[], torch.Tensor] | None
              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Run the chunks' flows as a software pipeline: each tick starts the next chunk (its first launch), then
    advances every older chunk by one stage, newest first, so a chunk's exchange is in flight while the chunk
    ahead of it computes. ``overlap()`` runs right after the first launch. Returns each flow's result."""
    pending, live, results, extra = list(enumerate(flows)), [], {}, None
    while pending or live:
        if pending:
            live.insert(0, pending.pop(0))
        for item in list(live):
            try:
                next(item[1])
            except StopIteration as done:
                results[item[0]] = done.value
                live.remove(item)
        if overlap is not None and extra is None:
            extra = overlap()
    return [results[i] for i in range(len(flows))], extra


def _joined(ys: list[torch.Tensor], extra: torch.Tensor | None) -> torch.Tensor:
    """The chunks' outputs in one tensor. Concatenated at the end (the chunk outputs and their copy coexist then,
    when no exchange buffer is left): a preallocated output would be alive through every chunk's exchange."""
    y_TD = ys[0] if len(ys) == 1 else torch.cat(ys)
    return y_TD if extra is None else y_TD + extra


class AllToAllTokenDispatcher:
    """Token dispatch across an expert-parallel group (the ``TokenDispatcher`` protocol of ``model/moe.py``).

    Steps: exchange per-expert counts of every chunk (one exchange), read the split sizes once, then per chunk: sort
    token copies by global expert and send them with their routing weights (one packed exchange), regroup them by
    local expert, run the local experts (weighted), undo the regrouping, send back and sum into the token rows.

    Gradient scale: an expert's weight gradient sums the contributions of all ``ep`` ranks' tokens, and FSDP then
    averages it over the ``world / ep`` ranks holding the same experts, which is ``ep`` times the data-parallel
    mean. With ``scale_in_exchange`` the return exchange scales its backward by ``1/ep`` and the dispatch exchange
    by ``ep``: every gradient equals the ``ep = 1`` run exactly only when ``ep`` is a power of two (otherwise the
    activation gradients are rounded twice). Without it nothing is scaled here and the caller divides the expert
    gradients by ``ep`` where FSDP reduces them (:func:`divide_expert_gradients`): exact at any ``ep``.
    """

    def __init__(self, group: dist.ProcessGroup, overlap_chunks: int = 1, scale_in_exchange: bool = True,
                 dispatch_dtype: torch.dtype | None = None):
        self.group, self.chunks, self.dispatch_dtype = group, overlap_chunks, check_dispatch_dtype(dispatch_dtype)
        self.ep = dist.get_world_size(group)
        self.grad_scale = float(self.ep) if scale_in_exchange else 1.0
        self.skew = SkewWarning()

    @torch.compiler.disable  # host-side split sizes: a compiled block runs this part eagerly
    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts,
                 overlap: Callable[[], torch.Tensor] | None = None):
        P, El = self.ep, experts.num_experts
        bounds = _bounds(x_TD.shape[0], self.chunks)
        C = len(bounds)
        send_CPE = _chunk_counts(experts_TK, bounds, P * El, tokens_per_expert_E).view(C, P, El)
        recv_PCE = _exchange_counts(send_CPE.transpose(0, 1).reshape(P, C * El), self.group).view(P, C, El)
        splits = torch.stack([send_CPE.sum(2), recv_PCE.sum(2).T]).tolist()  # one sync for every chunk
        self.skew.check(sum(map(sum, splits[1])), x_TD.shape[0], experts_TK.shape[1], experts)
        flows = [_through_experts(self.group, self.grad_scale, x_TD[a:b], weights_TK[a:b], experts_TK[a:b],
                                  splits[0][c], splits[1][c], recv_PCE[:, c], experts, self.dispatch_dtype)
                 for c, (a, b) in enumerate(bounds)]
        return _joined(*_pipeline(flows, overlap))


class HierarchicalTokenDispatcher:
    """Token dispatch across an expert-parallel group spanning ``nodes`` nodes of ``local`` ranks each: DeepEP's
    pattern.

    A token's hidden state crosses the network once per node holding any of its experts: to the rank of that node
    with the sender's local index, with its ``K`` routing weights and node-local expert ids (one packed exchange
    over the ``inter`` group). That rank fans it out to the node's experts over the ``intra`` group
    (:func:`_through_experts`), sums their weighted outputs, and sends one row back. Counts of both hops for every
    chunk are exchanged first and read back together (one host sync); chunks are pipelined as in
    :class:`AllToAllTokenDispatcher`.

    ``position_E`` (from :func:`plan_layout`) numbers the group's experts as this rank's ``inter`` group sees them:
    node position (its rank order in ``inter``) times experts per node, plus the index within the node (``intra``
    rank order); the identity when the group is laid out node-major. Equal to the flat dispatcher up to the order
    of two sums: a token's expert outputs are added per node, then across nodes (identical for ``top_k <= 2``), and
    an expert's weight gradient adds its rows in another order. Gradient scaling as there (on the inter hop).
    """

    def __init__(self, group: dist.ProcessGroup, inter: dist.ProcessGroup, intra: dist.ProcessGroup,
                 nodes: int, local: int, position_E: list[int] | None = None, overlap_chunks: int = 1,
                 scale_in_exchange: bool = True, dispatch_dtype: torch.dtype | None = None):
        self.dispatch_dtype = check_dispatch_dtype(dispatch_dtype)
        self.group, self.inter, self.intra, self.nodes, self.local = group, inter, intra, nodes, local
        self.ep, self.chunks, self.position_E = nodes * local, overlap_chunks, position_E
        self.grad_scale = float(self.ep) if scale_in_exchange else 1.0
        self.skew = SkewWarning()

    @torch.compiler.disable  # host-side split sizes: a compiled block runs this part eagerly
    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts,
                 overlap: Callable[[], torch.Tensor] | None = None):
        N, L, El = self.nodes, self.local, experts.num_experts
        per_node = L * El
        if self.position_E is not None:
            position_E = torch.tensor(self.position_E, device=experts_TK.device)
            experts_TK = position_E[experts_TK]
            tokens_per_expert_E = torch.zeros_like(tokens_per_expert_E).index_copy_(0, position_E,
                                                                                   tokens_per_expert_E)
        bounds = _bounds(x_TD.shape[0], self.chunks)
        C = len(bounds)
        node_TK = experts_TK // per_node
        wanted_NT = torch.zeros(N, x_TD.shape[0], dtype=torch.bool, device=x_TD.device).scatter_(0, node_TK.T, True)
        rows_CN = torch.stack([wanted_NT[:, a:b].sum(1) for a, b in bounds])
        counts_CNE = _chunk_counts(experts_TK, bounds, N * per_node, tokens_per_expert_E).view(C, N, per_node)
        # Per destination node and chunk: rows (distinct tokens), then tokens per expert of that node.
        send_CNM = torch.cat([rows_CN[..., None], counts_CNE], 2)
        recv_NCM = _exchange_counts(send_CNM.transpose(0, 1).reshape(N, -1), self.inter).view(N, C, -1)
        node_counts_CLE = recv_NCM[:, :, 1:].sum(0).view(C, L, El)  # what this rank sends to each local rank
        recv_LCE = _exchange_counts(node_counts_CLE.transpose(0, 1).reshape(L, -1), self.intra).view(L, C, El)
        splits = torch.cat([send_CNM[..., 0], recv_NCM[..., 0].T, node_counts_CLE.sum(2), recv_LCE.sum(2).T],
                           1).tolist()  # one sync for every chunk and both hops
        self.skew.check(sum(sum(chunk[2 * N + L:]) for chunk in splits), x_TD.shape[0], experts_TK.shape[1], experts)
        flows = [self._flow(x_TD[a:b], weights_TK[a:b], experts_TK[a:b], node_TK[a:b], wanted_NT[:, a:b],
                            splits[c], recv_LCE[:, c], experts) for c, (a, b) in enumerate(bounds)]
        return _joined(*_pipeline(flows, overlap))

    def _flow(self, x_TD, weights_TK, experts_TK, node_TK, wanted_NT, splits, recv_counts_PE, experts):
        N, L, T = self.nodes, self.local, x_TD.shape[0]
        per_node = L * experts.num_experts
        inter_send, inter_recv = splits[:N], splits[N:2 * N]
        intra_send, intra_recv = splits[2 * N:2 * N + L], splits[2 * N + L:]
        # One row per (destination node, token), node-major: the token, its weights, its experts on that node.
        order = (~wanted_NT).flatten().to(torch.uint8).argsort(stable=True)[:sum(inter_send)]
        node_of_row, token_of_row = order // T, order % T
        on_node_RK = node_TK[token_of_row] == node_of_row[:, None]
        node_experts_RK = torch.where(on_node_RK, experts_TK[token_of_row] - node_of_row[:, None] * per_node, -1)
        handle = _launch(self.inter, inter_send, inter_recv, self.grad_scale, (x_TD, token_of_row),
                         (weights_TK, token_of_row), (node_experts_RK.to(torch.int32), None),
                         quantize=self.dispatch_dtype)
        del node_experts_RK, on_node_RK, order, node_of_row
        yield
        # The landed rows go straight on (no local keeps them: they are freed once the intra hop has them)
        y_RD = yield from _through_experts(self.intra, 1.0, *_land(handle), intra_send, intra_recv, recv_counts_PE,
                                           experts, self.dispatch_dtype)
        handle = _launch(self.inter, inter_recv, inter_send, 1.0 / self.grad_scale, (y_RD, None))
        del y_RD
        yield
        (y_rows,) = _land(handle)
        return sum_into_tokens(y_rows, token_of_row, x_TD)


def node_identity() -> str:
    """This process's node as its launcher names it: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``,
    Lightning's ``NODE_RANK``, else the host name. (Never ``global_rank // devices``: SLURM's cyclic placement puts
    neighbouring ranks on different nodes.)"""
    for name in ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK"):
        if name in os.environ:
            return f"{name}={os.environ[name]}"
    return socket.gethostname()


def group_layout(ranks: list[int], node_of: dict[int, Hashable], gpus_per_node: list[int] | None = None
                 ) -> list[list[int]] | str:
    """The ranks of one group per node (nodes ordered by their first rank), when every node of the group holds the
    same number of them; else why hierarchical dispatch cannot be used. Pure: every rank computes the same.
    ``gpus_per_node``: the distinct node sizes (counted once by the caller of many groups; else counted here)."""
    per_node: dict[Hashable, list[int]] = {}
    for r in ranks:
        per_node.setdefault(node_of[r], []).append(r)
    blocks = [sorted(b) for b in per_node.values()]
    if len({len(b) for b in blocks}) > 1:
        gpus_text = "/".join(map(str, gpus_per_node or sorted(set(Counter(node_of.values()).values()))))
        return (f"strategy.expert_parallel_size={len(ranks)} puts {' + '.join(str(len(b)) for b in blocks)} ranks of "
                f"the group {ranks} on its nodes ({gpus_text} GPUs per node): hierarchical dispatch needs the same "
                f"number on each node; choose expert_parallel_size dividing or a multiple of the GPUs per node "
                f"({gpus_text}) for hierarchical dispatch")
    return blocks


def plan_layout(table: list[tuple[Hashable, tuple[int, ...]]]) -> dict[tuple[int, ...], list[list[int]] | str]:
    """Every expert-parallel group's dispatch from every rank's ``(node, group ranks)``: its ranks per node when
    hierarchical, else why flat (a sentence). Pure, so every rank takes the same decision from the same table."""
    node_of = {rank: node for rank, (node, _) in enumerate(table)}
    sizes = sorted(set(Counter(node_of.values()).values()))  # once: at 1,536 ranks the per-group recount took seconds
    plans = {}
    for ranks in sorted({group for _, group in table}):
        layout = group_layout(list(ranks), node_of, sizes)
        plans[ranks] = layout if isinstance(layout, str) or len(layout) > 1 else f"within one node of {len(ranks)} ranks"
    return plans


def expert_positions(blocks: list[list[int]], group_ranks: list[int], experts_per_rank: int, me: int) -> list[int] | None:
    """``position_E`` of :class:`HierarchicalTokenDispatcher` for rank ``me``: its inter group orders the nodes by
    their rank with ``me``'s index within the node; inside a node the ranks are in rank order. None: identity."""
    l = next(b.index(me) for b in blocks if me in b)
    node_order = sorted(range(len(blocks)), key=lambda n: blocks[n][l])
    position_E = [0] * (len(group_ranks) * experts_per_rank)
    per_node = len(blocks[0]) * experts_per_rank
    for place, n in enumerate(node_order):
        for i, rank in enumerate(blocks[n]):
            p = group_ranks.index(rank)  # the rank's expert block
            for j in range(experts_per_rank):
                position_E[p * experts_per_rank + j] = place * per_node + i * experts_per_rank + j
    return None if position_E == list(range(len(position_E))) else position_E


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


def divide_expert_gradients(experts_unit, mesh: DeviceMesh, ep: int) -> None:
    """With ``scale_in_exchange=False``: make FSDP divide the gradients of an expert unit sharded over ``mesh`` by
    ``mesh.size() * ep`` (the whole data-parallel size) once, after the sum, in its reduce dtype: the ``ep = 1``
    mean at any ``ep``, with no rounding of the activation gradients. Summed, then divided (gloo has no NCCL
    pre-multiplied sum). Over one rank FSDP copies and divides by the factor itself; forcing the sum there would
    divide twice (torch 2.13)."""
    experts_unit.set_gradient_divide_factor(float(mesh.size() * ep))
    if mesh.size() > 1:
        experts_unit.set_force_sum_reduction_for_comms(True)


def check_overlap_chunks(overlap_chunks: int) -> None:
    if not isinstance(overlap_chunks, int) or isinstance(overlap_chunks, bool) or overlap_chunks < 1:
        raise ValueError(f"strategy.ep_overlap_chunks={overlap_chunks!r}: must be a positive integer (1: no "
                         f"chunking; 2-4 hide the exchange behind the experts).")


def check_dispatch_dtype(dispatch_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dispatch hops' dtype for the hidden rows: None (the training dtype) or float8_e4m3fn (also by name)."""
    if dispatch_dtype is None or dispatch_dtype in (torch.float8_e4m3fn, "float8_e4m3fn"):
        return None if dispatch_dtype is None else torch.float8_e4m3fn
    raise ValueError(f"strategy.dispatch_dtype={dispatch_dtype!r}: must be null (the training dtype) or "
                     f"'float8_e4m3fn' (FP8 dispatch with a scale per 128 columns).")


def make_dispatcher(group: dist.ProcessGroup, experts_per_rank: int, node: Hashable | None = None,
                    overlap_chunks: int = 1, scale_in_exchange: bool = True, dispatch_dtype: torch.dtype | None = None
                    ) -> tuple[AllToAllTokenDispatcher | HierarchicalTokenDispatcher, str]:
    """The dispatcher of this rank's expert-parallel ``group`` and a sentence saying which and why.

    Every rank of the world must call this together: one ``all_gather_object`` learns every rank's node and group,
    and every hierarchical group's sub-groups are created by all (``mesh.node_groups``), so no rank waits in a
    collective the others skip.
    ``node``: this process's node as the launcher names it (Lightning's ``node_rank``; default
    :func:`node_identity`). A group whose every node holds the same number of its ranks, on several nodes, gets
    hierarchical dispatch; any other group flat all-to-all, with the reason."""
    check_overlap_chunks(overlap_chunks)
    dispatch_dtype = check_dispatch_dtype(dispatch_dtype)
    group_ranks = dist.get_process_group_ranks(group)
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, (node_identity() if node is None else node, tuple(group_ranks)))
    plans = plan_layout(table)
    inter, intra = node_groups(plans, "cuda" if dist.get_backend(group) == "nccl" else "cpu")
    layout = plans[tuple(group_ranks)]
    options = dict(overlap_chunks=overlap_chunks, scale_in_exchange=scale_in_exchange, dispatch_dtype=dispatch_dtype)
    chunks = f", {overlap_chunks} overlap chunk{'s' if overlap_chunks > 1 else ''}"
    chunks += ", FP8 dispatch (float8_e4m3fn, a power-of-two scale per 128 columns)" if dispatch_dtype else ""
    if isinstance(layout, str):
        how = "flat all-to-all dispatch " + (layout if layout.startswith("within") else f"(not hierarchical: {layout})")
        return AllToAllTokenDispatcher(group, **options), how + chunks
    position_E = expert_positions(layout, group_ranks, experts_per_rank, dist.get_rank())
    dispatcher = HierarchicalTokenDispatcher(group, inter, intra, len(layout), len(layout[0]), position_E, **options)
    return dispatcher, (f"hierarchical dispatch over {len(layout)} nodes x {len(layout[0])} ranks (each token crosses "
                        f"the network once per destination node){chunks}")


@torch.no_grad()
def apply_expert_parallel(moe_layers: list[MoELayer], group: dist.ProcessGroup, node: Hashable | None = None,
                          overlap_chunks: int = 1, scale_in_exchange: bool = True,
                          dispatch_dtype: torch.dtype | None = None) -> str:
    """Keep this rank's contiguous block of ``E / ep`` experts and install the dispatcher of :func:`make_dispatcher`
    (every rank of the world calls this together); returns which, for the log. ``overlap_chunks``: chunks the
    layer's tokens go through, pipelined (1: none). ``scale_in_exchange``: see :class:`AllToAllTokenDispatcher`."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = moe_layers[0].experts.num_experts // ep if moe_layers else 0
    dispatcher, how = make_dispatcher(group, per_rank, node, overlap_chunks, scale_in_exchange, dispatch_dtype)
    for moe in moe_layers:
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            block = param[ep_rank * per_rank:(ep_rank + 1) * per_rank].clone()
            setattr(experts, name, nn.Parameter(block, requires_grad=param.requires_grad))
        moe.dispatcher = dispatcher
    dispatcher.skew.name_layers(moe_layers)  # its warning names the layer
    if moe_layers and isinstance(dispatcher, HierarchicalTokenDispatcher):
        moe = moe_layers[0]
        reach, warning = node_reach(moe.router.n_groups, moe.router.n_limited_groups, moe.num_experts, moe.top_k,
                                    dispatcher.nodes)
        how += "; " + reach
        if warning and dist.get_rank() == 0:
            warnings.warn(warning)
    return f"expert parallelism over {ep} ranks: {how}."
