"""Pure-PyTorch MoE transformer. Nothing in this package imports ``torch.distributed``."""

from moe_lightning.model.config import ConfigError, MoEConfig
from moe_lightning.model.moe import GroupedExperts, LocalTokenDispatcher, MoELayer, Router, TokenDispatcher
from moe_lightning.model.transformer import Block, MoETransformer

__all__ = ["ConfigError", "MoEConfig", "GroupedExperts", "LocalTokenDispatcher", "MoELayer", "Router",
           "TokenDispatcher", "Block", "MoETransformer"]
