"""moe_lightning: train Mixture-of-Experts language models with Lightning, from one CPU to many GPUs."""

from .data import TextDataModule
from .model import MoEConfig, MoETransformer
from .module import MoELanguageModel

__all__ = ["MoEConfig", "MoETransformer", "MoELanguageModel", "TextDataModule"]
__version__ = "0.1.0"
