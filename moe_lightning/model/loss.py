"""Output head + cross-entropy over chunks of tokens, so the ``[tokens, vocab]`` logits never exist at once.

At 65,536 tokens x 129,280 vocab the fp32 logits alone are 32 GiB, and autograd would keep them (or their
log-softmax) until backward. ``chunked_cross_entropy`` instead computes ``h @ W.T`` and the loss
``chunk_size`` tokens at a time and keeps one fp32 log-sum-exp per token; backward recomputes each chunk's
logits and turns them into that chunk's gradient. What autograd saves is the hidden states, the head weight
(the parameter itself, not a copy), the targets and the log-sum-exps; the largest transient is a few
``[chunk, vocab]`` buffers plus, in backward, the head's gradient.

The head weight enters the graph once, as one input of one autograd node, whatever the number of chunks.
The model calls it through ``OutputHead.cross_entropy``, a method of the head module, so that under FSDP2 the
head's unit runs a whole forward (gathered once, registered as an FSDP forward method) and its gradient is
reduced once.
"""

import torch


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h_TD @ w_VD.T`` against ``targets_T``; see ``chunked_cross_entropy``."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk_size: int, ignore_index: int, mean: bool = True):
        dtype = _compute_dtype(h_TD, w_VD)
        w_cast_VD = w_VD.to(dtype)  # no copy unless autocast narrows an fp32 weight
        valid_T = targets_T != ignore_index
        safe_T = targets_T.masked_fill(~valid_T, 0)
        lse_T = torch.empty(targets_T.shape, dtype=torch.float32, device=h_TD.device)
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for h_CD, t_C, v_C, lse_C in zip(*(x.split(chunk_size) for x in (h_TD, safe_T, valid_T, lse_T))):
            logits_CV = (h_CD.to(dtype) @ w_cast_VD.T).float()
            torch.logsumexp(logits_CV, dim=-1, out=lse_C)
            total += ((lse_C - logits_CV.gather(1, t_C[:, None]).squeeze(1)) * v_C).sum()
        count = valid_T.sum() if mean else torch.ones((), dtype=torch.long, device=h_TD.device)
        ctx.save_for_backward(h_TD, w_VD, safe_T, valid_T, lse_T, count)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return total / count  # 0/0 = nan when every target is ignored, as F.cross_entropy gives

    @staticmethod
    def backward(ctx, grad_loss):
        h_TD, w_VD, safe_T, valid_T, lse_T, count = ctx.saved_tensors
        w_cast_VD = w_VD.to(ctx.dtype)
        scale = grad_loss.float() / count
        grad_h_TD = torch.empty_like(h_TD)
        # fp32 accumulator: summing half-precision per-chunk products would round once per chunk
        grad_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        chunks = zip(*(x.split(ctx.chunk_size) for x in (h_TD, safe_T, valid_T, lse_T, grad_h_TD)))
        for h_CD, t_C, v_C, lse_C, grad_h_CD in chunks:
            h_CD = h_CD.to(ctx.dtype)
            # d loss / d logits = (softmax - one_hot(target)) * scale, built in place in the fp32 logits
            g_CV = (h_CD @ w_cast_VD.T).float().sub_(lse_C[:, None]).exp_()
            g_CV[torch.arange(len(t_C), device=t_C.device), t_C] -= 1.0
            g_CV = g_CV.mul_(v_C[:, None] * scale).to(ctx.dtype)
            grad_h_CD.copy_(g_CV @ w_cast_VD)
            grad_w_VD += g_CV.T @ h_CD
        return grad_h_TD, grad_w_VD.to(w_VD.dtype), None, None, None, None


def _compute_dtype(h_TD: torch.Tensor, w_VD: torch.Tensor) -> torch.dtype:
    """The matmul dtype the plain head would use: autocast's if active, else the wider of the two inputs."""
    device = h_TD.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h_TD.dtype, w_VD.dtype)


def chunked_cross_entropy(h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, chunk_size: int,
                          ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy((h_TD @ w_VD.T).float(), targets_T, ignore_index=ignore_index, reduction=reduction)``
    (``mean``: over targets that are not ``ignore_index``; ``sum``: their sum, 0 when none is left), computed
    ``chunk_size`` tokens at a time, softmax in fp32.

    Takes the head's weight rather than the head module: calling an FSDP-wrapped module once per chunk
    would run its hooks, and possibly its gradient reduction, once per chunk.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size={chunk_size!r} must be a positive integer.")
    if h_TD.dim() != 2 or w_VD.dim() != 2 or targets_T.shape != h_TD.shape[:1] or h_TD.shape[1] != w_VD.shape[1]:
        raise ValueError(f"chunked_cross_entropy: expected h [T, D], w [V, D], targets [T]; got {tuple(h_TD.shape)}, "
                         f"{tuple(w_VD.shape)}, {tuple(targets_T.shape)}.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction={reduction!r}: use 'mean' or 'sum'.")
    return _ChunkedCrossEntropy.apply(h_TD, w_VD, targets_T, chunk_size, ignore_index, reduction == "mean")


def context_parallel_mean(total_local: torch.Tensor, targets_BS: torch.Tensor, shards: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """One context-parallel rank's share of its sequences' mean cross-entropy: ``shards * total_local / count``,
    ``total_local`` the summed cross-entropy of this rank's positions, ``count`` the targets of the whole
    ``targets_BS`` (every rank of the group holds them) that are not ``ignore_index``.

    Why ``shards *``: the ranks' gradients sum to the gradient of ``shards x`` the sequences' mean (the key-side
    exchange returns each rank's share of every other rank's loss), and FSDP averages gradients over its
    dp x cp ranks, which divides by ``shards`` once more: the gradient equals the one without context
    parallelism. The mean of this value over the group is the sequences' mean loss (what to log)."""
    return total_local * shards / (targets_BS != ignore_index).sum()
