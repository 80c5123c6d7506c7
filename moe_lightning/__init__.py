"""moe_lightning: train Mixture-of-Experts language models with Lightning, from one CPU to many GPUs.

The names below are imported on first use (``__getattr__``), so the commands that do not train (``--help``,
``plan``, ``export``, ``generate``...) never import Lightning, which takes seconds.
"""

import importlib

_LAZY = {"MoEConfig": ".model", "MoETransformer": ".model", "MoELanguageModel": ".training.module",
         "TextDataModule": ".data"}

__all__ = ["MoEConfig", "MoETransformer", "MoELanguageModel", "TextDataModule"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'moe_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
