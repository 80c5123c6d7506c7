"""Pipeline parallelism over torch's ``torch.distributed.pipelining``: the stage layout, the refusals, and a stage
built from a ``MoETransformer`` without touching the model's code.

A pipeline stage is the model with the blocks of the other stages removed and every fully-qualified name kept
(``layers.5.attention.wq.weight`` stays that on whichever stage holds block 5), so a checkpoint written at any
stage count has the keys of one process. The first stage keeps the token embedding; the last keeps the final
norm, the head, the loss and the multi-token prediction (MTP) modules, and a copy of the embedding when it reads
it (MTP's shifted embeddings, or a head tied to it): that copy starts equal to the first stage's and stays equal
because the two stages sum their gradients (``sum_shared_embedding_grads``) before every optimizer step.

Stages ``s = 0 .. P·V - 1`` (``V`` stages per rank) sit on pipeline ranks as torch's schedules expect: round-robin
(``s % P``) for the looped schedules, a V (rank ``r`` holds ``r`` and ``2P - 1 - r``) for ``ZBVZeroBubble`` and
``DualPipeV``. The last stage returns, per micro-batch, the summed cross-entropy of each depth ``[1 + D]``;
``PipelineLoss`` weights them by the whole global batch's target counts, so the loss and every gradient are
those of one process over the same batch (the schedules' own ``1 / M`` scaling is off).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage

from moe_lightning.model import MoEConfig, MoETransformer, mtp
from moe_lightning.model.attention import DocumentMask, document_ids


class PipelineError(ValueError):
    """A pipeline argument does not fit the model, the batch or the installed torch; the message names the field
    and the values that work."""


# name -> (torch class, how stages sit on ranks): "single" one stage a rank, "loop" V >= 2 round-robin, "v" V == 2
SCHEDULES = {
    "1F1B": ("Schedule1F1B", "single"),
    "GPipe": ("ScheduleGPipe", "single"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v"),
    "DualPipeV": ("ScheduleDualPipeV", "v"),
}


# split backward into an input pass and a weight pass; torch 2.11's weight pass (``stage_backward_weight``) fails on
# the model's custom autograd functions (``_input_metadata`` of their nodes, in ``autograd._make_grads``); 2.13's runs.
# (Before that, 2.11 also fails to open a V's links on gloo: it sends between the two stages a rank holds.)
SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


def schedule_class(name: str) -> type:
    """The torch schedule class of ``name``; refuses a name unknown here or one the installed torch lacks."""
    if name not in SCHEDULES:
        raise PipelineError(f"strategy.pipeline_schedule={name!r}: use one of {', '.join(map(repr, SCHEDULES))}.")
    cls = getattr(pipelining, SCHEDULES[name][0], None)
    if cls is None:
        shipped = [n for n, (c, _) in SCHEDULES.items() if hasattr(pipelining, c)]
        raise PipelineError(f"strategy.pipeline_schedule={name!r}: torch {torch.__version__} has no "
                            f"{SCHEDULES[name][0]}; this torch offers {', '.join(map(repr, shipped))}.")
    return cls


def block_costs(config: MoEConfig, seq_len: int | None = None) -> tuple[list[float], float, float]:
    """Forward FLOPs per token of each block, and the first and last stages' extra work, in the same unit.

    A block: 2 x its matmul parameters one token uses (routed experts scaled by ``top_k / num_experts``) plus its
    causal attention over ``seq_len`` (default ``max_seq_len``). The last stage adds the head (``2·V·D``) and each
    MTP depth (a block shaped like the last, its ``2D -> D`` projection and the head again). The first stage adds
    the embedding priced as the head: its lookup is free but its gradient, reduction and optimizer step are those
    of a ``[V, D]`` matrix (TorchTitan likewise counts the embedding as a layer)."""
    with torch.device("meta"):
        model = MoETransformer(config)
    seq_len = seq_len or config.max_seq_len
    qk_dim, v_dim = config.attention_head_dims
    attention = 2 * config.n_heads * (qk_dim + v_dim) * (seq_len + 1) / 2  # causal: (S + 1) / 2 keys per query

    def block_flops(block: nn.Module) -> float:
        total = sum(p.numel() for p in block.parameters())
        routed = sum(p.numel() for p in block.ffn.experts.parameters()) if block.is_moe else 0
        return 2 * (total - routed + routed * config.top_k / config.num_experts) + attention

    head = 2 * config.vocab_size * config.dim
    depths = sum(block_flops(m.block) + 2 * 2 * config.dim * config.dim + head for m in model.mtp)
    return [block_flops(b) for b in model.layers], head, head + depths


def balanced_layout(costs: list[float], num_stages: int, first_extra: float = 0.0,
                    last_extra: float = 0.0) -> list[int]:
    """Blocks per stage, contiguous and at least one each, minimising the largest stage cost (the first stage
    carries ``first_extra`` besides its blocks, the last ``last_extra``); among the layouts with that peak, the
    one with the least sum of squared stage costs (the others as even as the peak allows). Exact: dynamic
    programming over split points, ``O(stages · blocks²)``, once for the peak and once under it."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise PipelineError(f"{num_stages} pipeline stages for {n} blocks: every stage needs a block.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    def solve(combine, limit: float) -> tuple[float, list[int]]:
        """best[s][e]: stages 0..s covering blocks [0, e), each stage's cost at most ``limit``."""
        best = [[math.inf] * (n + 1) for _ in range(num_stages)]
        start_of = [[0] * (n + 1) for _ in range(num_stages)]
        for e in range(1, n + 1):
            if cost(0, 0, e) <= limit:
                best[0][e] = combine(0.0, cost(0, 0, e))
        for s in range(1, num_stages):
            for e in range(s + 1, n + 1):
                for start in range(s, e):
                    c = cost(s, start, e)
                    if c <= limit and (value := combine(best[s - 1][start], c)) < best[s][e]:
                        best[s][e], start_of[s][e] = value, start
        sizes, end = [], n
        for s in range(num_stages - 1, 0, -1):
            sizes.append(end - start_of[s][end])
            end = start_of[s][end]
        return best[-1][n], [end, *reversed(sizes)]

    peak, _ = solve(max, math.inf)
    return solve(lambda total, c: total + c * c, peak * (1 + 1e-12))[1]


def stage_layout(config: MoEConfig, num_stages: int, seq_len: int | None = None) -> list[int]:
    """Blocks on each of ``num_stages`` stages for ``config``: the one layout the strategy builds and ``plan``
    prices (``block_costs`` balanced by ``balanced_layout``, so the first and last stages hold fewer blocks)."""
    costs, first, last = block_costs(config, seq_len)
    return balanced_layout(costs, num_stages, first, last)


@dataclass(frozen=True)
class PipelineLayout:
    """Validated pipeline sizes: ``size`` ranks, ``stages_per_rank`` stages on each, ``blocks_per_stage``."""

    size: int
    schedule: str
    microbatches: int
    stages_per_rank: int
    blocks_per_stage: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return self.size * self.stages_per_rank

    def blocks_of(self, stage: int) -> range:
        start = sum(self.blocks_per_stage[:stage])
        return range(start, start + self.blocks_per_stage[stage])

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds, in the order torch's schedule takes them."""
        if SCHEDULES[self.schedule][1] == "v":
            return [pp_rank, 2 * self.size - 1 - pp_rank]
        return list(range(pp_rank, self.num_stages, self.size))

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.size) if stage in self.stages_of(r))

    def sends_between_ranks(self, pp_rank: int) -> int:
        """Tensors ``pp_rank`` sends per micro-batch to other ranks: activations to the next stage and gradients
        to the previous one, wherever that stage is on another rank (a V's middle stages share one)."""
        return sum((t < self.num_stages - 1 and self.rank_of(t + 1) != pp_rank)
                   + (t > 0 and self.rank_of(t - 1) != pp_rank) for t in self.stages_of(pp_rank))


def check_torch_runs(schedule: str, torch_version: str) -> None:
    """Refuse a split-backward schedule on torch < 2.13 (``torch_version``: ``torch.__version__``), whose weight pass
    fails on this model's custom autograd functions (measured on 2.11). Training only: ``plan`` prices the order."""
    if schedule in SPLIT_BACKWARD and tuple(int(n) for n in torch_version.split(".")[:2]) < (2, 13):
        raise PipelineError(f"strategy.pipeline_schedule={schedule!r} splits backward into input and weight passes, "
                            f"which torch {torch_version} cannot run over this model's custom autograd functions "
                            "(RMSNorm, the router's fp32 matmul; torch 2.13 can, 2.12 is untested): use "
                            "'Interleaved1F1B' or '1F1B', or torch >= 2.13.")


def resolve_pipeline(config: MoEConfig, size: int, schedule: str = "1F1B", microbatches: int | None = None,
                     stages_per_rank: int | None = None, seq_len: int | None = None) -> PipelineLayout:
    """Check the pipeline arguments against the model and the installed torch before any process group exists;
    one-line refusals naming ``strategy.<field>`` and the values that work. ``microbatches`` defaults to
    ``size`` (``2 x size`` for DualPipeV, torch's least); ``stages_per_rank`` to 1, or 2 for the schedules that need
    several."""
    for name, value in (("pipeline_parallel_size", size), ("pipeline_microbatches", microbatches),
                        ("pipeline_stages_per_rank", stages_per_rank)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PipelineError(f"strategy.{name}={value!r}: must be a positive integer.")
    schedule_class(schedule)
    style = SCHEDULES[schedule][1]
    microbatches = size * _least_rounds(schedule) if microbatches is None else microbatches
    stages_per_rank = stages_per_rank or (1 if style == "single" else 2)
    if style == "single" and stages_per_rank != 1:
        several = [n for n, (_, s) in SCHEDULES.items() if s != "single"]
        raise PipelineError(f"strategy.pipeline_schedule={schedule!r} runs one stage per rank, but "
                            f"pipeline_stages_per_rank={stages_per_rank}: set it to 1, or use one of {several}.")
    if style != "single" and stages_per_rank == 1:
        raise PipelineError(f"strategy.pipeline_schedule={schedule!r} needs several stages per rank, but "
                            f"pipeline_stages_per_rank=1: set it to 2{' (exactly)' if style == 'v' else ' or more'}, "
                            f"or use '1F1B' or 'GPipe'.")
    if style == "v" and stages_per_rank != 2:
        raise PipelineError(f"strategy.pipeline_schedule={schedule!r} places exactly 2 stages per rank (a V), but "
                            f"pipeline_stages_per_rank={stages_per_rank}: set it to 2.")
    stages = size * stages_per_rank
    if stages > config.n_layers:
        raise PipelineError(f"strategy.pipeline_parallel_size={size} x pipeline_stages_per_rank={stages_per_rank} = "
                            f"{stages} stages, but the model has n_layers={config.n_layers} blocks and every stage "
                            f"needs one: make the product at most {config.n_layers}.")
    check_microbatches(size, microbatches)
    if not runs_microbatches(schedule, size, microbatches):
        fits = [m for m in range(size, 4 * size + 1) if runs_microbatches(schedule, size, m)]
        rule = f"at least {_least_rounds(schedule)} rounds of" if _least_rounds(schedule) > 1 else "whole rounds of"
        raise PipelineError(f"strategy.pipeline_microbatches={microbatches}: {schedule} runs {rule} "
                            f"pipeline_parallel_size={size} micro-batches; use one of {fits}.")
    return PipelineLayout(size, schedule, microbatches, stages_per_rank,
                          tuple(stage_layout(config, stages, seq_len)))


def _least_rounds(schedule: str) -> int:
    """Rounds of ``size`` micro-batches a schedule needs at least (torch's DualPipeV refuses fewer than 2)."""
    return 2 if schedule == "DualPipeV" else 1


def runs_microbatches(schedule: str, size: int, microbatches: int) -> bool:
    """Whether torch's ``schedule`` runs ``microbatches`` over ``size`` ranks: at least one a stage rank (its least
    rounds), and the looped schedules whole rounds of ``size``."""
    whole = SCHEDULES[schedule][1] != "loop" or microbatches % max(1, microbatches // size) == 0
    return microbatches >= size * _least_rounds(schedule) and whole


def check_microbatches(size: int, microbatches: int | None) -> None:
    """Fewer micro-batches than stages would leave a stage waiting forever (torchtitan#775): refused."""
    if size > 1 and microbatches is not None and microbatches < size:
        raise PipelineError(f"strategy.pipeline_microbatches={microbatches} is fewer than pipeline_parallel_size="
                            f"{size} stages (the pipeline would wait forever for a micro-batch): use at least {size}, "
                            f"e.g. {size} or {2 * size}, dividing the per-rank batch size.")


def check_batch(batch_size: int, layout: "PipelineLayout") -> None:
    """The per-rank batch splits into the layout's micro-batches, all of equal size (as the balancing losses need);
    a refusal offers the counts that divide it and the schedule runs (``runs_microbatches``)."""
    microbatches = layout.microbatches
    if batch_size % microbatches:
        fits = [m for m in range(1, batch_size + 1)
                if batch_size % m == 0 and runs_microbatches(layout.schedule, layout.size, m)]
        choice = f"choose it from {fits}, or make data.batch_size a multiple of {microbatches}" if fits else \
            f"make data.batch_size a multiple of {microbatches}"
        raise PipelineError(f"strategy.pipeline_microbatches={microbatches} does not divide the per-rank batch of "
                            f"{batch_size} sequences (data.batch_size): {choice}.")


class StageBlocks(nn.ModuleList):
    """The blocks one stage holds, registered under their indices in the whole model (``"5"`` for block 5), so
    parameter names do not change. Iteration, ``len`` and integer indexing are by position within the stage, as
    a ``ModuleList``'s (an ``nn.ModuleList`` would renumber its keys from 0 on deletion)."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, idx):
        blocks = list(self._modules.values())
        return nn.ModuleList(blocks[idx]) if isinstance(idx, slice) else blocks[idx]


class StageTransformer(MoETransformer):
    """A ``MoETransformer`` pruned to one stage (the class ``keep_stage`` gives it; the model's code is not
    edited). ``forward(x, batch_BS1)``: ``x`` is the batch on the first stage, else the previous stage's hidden
    states ``[b, S, D]``; ``batch_BS1`` the micro-batch's ``S + 1`` tokens (every stage reads them: the document
    mask on every stage, the targets and MTP's shifted embeddings on the last). Returns the hidden states, or on
    the last stage the summed cross-entropy of each depth ``[1 + D]`` (the head's dtype): the main loss's, then
    each MTP depth's while training.

    Under a context-parallel ``sequence_shard`` (the model's seam, as in ``MoETransformer.forward``) a stage
    computes this rank's positions only: the first stage embeds this rank's tokens, hidden states between stages
    are ``[b, S / size, D]``, and the last stage's sums, of this rank's targets, are completed over the ranks that
    share the sequences (``sum_over_sequence``), so every rank returns the whole micro-batch's sums."""

    pipeline_stage: int
    pipeline_first: bool
    pipeline_last: bool
    loss_chunk_size: int | None
    step_expert_counts: torch.Tensor | None  # ``[local MoE layers, experts]`` summed over this step's micro-batches

    def forward(self, x: torch.Tensor, batch_BS1: torch.Tensor) -> torch.Tensor:
        tokens_BS = batch_BS1[:, :-1]
        S = tokens_BS.shape[1]
        eod = self.config.eod_token_id if self.config.document_masking else None
        positions_S = self.sequence_shard.positions(S, tokens_BS.device)  # None: the whole sequence
        if eod is not None:
            mask = DocumentMask(document_ids(tokens_BS, eod), q_len=S, q_positions_S=positions_S)
        else:  # causal; a shard's queries against every key at their global positions
            mask = None if positions_S is None else DocumentMask(tokens_BS.new_zeros(tokens_BS.shape),
                                                                 q_positions_S=positions_S)
        if positions_S is None:
            cos_sin, shard = self.rotary.cos_sin(0, S, device=tokens_BS.device), None
        else:
            cos_sin, shard = self.rotary.cos_sin_at(positions_S), self.sequence_shard
        h_BsD = self.tok_embeddings(self.sequence_shard.local(tokens_BS)) if self.pipeline_first else x
        for layer in self.layers:
            h_BsD = layer(h_BsD, mask=mask, cache=None, cos_sin=cos_sin, sequence_shard=shard)
        if not self.pipeline_last:
            self._count_experts()
            return h_BsD
        h_BsD = self.norm(h_BsD)
        if self.training and len(self.mtp):
            emb_BSD, shifted_emb = self._mtp_embeddings(tokens_BS, positions_S)
            hidden = self._multi_token_hidden(tokens_BS, emb_BSD, h_BsD, shifted_emb, mask)
        else:
            hidden = [h_BsD]
        self._count_experts()
        targets = [self.local_targets(mtp.targets(batch_BS1, depth, eod), S).flatten()  # this rank's positions
                   for depth in range(len(hidden))]
        sums = self.output.cross_entropy_sums([h.flatten(0, 1) for h in hidden], targets, self.loss_chunk_size)
        return self.sequence_shard.sum_over_sequence(torch.stack(sums)[None])[0]

    def _mtp_embeddings(self, tokens_BS: torch.Tensor, positions_S: torch.Tensor | None
                        ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """What ``_multi_token_hidden`` reads: the whole sequence's embeddings ``[B, S, D]``; under a shard
        instead, for each depth k, the embeddings of the tokens k ahead of this rank's positions below ``S - k``
        (one call of the embedding, split), as ``MoETransformer.forward`` computes them."""
        if positions_S is None:
            return self.tok_embeddings(tokens_BS), None
        S = tokens_BS.shape[1]
        shifted_S = [self.sequence_shard.truncated(S, S - k).positions(S - k, tokens_BS.device) + k
                     for k in range(1, len(self.mtp) + 1)]
        emb_BXD = self.tok_embeddings(tokens_BS[:, torch.cat(shifted_S)])
        return None, list(emb_BXD.split([len(p) for p in shifted_S], dim=1))

    def _count_experts(self) -> None:
        """Add this micro-batch's tokens per expert of every local MoE layer to the step's (read right after
        the forward: a block recomputed in backward would overwrite them)."""
        counts = [moe.tokens_per_expert for moe in self.moe_layers() if moe.tokens_per_expert is not None]
        if counts and self.training:
            counts_LE = torch.stack(counts)
            self.step_expert_counts = counts_LE if self.step_expert_counts is None \
                else self.step_expert_counts + counts_LE


def reads_embedding_last(config: MoEConfig) -> bool:
    """The last stage needs the token embedding too: MTP's shifted embeddings, or a head tied to it."""
    return config.mtp_layers > 0 or config.tie_embeddings


def keep_stage(model: MoETransformer, stage: int, layout: PipelineLayout,
               loss_chunk_size: int | None = None) -> StageTransformer:
    """Prune ``model`` in place to ``stage``: its blocks (names kept), the embedding on the first stage (and on
    the last when ``reads_embedding_last``), the final norm, head and MTP modules on the last. Run it before
    anything wraps the blocks (compile, FSDP, offload) so they see only this stage's."""
    return keep_stages(model, [stage], layout, loss_chunk_size)


def keep_stages(model: MoETransformer, stages: list[int], layout: PipelineLayout,
                loss_chunk_size: int | None = None) -> StageTransformer:
    """Prune ``model`` in place to the union of ``stages`` (a rank's, ``layout.stages_of``): their blocks, names
    kept, and the embedding, norm, head and MTP of whichever of them needs each (``keep_stage``'s rules). This one
    module is what Lightning, the optimizer and checkpoints see; torch's ``PipelineStage`` runs ``stage_parts``."""
    if type(model) is not MoETransformer:
        raise TypeError("keep_stage prunes a plain MoETransformer before it is parallelized; got "
                        f"{type(model).__name__}.")
    _prune(model, sorted(stages), layout)
    model.loss_chunk_size, model.step_expert_counts = loss_chunk_size, None
    return model


def _prune(model: MoETransformer, stages: list[int], layout: PipelineLayout) -> None:
    """Keep in ``model`` only what ``stages`` run, and make it a ``StageTransformer`` of the first of them."""
    first, last = 0 in stages, layout.num_stages - 1 in stages
    blocks = model.layers._modules  # keyed by the whole model's block index, in a ModuleList and a StageBlocks alike
    model.layers = StageBlocks({i: blocks[str(i)] for s in stages for i in layout.blocks_of(s)})
    if not (first or last and reads_embedding_last(model.config)):
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
        model.mtp = nn.ModuleList()
    model.__class__ = StageTransformer
    model.pipeline_stage, model.pipeline_first, model.pipeline_last = stages[0], first, last


def stage_parts(model: StageTransformer, layout: PipelineLayout) -> list[StageTransformer]:
    """The modules torch's ``PipelineStage`` runs for the rank's stages, in ``layout.stages_of`` order: ``model``
    itself when it holds one stage; else one view per stage that shares ``model``'s submodules (blocks, embedding,
    norm, head, MTP) but holds only its stage's, so that a view's ``parameters()`` are exactly its stage's (the
    zero-bubble schedules' weight pass walks them). Views are not registered in ``model``: names, the optimizer's
    parameters and checkpoint keys stay the model's. Build them after every step that replaces a child of the
    model (context parallelism's ``sequence_shard``) and before FSDP, which makes each view a root."""
    stages = layout.stages_of(layout.rank_of(model.pipeline_stage))
    if len(stages) == 1:
        return [model]
    views = []
    for stage in stages:
        view = StageTransformer.__new__(StageTransformer)
        nn.Module.__init__(view)  # its own parameter, module and hook tables
        view.__dict__.update({k: v for k, v in model.__dict__.items() if k not in view.__dict__})
        view._modules.update(model._modules)
        view._parameters.update(model._parameters)
        view._buffers.update(model._buffers)
        view._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
        _prune(view, [stage], layout)
        view.step_expert_counts = None
        views.append(view)
    return views


class PipelineLoss:
    """The schedule's ``loss_fn``: a micro-batch's per-depth sums ``[1 + D]`` weighted so that the M micro-batches
    add up to one process's loss over the global batch, ``main + λ/D · Σ_k CE_k`` with each ``CE_k`` a mean over
    all of depth k's targets that are not ignored. ``set_batch`` before each ``step``; ``sums`` then holds every
    micro-batch's detached sums, for logging. Under context parallelism every rank of a group holds the whole
    batch, so the counts are the whole sequences', as are the sums the last stage returns (``StageTransformer``)."""

    def __init__(self, config: MoEConfig):
        self.config = config
        self.weights_K: torch.Tensor | None = None
        self.sums: list[torch.Tensor] = []

    def set_batch(self, batch_BS1: torch.Tensor, training: bool = True) -> None:
        depths = 1 + (self.config.mtp_layers if training else 0)
        eod = self.config.eod_token_id if self.config.document_masking else None
        counts_K = torch.stack([(mtp.targets(batch_BS1, k, eod) != -100).sum().clamp(min=1) for k in range(depths)])
        weights_K = torch.ones(depths, dtype=torch.float32, device=batch_BS1.device)
        if depths > 1:
            weights_K[1:] = self.config.mtp_loss_weight / (depths - 1)
        self.weights_K, self.counts_K, self.sums = weights_K / counts_K, counts_K, []

    def __call__(self, sums_K: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        self.sums.append(sums_K.detach())
        return (sums_K * self.weights_K).sum()

    def losses(self) -> torch.Tensor:
        """Each depth's mean loss over the global batch ``[1 + D]`` (the main loss first)."""
        return torch.stack(self.sums).sum(0) / self.counts_K


def _forward_only(schedule: pipelining.schedules._PipelineScheduleRuntime) -> None:
    """Drop a schedule of several stages per rank to its forward work, in its order, for evaluation: torch (2.11 to
    2.13) runs the backward actions in ``eval`` too, and a V's hand-off of gradients between a rank's two stages
    then fails. Forward only, the order stays deadlock-free: each forward's input comes from a forward earlier in
    the order. The stages' gathers stay, except each UNSHARD...RESHARD pair left without a forward of its stage:
    torch keeps at most 3 stages gathered, so with 4 or more per rank it re-gathers a stage for its backward, and
    the runtime refuses to reshard a stage it gathered but never computed on. (``pipeline_order_with_comms`` and
    ``_Action`` are private; read in torch 2.11's and 2.13's ``schedules.py``.)"""
    kind = pipelining.schedules._ComputationType
    backward = {kind.FULL_BACKWARD, kind.BACKWARD_INPUT, kind.BACKWARD_WEIGHT, kind.SEND_B, kind.RECV_B,
                kind.REDUCE_GRAD}

    def forward_part(action) -> list:
        if action.sub_actions is not None:  # OVERLAP_F_B: a forward and a backward in one
            return [a for a in action.sub_actions if a.computation_type == kind.FORWARD]
        return [] if action.computation_type in backward else [action]

    def without_idle_gathers(actions: list) -> list:
        idle, open_gathers = set(), {}  # stage -> [index of its UNSHARD, whether a FORWARD followed]
        for i, action in enumerate(actions):
            if action.computation_type == kind.UNSHARD:
                open_gathers[action.stage_index] = [i, False]
            elif action.computation_type == kind.FORWARD and action.stage_index in open_gathers:
                open_gathers[action.stage_index][1] = True
            elif action.computation_type == kind.RESHARD and action.stage_index in open_gathers:
                start, used = open_gathers.pop(action.stage_index)
                if not used:
                    idle |= {start, i}
        return [action for i, action in enumerate(actions) if i not in idle]

    schedule.pipeline_order_with_comms = {
        rank: without_idle_gathers([a for action in actions for a in forward_part(action)])
        for rank, actions in schedule.pipeline_order_with_comms.items()}


def copy_first_stage_embedding(model: MoETransformer, group: dist.ProcessGroup | None) -> None:
    """Make the last stage's copy of the token embedding the first stage's (``group``: those two ranks, the first
    stage's its rank 0): after a meta-device build each was initialised from its own rank's seed. Each rank holds
    the same shard of it (the same shard rank of a stage of the same size). A no-op where there is no copy."""
    if group is None or model.tok_embeddings is None or not reads_embedding_last(model.config):
        return
    weight = model.tok_embeddings.weight
    dist.broadcast(weight.to_local() if hasattr(weight, "to_local") else weight, group=group, group_src=0)


def sum_shared_embedding_grads(model: MoETransformer, group: dist.ProcessGroup | None) -> None:
    """Sum the token embedding's gradient between the first and the last stage (``group``: those two ranks), so
    the copy on the last stage and the first stage's take the same optimizer step. A no-op without ``group``."""
    if group is None or model.tok_embeddings is None or model.tok_embeddings.weight.grad is None:
        return
    grad = model.tok_embeddings.weight.grad
    dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


class PipelineRunner:
    """Runs torch's schedule over one batch on this rank's stages (``parts``: ``stage_parts``, one per stage):
    training, forward and backward over the ``layout.microbatches`` micro-batches; evaluation, forward only.
    ``run`` returns each depth's loss over the batch ``[1 + D]`` (``[1]`` in evaluation), the same on every rank of
    the pipeline (broadcast from the last stage's); after a training step the embedding copies' gradients are
    summed (``embedding_group``) and each local MoE layer's ``tokens_per_expert`` holds the step's counts.

    The stages are built at the first batch of each shape, with example tensors instead of torch's shape
    inference: hidden states ``[B / M, S, dim]`` in ``activation_dtype`` (what flows between blocks: the
    parameters' dtype), the last stage's sums in fp32 (the head's loss is fp32 whatever the model's dtype:
    ``OutputHead.cross_entropy_sums``; torch 2.11 checks the declared dtype)."""

    def __init__(self, parts: list[StageTransformer], layout: PipelineLayout, group: dist.ProcessGroup | None,
                 device: torch.device, activation_dtype: torch.dtype,
                 embedding_group: dist.ProcessGroup | None = None):
        self.parts, self.layout, self.group, self.device = parts, layout, group, device
        self.config = parts[0].config
        self.activation_dtype = activation_dtype
        self.embedding_group = embedding_group if reads_embedding_last(self.config) else None
        last_rank = layout.rank_of(layout.num_stages - 1)
        self.last_rank = last_rank if group is None else dist.get_global_rank(group, last_rank)
        self._schedules: dict[tuple[int, int, bool], tuple[object, PipelineLoss]] = {}

    def microbatches(self, B: int, training: bool) -> int:
        """``layout.microbatches`` in training (refused unless it divides the batch); in evaluation that, or else
        the fewest micro-batches, at least one per stage, that divide a short batch (a held-out set's last one), or
        one sequence each when the batch has fewer sequences than stages and a rank runs one stage (as GPipe)."""
        M = self.layout.microbatches
        if training or B % M == 0:
            check_batch(B, self.layout)
            return M
        fits = [m for m in range(self.layout.num_stages, B + 1) if B % m == 0]
        if fits or len(self.parts) == 1:
            return fits[0] if fits else B
        raise PipelineError(f"an evaluation batch of {B} sequences cannot feed {self.layout.num_stages} pipeline "
                            "stages: give the held-out data at least that many sequences per batch (data.batch_size).")

    def schedule_name(self, M: int, training: bool) -> str:
        """The layout's schedule, except GPipe for an evaluation of fewer micro-batches than stages: forward only,
        any schedule's order computes the same losses, and torch's 1F1B refuses fewer micro-batches than stages."""
        short = not training and M < self.layout.num_stages and len(self.parts) == 1
        return "GPipe" if short else self.layout.schedule

    def _schedule(self, B: int, S: int, training: bool) -> tuple[object, PipelineLoss]:
        key = (B, S, training)
        if key not in self._schedules:
            M, last = self.microbatches(B, training), self.layout.num_stages - 1
            b, dtype = B // M, self.activation_dtype
            S_local = S // self.parts[0].sequence_shard.size  # a context-parallel rank's share of each sequence
            hidden = torch.empty(b, S_local, self.config.dim, dtype=dtype, device="meta", requires_grad=True)
            sums = torch.empty(1 + (self.config.mtp_layers if training else 0), device="meta", requires_grad=True,
                               dtype=torch.float32)
            tokens = torch.empty(b, S + 1, dtype=torch.long, device="meta")
            stages = [PipelineStage(part, part.pipeline_stage, self.layout.num_stages, self.device,
                                    input_args=(tokens if part.pipeline_first else hidden,),
                                    output_args=sums if part.pipeline_stage == last else hidden, group=self.group)
                      for part in self.parts]
            loss_fn = PipelineLoss(self.config)
            cls = schedule_class(self.schedule_name(M, training))
            schedule = cls(stages[0] if len(stages) == 1 else stages, M, loss_fn=loss_fn, scale_grads=False)
            if not training and len(stages) > 1:
                _forward_only(schedule)
            self._schedules[key] = schedule, loss_fn
        return self._schedules[key]

    def run(self, batch_BS1: torch.Tensor, training: bool) -> torch.Tensor:
        B, S1 = batch_BS1.shape
        schedule, loss_fn = self._schedule(B, S1 - 1, training)
        loss_fn.set_batch(batch_BS1, training)
        for part in self.parts:
            part.training, part.step_expert_counts = training, None  # a view's flag: Lightning sets the model's
            for moe in part.moe_layers():  # each micro-batch's balancing losses are means over its sequences
                moe.aux_loss_grad_scale = 1 / self.microbatches(B, training)
        if training:
            schedule.step(batch_BS1, batch_BS1=batch_BS1, target=batch_BS1, return_outputs=False)
            self._finish_training_step()
        else:
            schedule.eval(batch_BS1, batch_BS1=batch_BS1, target=batch_BS1)
        depths = 1 + (self.config.mtp_layers if training else 0)
        losses_K = loss_fn.losses().to(torch.float32) if loss_fn.sums else \
            torch.zeros(depths, dtype=torch.float32, device=batch_BS1.device)
        if self.group is not None:
            dist.broadcast(losses_K, src=self.last_rank, group=self.group)
        return losses_K

    def _finish_training_step(self) -> None:
        """Sum the embedding copies' gradients between ranks and hand every local MoE layer the step's counts."""
        for part in self.parts:  # at most one stage of a rank holds the embedding (a V with MTP or a tied head,
            if part.tok_embeddings is not None:  # both of whose ends would read it, is refused)
                sum_shared_embedding_grads(part, self.embedding_group)
            if part.step_expert_counts is not None:
                for moe, counts_E in zip(part.moe_layers(), part.step_expert_counts):
                    moe.tokens_per_expert = counts_E
