"""The LightningModule: builds the model late, computes the loss, balances experts, logs what matters."""

import functools
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from .model import LocalTokenDispatcher, MoEConfig, MoETransformer
from .optim import WarmupCosineLR, param_groups


def compile_blocks(layers: torch.nn.ModuleList, backend: str = "inductor") -> None:
    """``torch.compile`` each block's ``forward`` in place (per block: the graphs are small and shared).

    Only ``forward`` is compiled (through a subclass, as FSDP2 itself swaps the class), never the module's
    ``__call__``: FSDP2's hooks and ActivationOffload's checkpoint wrapper (an instance ``forward`` that
    calls the class's) stay eager around the compiled graph, so the order against sharding and offload
    does not matter, and parameter names are unchanged. Compilation happens at the first call, after
    sharding. Blocks with local MoE dispatch compile with ``fullgraph=True``; the all-to-all dispatch of
    expert parallelism needs its split sizes on the host and runs eagerly between two graphs.
    """
    for block in layers:
        block.__class__ = _compiled_class(type(block), backend)


@functools.cache
def _compiled_class(cls: type, backend: str) -> type:
    whole = torch.compile(cls.forward, fullgraph=True, backend=backend)
    split = torch.compile(cls.forward, backend=backend)

    def forward(self, *args, **kwargs):
        dispatcher = getattr(self.ffn, "dispatcher", None)
        local = dispatcher is None or isinstance(dispatcher, LocalTokenDispatcher)
        return (whole if local else split)(self, *args, **kwargs)

    return type(f"Compiled{cls.__name__}", (cls,), {"forward": forward, "__doc__": cls.__doc__})


def default_optimizer(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))


class MoELanguageModel(L.LightningModule):
    """Next-token prediction with an MoE transformer.

    Args:
        config: Model shape and routing.
        optimizer: Builds the optimizer from parameter groups (each group carries ``role`` and
            ``param_names``); built in ``configure_optimizers`` so it sees the sharded parameters.
        lr_scheduler: Builds the per-step LR schedule from the optimizer.
        weight_decay: Decoupled weight decay for matrices (never norms, biases, embeddings).
        compile: ``torch.compile`` every block's forward (see ``compile_blocks``); works in fp32 and bf16,
            on CPU and GPU, with ``MoEFSDPStrategy`` and ``ActivationOffload``.
    """

    def __init__(self, config: MoEConfig | None = None, optimizer: OptimizerCallable = default_optimizer,
                 lr_scheduler: LRSchedulerCallable = partial(WarmupCosineLR, warmup_steps=100),
                 weight_decay: float = 0.1, compile: bool = False):
        super().__init__()
        self.config = config if config is not None else MoEConfig()
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.weight_decay, self.compile_each_block = weight_decay, compile
        self.model: MoETransformer | None = None
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.tokens_seen = 0
        self._pending_expert_counts: torch.Tensor | None = None
        self.val_loss_mean = torchmetrics.aggregation.MeanMetric()

    def configure_model(self) -> None:
        """Build once; under ``trainer.init_module(empty_init=True)`` this lands on the meta device."""
        if self.model is None:
            self.model = MoETransformer(self.config)
            if self.compile_each_block:
                compile_blocks(self.model.layers)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_BS)

    def _loss(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
        logits_BSV = self.model(inputs_BS)
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())

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

    def training_step(self, batch_BS1: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch_BS1)
        counts_LE = self.expert_counts()
        if counts_LE is not None:  # read now: recomputation in backward would overwrite them
            self._pending_expert_counts = counts_LE if self._pending_expert_counts is None \
                else self._pending_expert_counts + counts_LE
            self.log("train/expert_imbalance", (counts_LE.max(-1).values / counts_LE.float().mean(-1)).mean())
            aux = [m.aux_loss for m in self.model.moe_layers() if m.aux_loss is not None]
            if aux:
                self.log("train/aux_loss", torch.stack(aux).sum())
        self.tokens_seen += batch_BS1[:, :-1].numel() * self.trainer.world_size
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/perplexity", loss.detach().exp())
        self.log("train/tokens_seen", float(self.tokens_seen))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Once per optimizer step, after every micro-batch's backward: move the balancing bias using the
        counts of all ranks. (Not earlier: a block recomputed in backward must route as it did in forward.)"""
        pending, self._pending_expert_counts = self._pending_expert_counts, None
        if pending is None or self.config.bias_update_rate == 0:
            return
        counts_LE = self.trainer.strategy.reduce(pending.float(), reduce_op="sum")
        for moe, counts_E in zip(self.model.moe_layers(), counts_LE):
            moe.router.update_bias(counts_E, self.config.bias_update_rate)

    def validation_step(self, batch_BS1: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch_BS1)
        self.val_loss_mean.update(loss)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val/perplexity", self.val_loss_mean.compute().exp())
        self.val_loss_mean.reset()

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(param_groups(self.model, self.weight_decay))
        scheduler = self.lr_scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self._pending_expert_counts = None
