"""Pure-PyTorch MoE transformer. Nothing in this package imports ``torch.distributed``."""

from .config import ConfigError, MoEConfig
from .moe import GroupedExperts, LocalTokenDispatcher, MoELayer, Router, TokenDispatcher
from .transformer import Block, MoETransformer

__all__ = ["ConfigError", "MoEConfig", "GroupedExperts", "LocalTokenDispatcher", "MoELayer", "Router",
           "TokenDispatcher", "Block", "MoETransformer"]
