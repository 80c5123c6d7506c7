"""QK-clip (Kimi K2's MuonClip): after every optimizer step, shrink the query and key weights of each attention head
whose largest pre-softmax logit in that step exceeded a threshold, so the logits cannot keep growing under Muon.

The model records the maxima itself (the ``MaxLogitRecorder`` seam of its attention modules, switched on by this
callback); this callback combines them across ranks and rescales weight rows in place, on each rank's own shard.
No optimizer is involved: it works after any optimizer's step. Under pipeline stages each rank holds some layers:
the maxima are combined per layer of the whole model (``model_rows``), and each stage clips its own.
"""

import math

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moe_lightning.training.callbacks._logging import every_rank
from moe_lightning.training.lightning_internals import optimizer_step_ends
from moe_lightning.model.attention import MaxLogitRecorder, qk_clip_unsupported


def attention_modules(module: nn.Module) -> list[MaxLogitRecorder]:
    """Every attention module with the max-logit seam, in module order (the blocks', then any extra block's)."""
    return [m for m in module.modules() if isinstance(m, MaxLogitRecorder)]


def _name_order(name: str) -> list[tuple[int, int, str]]:
    """A sort key of a qualified module name that compares block indices as numbers (``layers.2`` < ``layers.10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def model_rows(names: list[str]) -> tuple[list[int], int]:
    """Where this rank's attention modules (qualified names, in module order) sit among the whole model's, and how
    many the model has: the union over ranks (one ``all_gather_object``, at fit start), ordered by name with block
    indices compared as numbers. Under pipeline stages each rank holds some of the layers, named as in the whole
    model; otherwise every rank holds all of them, in module order."""
    everyone = every_rank(names)
    model = names if all(held == names for held in everyone) else \
        sorted({name for held in everyone for name in held}, key=_name_order)
    row = {name: i for i, name in enumerate(model)}
    return [row[name] for name in names], len(model)


def clip_factors(max_logits_LH: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma = threshold / max`` for heads above the threshold, exactly 1 for the others (and NaN maxima)."""
    return torch.where(max_logits_LH > threshold, threshold / max_logits_LH, torch.ones_like(max_logits_LH))


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """This rank's rows of ``param`` and which rows of the full parameter they are.

    FSDP2 shards dim 0 as ``torch.chunk`` does (``ceil(rows / ranks)`` per rank, the last ranks may hold fewer
    or none); replicated mesh dimensions (HSDP) hold all rows of their shard. Under ``no_grad`` ``to_local()``
    is the shard itself, so scaling it scales the parameter.
    """
    if not isinstance(param, DTensor):
        return param, slice(0, param.shape[0])
    start, rows = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not isinstance(placement, Shard) or placement.dim != 0:
            raise ValueError(f"QKClip scales whole rows of row-sharded parameters; got placements "
                             f"{param.placements} (e.g. tensor parallelism): unsupported.")
        chunk = -(-rows // param.device_mesh.size(mesh_dim))
        offset = min(param.device_mesh.get_local_rank(mesh_dim) * chunk, rows)
        start, rows = start + offset, min(chunk, rows - offset)
    local = param.to_local()
    if local.shape[0] != rows:
        raise RuntimeError(f"QKClip: a shard of {tuple(param.shape)} holds {local.shape[0]} rows, expected {rows} "
                           f"from placements {param.placements}.")
    return local, slice(start, start + rows)


@torch.no_grad()
def scale_rows_(param: torch.Tensor, factor_R: torch.Tensor) -> None:
    """``param[r] *= factor_R[r]`` for this rank's rows; a factor of exactly 1 leaves a row bitwise as it was."""
    local, rows = local_rows(param)
    factor = factor_R[rows].to(device=local.device, dtype=local.dtype)
    local.mul_(factor.view(-1, *[1] * (local.dim() - 1)))


@torch.no_grad()
def clip_qk_(attentions: list[MaxLogitRecorder], max_logits_LH: torch.Tensor, threshold: float,
             alpha: float) -> torch.Tensor:
    """Rescale each module's query/key rows for its row of ``max_logits_LH``; returns ``gamma_LH``.

    The factors move to the parameters' device once (under ``cpu_offload`` one copy to the host, not one per
    parameter)."""
    gamma_LH = clip_factors(max_logits_LH, threshold)
    if not attentions:  # a pipeline stage without attention
        return gamma_LH
    param_device = next(attentions[0].parameters()).device
    for attention, gamma_H in zip(attentions, gamma_LH.to(param_device)):
        for param, factor_R in attention.qk_clip_scales(gamma_H, alpha):
            scale_rows_(param, factor_R)
    return gamma_LH


class QKClip(L.Callback):
    """Kimi K2's QK-clip: keeps every attention head's largest pre-softmax logit (scaled ``q·k``, masked positions
    excluded) near ``threshold``.

    During each training forward every attention module records, per head, its largest logit over the step's
    micro-batches. After each optimizer step the maxima are combined across ranks (one all-reduce of
    ``[attention layers, heads]``), and each head whose maximum exceeds ``threshold`` gets
    ``gamma = threshold / max``: its query rows are scaled by ``gamma ** alpha``, its key rows by
    ``gamma ** (1 - alpha)``, so its logits on that step's data are multiplied by ``gamma``. Heads at or below the
    threshold keep their weights bitwise. MLA: non-rotary query and key parts get ``gamma ** alpha`` and
    ``gamma ** (1 - alpha)``, the rotary query part ``gamma``, the shared rotary key nothing. GQA: a key head
    shared by several query heads is scaled by the smallest ``gamma`` of its group.

    The maxima are those of the forward that preceded the step (the weights before it), as in K2: a step can
    lift a logit past the threshold, and the next step's clip brings it back.

    Logs ``attention/max_logit`` (largest over layers and heads, before clipping) and ``attention/clipped_heads``
    every step as device tensors (Lightning reads them back on its logging steps only).

    Kernel: the maxima come from the attention kernel itself on CUDA, so while recording, attention without
    document masking runs FlexAttention (with one shared causal block mask) instead of SDPA's fused kernel;
    its speed may differ. Elsewhere they are recomputed exactly beside SDPA.

    Args:
        threshold: ``tau``, the largest logit a head keeps (K2: 100).
        alpha: How the rescaling splits between queries (``gamma ** alpha``) and keys (K2: 0.5).
    """

    def __init__(self, threshold: float = 100.0, alpha: float = 0.5):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
            raise ValueError(f"QKClip(threshold={threshold!r}): must be a finite number > 0 (Kimi K2 uses 100).")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise ValueError(f"QKClip(alpha={alpha!r}): must be in [0, 1] (the query's share of the rescaling; "
                             "K2 uses 0.5).")
        self.threshold, self.alpha = float(threshold), float(alpha)
        self._attentions: list[MaxLogitRecorder] = []
        self._rows: list[int] = []  # each local attention module's row among the whole model's
        self._rows_index: torch.Tensor | None = None  # the same on the module's device (indexing without a copy)
        self._model_layers = 0  # attention modules of the whole model (this rank's under pipeline stages)
        self._heads = 0  # query heads of every layer
        self.last_max_logits: torch.Tensor | None = None  # [layers, heads] of the last step, all ranks combined
        self.last_gamma: torch.Tensor | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a model QK-clip cannot bound, before it is built."""
        config = getattr(pl_module, "config", None)
        if config is not None and config.attention != "mla":
            message = qk_clip_unsupported(config.qk_norm, config.clip_qkv)
            if message is not None:
                raise ValueError(message)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._attentions = attention_modules(pl_module)
        names = {id(module): name for name, module in pl_module.named_modules()}
        # every rank gathers before any raises: a pipeline stage may hold no attention while the others do
        self._rows, self._model_layers = model_rows([names[id(a)] for a in self._attentions])
        if not self._model_layers:
            raise ValueError("QKClip: the model has no attention module recording max logits (GroupedQueryAttention "
                             "or MultiHeadLatentAttention); remove the callback.")
        config = getattr(pl_module, "config", None)  # the model's, also on a rank holding no attention
        self._heads = config.n_heads if config is not None else self._attentions[0].n_heads
        self._rows_index = torch.tensor(self._rows, dtype=torch.long, device=pl_module.device)
        for attention in self._attentions:
            attention.record_max_logits, attention.max_logits = True, None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for attention in self._attentions:
            attention.record_max_logits, attention.max_logits = False, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not optimizer_step_ends(trainer):  # not the last micro-batch of a step
            return
        max_logits_LH = self.collect_max_logits(pl_module.device)
        clip_qk_(self._attentions, max_logits_LH.index_select(0, self._rows_index), self.threshold, self.alpha)
        gamma_LH = clip_factors(max_logits_LH, self.threshold)  # every layer's, for the logs
        self.last_max_logits, self.last_gamma = max_logits_LH, gamma_LH
        pl_module.log("attention/max_logit", max_logits_LH.max())
        pl_module.log("attention/clipped_heads", (gamma_LH < 1).sum().float())

    def collect_max_logits(self, device: torch.device) -> torch.Tensor:
        """``[layers, heads]`` maxima of the step for every attention layer of the model, reset for the next step,
        combined over ranks (one all-reduce): a layer's row is ``-inf`` on the ranks of the stages without it."""
        max_logits_LH = torch.full((self._model_layers, self._heads), -math.inf, device=device)
        for attention, row in zip(self._attentions, self._rows):
            recorded = attention.max_logits
            attention.max_logits = None
            if recorded is not None:
                max_logits_LH[row] = recorded.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(max_logits_LH, op=dist.ReduceOp.MAX)
        return max_logits_LH
