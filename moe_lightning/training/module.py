"""The LightningModule: builds the model late, computes the loss, balances experts, logs what matters."""

import dataclasses
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from moe_lightning import hf
from moe_lightning.training.callbacks.final_checkpoint import FinalCheckpoint
from moe_lightning.training.callbacks.nonfinite import NonFiniteGuard
from moe_lightning.model.sampling import stream
from moe_lightning.training.lightning_internals import logs_written, optimizer_step_ends
from moe_lightning.model import MoEConfig, MoETransformer, mtp
from moe_lightning.model.loss import context_parallel_mean
from moe_lightning.optim import WarmupCosineLR, param_groups
from moe_lightning.parallel.compile import compile_blocks
from moe_lightning.checkpoint.compat import check_resume
from moe_lightning.training.callbacks.preemption import Preemption


def default_optimizer(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))


def default_lr_scheduler(optimizer: torch.optim.Optimizer) -> WarmupCosineLR:
    """A named function, not a ``functools.partial``: jsonargparse writes it by import path in ``--print_config``
    and the saved ``config.yaml``; a partial it cannot serialise (4.53 writes an error string, 4.32-4.47 refuse
    every config)."""
    return WarmupCosineLR(optimizer, warmup_steps=100)


def _keep_requested_hyperparameters(optimizer: torch.optim.Optimizer, requested: list[dict]) -> None:
    """Optimizer ``load_state_dict`` post-hook: a resumed run trains with the hyperparameters it was given
    (learning rate, weight decay, betas...), not the checkpoint's; the LR keeps its place in the schedule."""
    changes = set()
    for group, wanted in zip(optimizer.param_groups, requested):
        restored_base = group.get("initial_lr")
        for key, value in wanted.items():
            if key != "lr" and not isinstance(value, torch.Tensor) and group.get(key) != value:
                changes.add(f"{key}: checkpoint {group.get(key)!r}, requested {value!r}")
                group[key] = value
        if restored_base and wanted.get("initial_lr") and restored_base != wanted["initial_lr"]:
            group["lr"] *= wanted["initial_lr"] / restored_base
    for change in sorted(changes):
        rank_zero_info(f"resume: optimizer {change} (using the requested value)")


def _sum_over_world(counts: torch.Tensor) -> None:
    """In place, over every rank (one all-reduce; Lightning's ``strategy.reduce`` would add a barrier every step)."""
    if dist.is_initialized():
        dist.all_reduce(counts)


class MoELanguageModel(L.LightningModule):
    """Next-token prediction with an MoE transformer.

    Args:
        config: Model shape and routing.
        optimizer: Builds the optimizer from parameter groups (each group carries ``role`` and
            ``param_names``); built in ``configure_optimizers`` so it sees the sharded parameters.
        lr_scheduler: Builds the per-step LR schedule from the optimizer.
        weight_decay: Decoupled weight decay for matrices (never norms, biases, embeddings).
        pretrained: A Hugging Face model directory to start from: its ``config.json`` gives the model's shape
            (``config`` keeps only its training settings, the other fields it sets are replaced and logged) and its
            safetensors the weights, read by each rank for its shards.
        loss_chunk_size: Tokens per chunk of the output head + cross-entropy (``moe_lightning.model.loss``), so
            the ``[tokens, vocab]`` logits never exist at once; ``None``: one full-logits cross-entropy.
        compile: ``torch.compile`` every block's forward (``parallel.compile.compile_blocks``); works in fp32 and bf16,
            on CPU and GPU, with ``MoEFSDPStrategy`` and ``ActivationOffload``.
    """

    def __init__(self, config: MoEConfig | None = None, optimizer: OptimizerCallable = default_optimizer,
                 lr_scheduler: LRSchedulerCallable = default_lr_scheduler,
                 weight_decay: float = 0.1, pretrained: str | None = None, loss_chunk_size: int | None = None,
                 compile: bool = False):
        super().__init__()
        if not isinstance(compile, bool):
            raise ValueError(f"model.compile={compile!r}: must be true or false.")
        if loss_chunk_size is not None and (not isinstance(loss_chunk_size, int) or loss_chunk_size < 1):
            raise ValueError(f"model.loss_chunk_size={loss_chunk_size!r}: must be a positive integer (tokens per "
                             "chunk, e.g. 4096) or null for the unchunked loss.")
        if isinstance(config, dict):  # rebuilt from a checkpoint's hyperparameters (load_from_checkpoint)
            config = MoEConfig(**config)
        if pretrained is not None:
            given, config = config, hf.merge_config(pretrained, config)  # before save_hyperparameters records it
            if given is not None and (replaced := hf.replaced_fields(given, config)):
                rank_zero_info(f"pretrained={pretrained!r} gives the model's shape; replaced from the config: "
                               + ", ".join(replaced))
        self.pretrained, self._pretrained_filled = pretrained, False
        self.config = config if config is not None else MoEConfig()
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.weight_decay, self.loss_chunk_size, self.compile_each_block = weight_decay, loss_chunk_size, compile
        self.model: MoETransformer | None = None
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.tokens_seen = 0
        # Set by a strategy that parallelizes the model itself (MoEFSDPStrategy), so the module reads no layout:
        self.parallelized_by_strategy = False  # it compiles the blocks too
        self.ranks_per_sequence = 1  # ranks sharing each sequence (context parallelism): the loss is a share, scaled
        self.pipeline = None  # pipeline parallelism: runs the schedule over a batch (parallel.pipeline.PipelineRunner)
        self.ranks_per_batch = 1  # ranks reading each batch (context parallelism, pipeline stages): tokens seen once
        self.sum_expert_counts = _sum_over_world  # over the ranks that hold the same MoE layers (a stage's, under PP)
        self._pending_expert_counts: torch.Tensor | None = None
        self._step_aux_losses: dict[int, list[torch.Tensor]] = {}  # per hooked module: its forwards' sums this step
        self._aux_hooks: list = []
        self._train_loss_sum: torch.Tensor | None = None  # this optimizer step's micro-batch losses, on device
        self.val_loss_mean = torchmetrics.aggregation.MeanMetric()

    def configure_model(self) -> None:
        """Build once; under ``trainer.init_module(empty_init=True)`` this lands on the meta device. A strategy that
        parallelizes the model (``MoEFSDPStrategy``) compiles its blocks too; on any other they are compiled here."""
        if self.model is None:
            self.model = MoETransformer(self.config)
            if self.pretrained is not None and not self.model.tok_embeddings.weight.is_meta:
                self.fill_pretrained(self.model.state_dict())
            if self.compile_each_block and not self.parallelized_by_strategy:
                compile_blocks(self.model.layers)

    def fill_pretrained(self, state: dict[str, torch.Tensor],
                        whole_shapes: dict[str, torch.Size] | None = None) -> None:
        """Copy the ``pretrained`` weights into ``state`` (the transformer's state dict, plain or sharded, in place;
        ``whole_shapes``: the whole model's, when ``state`` is a pipeline stage's part of it).

        Strategies that build the model on the meta device call this after sharding, so each rank reads
        only its own slices."""
        hf.fill_state_dict(state, self.pretrained, whole_shapes)
        self._pretrained_filled = True

    def on_fit_start(self) -> None:
        if self.pretrained is not None and not self._pretrained_filled:
            raise RuntimeError(f"model.pretrained={self.pretrained!r} was never loaded: the strategy built the model "
                               "on the meta device without calling fill_pretrained; use MoEFSDPStrategy or a "
                               "strategy that builds the model on a real device.")

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_BS)

    def _loss(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        if self.pipeline is not None:
            return self._pipeline_loss(batch_BS1)
        inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
        if self.training and self.config.mtp_layers:
            return self._multi_token_loss(batch_BS1)
        if self.ranks_per_sequence > 1:  # context parallelism: this rank's positions, scaled so the gradients stay exact
            h_BsD = self.model(inputs_BS, return_hidden=True)
            local_targets = self.model.local_targets(targets_BS, targets_BS.shape[1]).flatten()
            total = self.model.output.cross_entropy_sums([h_BsD.flatten(0, 1)], [local_targets],
                                                         self.loss_chunk_size)[0]
            return context_parallel_mean(total, targets_BS, self.ranks_per_sequence)
        if self.loss_chunk_size is None:
            logits_BSV = self.model(inputs_BS)
            return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())
        h_BSD = self.model(inputs_BS, return_hidden=True)  # called as the module: FSDP's root hooks run
        return self.model.output.cross_entropy(h_BSD.flatten(0, 1), targets_BS.flatten(), self.loss_chunk_size)

    def _multi_token_loss(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        """``main + λ/D · Σ_k CE_k`` (DeepSeek-V3), each ``CE_k`` the mean over depth k's targets that are not
        ignored (0 if none is left); logs ``train/mtp_loss`` (the mean of the ``CE_k``) and returns the main
        loss as ``self._main_loss`` for ``train/loss``, so that it stays comparable with ``val/loss``.

        Every depth goes through one call of the head (``OutputHead.cross_entropy_sums``), so an FSDP head unit
        runs one forward, is gathered once and reduced once, whatever the depth."""
        hidden = self.model(batch_BS1[:, :-1], mtp=True)  # called as the module: FSDP's root hooks run
        eod = self.config.eod_token_id if self.config.document_masking else None
        targets = [mtp.targets(batch_BS1, depth, eod) for depth in range(len(hidden))]
        # under context parallelism: this rank's positions of each depth, N x its share (context_parallel_mean)
        share, S = self.ranks_per_sequence, batch_BS1.shape[1] - 1
        local = [self.model.local_targets(t_BS, S).flatten() for t_BS in targets]
        totals = self.model.output.cross_entropy_sums([h_BSD.flatten(0, 1) for h_BSD in hidden], local,
                                                      self.loss_chunk_size)
        losses = [share * total / (t_BS != -100).sum().clamp(min=1) for total, t_BS in zip(totals, targets)]
        main, mtp_mean = losses[0], torch.stack(losses[1:]).mean()
        self._main_loss = main
        self.log("train/mtp_loss", self._world_mean(mtp_mean))  # a replica's (a CP rank's share of it)
        return main + self.config.mtp_loss_weight * mtp_mean

    def _pipeline_loss(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        """The batch through the pipeline's stages (training: forward and backward, already done when this
        returns), its loss the same number on every stage: ``main + λ · mean(CE_k)`` as ``_multi_token_loss``."""
        losses_K = self.pipeline.run(batch_BS1, training=self.training)
        if len(losses_K) == 1:
            return losses_K[0]
        self._main_loss, mtp_mean = losses_K[0], losses_K[1:].mean()
        self.log("train/mtp_loss", self._world_mean(mtp_mean))  # its pipeline's: one data replica's
        return losses_K[0] + self.config.mtp_loss_weight * mtp_mean

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning zeroes the gradients between the training step and its backward; under pipeline parallelism
        the step ran backward already, and the strategy zeroed them before it."""
        if self.pipeline is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def expert_counts(self) -> torch.Tensor | None:
        """``[moe_layers, experts]`` token counts of the last forward."""
        moe_layers = self.model.moe_layers()
        return torch.stack([m.tokens_per_expert for m in moe_layers]) if moe_layers else None

    def on_train_start(self) -> None:
        uses_aux = self.config.aux_loss_coef > 0 or self.config.z_loss_coef > 0
        if uses_aux and str(self.trainer.precision).startswith("16"):
            raise ValueError(f"trainer.precision={self.trainer.precision!r} scales the loss, but the balancing "
                             "losses enter the gradient unscaled: use bf16-mixed or 32-true, or set "
                             "model.config.aux_loss_coef and z_loss_coef to 0.")
        for moe in self.model.moe_layers():
            moe.aux_loss_grad_scale = 1.0 / self.trainer.accumulate_grad_batches
        self.on_train_end()  # a fit that raised left its hooks
        # what runs each training forward: the model, or each pipeline stage once per micro-batch
        self._aux_hooks = [part.register_forward_hook(self._record_aux_losses)
                           for part in (self.pipeline.parts if self.pipeline is not None else [self.model])]

    def on_train_end(self) -> None:
        for hook in self._aux_hooks:
            hook.remove()
        self._aux_hooks, self._step_aux_losses = [], {}

    def _record_aux_losses(self, part: torch.nn.Module, args, output) -> None:
        """Forward hook: the balancing losses this training forward left on ``part``'s MoE layers (summed over
        them), read before a block recomputed in backward could write them again. Kept per part: a rank holding
        several pipeline stages runs each once per micro-batch, and their layers add up."""
        aux = [m.aux_loss for m in part.moe_layers() if m.aux_loss is not None] if part.training else []
        if aux:
            self._step_aux_losses.setdefault(id(part), []).append(torch.stack(aux).sum())

    def training_step(self, batch_BS1: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self._main_loss = None
        loss = self._loss(batch_BS1)
        counts_LE = self.expert_counts()
        if counts_LE is not None:  # read now: recomputation in backward would overwrite them
            self._pending_expert_counts = counts_LE if self._pending_expert_counts is None \
                else self._pending_expert_counts + counts_LE
        # a context-parallel group's ranks share their batch: world / size batches a step
        self.tokens_seen += batch_BS1[:, :-1].numel() * self.trainer.world_size // self.ranks_per_batch
        self._log_train_loss((loss if self._main_loss is None else self._main_loss).detach().float(), batch_idx)
        if logs_written(self.trainer):  # a Python number logged costs a host-to-device copy and a sync
            self.log("train/tokens_seen", float(self.tokens_seen))
        return loss

    def _log_train_loss(self, loss: torch.Tensor, batch_idx: int) -> None:
        """Log the loss of the whole global batch: the mean over this step's micro-batches and, on the steps
        whose logs are written, over all ranks (one all-reduce of a scalar); no step reads it back to the host."""
        accumulate = self.trainer.accumulate_grad_batches
        micro = batch_idx % accumulate
        self._train_loss_sum = loss if micro == 0 or self._train_loss_sum is None else self._train_loss_sum + loss
        if not optimizer_step_ends(self.trainer):  # not the step's last micro-batch
            return
        mean = self._world_mean(self._train_loss_sum / (micro + 1))
        self.log("train/loss", mean)  # not in the progress bar: Lightning would read it back to the host every step
        self.log("train/perplexity", mean.exp())

    def _world_mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a data replica's, or a context-parallel rank's share of it) averaged over every rank on the steps
        whose logs are written, so a logged train metric is the global batch's (one all-reduce of a scalar; no read
        back to the host); this rank's value on the other steps, which nobody reads."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                and self._trainer is not None and logs_written(self.trainer)):
            return value.detach()
        mean = value.detach().clone()
        dist.all_reduce(mean)
        return mean / dist.get_world_size()

    def configure_callbacks(self):
        """The non-finite-loss guard, the signal handling and the final checkpoint run in every fit (unless the
        trainer already has them, e.g. from YAML)."""
        present = self.trainer.callbacks if self._trainer is not None else []
        return [cls() for cls in (NonFiniteGuard, Preemption, FinalCheckpoint)
                if not any(isinstance(cb, cls) for cb in present)]

    def on_before_optimizer_step(self, optimizer) -> None:
        """Once per optimizer step, after every micro-batch's backward: move the balancing bias using the
        counts of all ranks (not earlier: a block recomputed in backward must route as it did in forward), and log
        ``train/expert_imbalance`` and ``train/aux_loss`` of the step."""
        pending, self._pending_expert_counts = self._pending_expert_counts, None
        aux_losses, self._step_aux_losses = self._step_aux_losses, {}
        several_ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        whole = several_ranks and logs_written(self.trainer)
        counts_LE = None if pending is None else pending.float()
        if counts_LE is not None and (self.config.bias_update_rate != 0 or whole):
            self.sum_expert_counts(counts_LE)  # the ranks holding these layers: the step's counts of every token
        if counts_LE is not None and self.config.bias_update_rate != 0:
            for moe, counts_E in zip(self.model.moe_layers(), counts_LE):
                moe.router.update_bias(counts_E, self.config.bias_update_rate)
        if several_ranks and not whole:  # a rank's own numbers (under stages: its stage's layers) are never logged
            return
        aux = sum(torch.stack(forwards).mean() for forwards in aux_losses.values()) if aux_losses else None
        self._log_balance(counts_LE, aux, whole)  # each part's mean over the micro-batches, summed over the parts

    def _log_balance(self, counts_LE: torch.Tensor | None, aux: torch.Tensor | None, whole: bool) -> None:
        """``train/expert_imbalance``: the busiest expert's load over the mean, per MoE layer, averaged over the
        layers; ``train/aux_loss``: the balancing losses summed over the layers, averaged over the step's
        micro-batches (each a mean over its sequences). On the steps whose logs are written (``whole``) both are
        the whole model's over the global batch, the same on every rank: one all-reduce over every rank of each
        rank's sums over its layers (a pipeline stage's ranks hold the same layers, their counts summed already;
        a stage's balancing loss is the mean over its data-parallel ranks, counted by the first stage's ranks).
        With one process every step is logged (its layers and batch are the whole model's and global batch);
        with several, only the steps whose logs are written: off that grid a rank holds only its own batch and,
        under pipeline stages, its stage's layers (a different quantity), and ``callback_metrics`` (read by
        callbacks such as ``TrainingCurves`` or ``ModelCheckpoint(monitor=...)``) keeps the last whole value."""
        config = self.config
        if not any(config.is_moe_layer(i) for i in range(config.n_layers)):  # the same on every rank
            return
        balances = config.aux_loss_coef > 0 or config.z_loss_coef > 0
        ratio_L = counts_LE.max(-1).values / counts_LE.mean(-1) if counts_LE is not None else None
        if not whole:  # one process
            if ratio_L is not None:
                self.log("train/expert_imbalance", ratio_L.mean())
            if aux is not None:
                self.log("train/aux_loss", aux)
            return
        zero = torch.zeros((), device=self.device)
        first_stage = float(getattr(self.model, "pipeline_first", True))
        sums = torch.stack([zero if ratio_L is None else ratio_L.sum().to(self.device),
                            zero + (0 if ratio_L is None else ratio_L.numel()),
                            zero if aux is None else aux.to(self.device), zero + first_stage])
        dist.all_reduce(sums)  # every rank, so a stage without MoE layers takes part too
        imbalance_sum, moe_layers, aux_sum, data_parallel_ranks = sums.unbind()
        self.log("train/expert_imbalance", imbalance_sum / moe_layers)
        if balances:
            self.log("train/aux_loss", aux_sum / data_parallel_ranks)

    def on_validation_epoch_start(self) -> None:
        self.val_loss_mean.reset()  # state made in this loop's grad mode (a standalone run's are inference tensors)

    def on_test_epoch_start(self) -> None:
        self.val_loss_mean.reset()

    def validation_step(self, batch_BS1: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss = self._loss(batch_BS1)
        self.val_loss_mean.update(loss)
        loaders = self.trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)) and len(loaders) > 1:  # a data mixture: one held-out split per source
            name = getattr(loaders[dataloader_idx], "name", dataloader_idx)
            self.log(f"val/loss/{name}", loss, sync_dist=True, add_dataloader_idx=False)
        else:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        loaders = self.trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)) and len(loaders) > 1:  # overall: the mean over every source's batches
            self.log("val/loss", self.val_loss_mean.compute(), prog_bar=True, sync_dist=True)
        # compute() has already reduced over ranks; sync_dist (a no-op mean of equal values) is what Lightning asks
        self.log("val/perplexity", self.val_loss_mean.compute().exp(), sync_dist=True)
        self.val_loss_mean.reset()

    def test_step(self, batch_BS1: torch.Tensor, batch_idx: int) -> None:
        """Held-out loss per token; perplexity is exp of that mean over the whole test set (not a mean of exps)."""
        loss = self._loss(batch_BS1)
        self.val_loss_mean.update(loss, weight=batch_BS1.shape[0])  # a short last batch counts for its tokens
        self.log("test/loss", loss, sync_dist=True, batch_size=batch_BS1.shape[0])

    def on_test_epoch_end(self) -> None:
        self.log("test/perplexity", self.val_loss_mean.compute().exp(), sync_dist=True)  # as val/perplexity
        self.val_loss_mean.reset()

    def predict_step(self, batch: dict, batch_idx: int) -> list[int]:
        """One prompt ``{"tokens_1S", "sampling"}`` (see ``cli.MoECLI.predict``) → the new token ids."""
        return list(stream(self.model, batch["tokens_1S"], batch["sampling"], batch["eod_id"]))

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(param_groups(self.model, self.weight_decay))
        scheduler = self.lr_scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        requested = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
        optimizer.register_load_state_dict_post_hook(partial(_keep_requested_hyperparameters, requested=requested))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """After a resume the schedule continues from the requested base LR, not the checkpoint's, for every group
        this run has (a checkpoint of pipeline stages holds rank 0's stage's groups only)."""
        if getattr(scheduler, "base_lrs", None) is not None:
            saved = scheduler.base_lrs
            scheduler.base_lrs = [g.get("initial_lr", saved[i] if i < len(saved) else g["lr"])
                                  for i, g in enumerate(scheduler.optimizer.param_groups)]
        super().lr_scheduler_step(scheduler, metric)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Plain data only (loaded with ``weights_only=True``): the config as a dict."""
        checkpoint["tokens_seen"] = self.tokens_seen
        if "hyper_parameters" in checkpoint:  # the config that ran, also when it was built from config=None
            checkpoint["hyper_parameters"]["config"] = dataclasses.asdict(self.config)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """The backup of the resume guard, for what the CLI cannot see: ``Trainer.fit(ckpt_path=...)`` from Python,
        ``best``, remote files. Refuses a checkpoint of another model before its weights are loaded (every strategy,
        ``MoEFSDPStrategy`` included, loads them after this hook). The guard is ``compat.check_checkpoint``, which
        ``moe-lightning`` runs before anything is built."""
        check_resume(checkpoint.get("hyper_parameters") or {}, {"config": self.config}, None)
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self._pending_expert_counts = None
