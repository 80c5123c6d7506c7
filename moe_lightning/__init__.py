"""moe_lightning: train Mixture-of-Experts language models with Lightning, from one CPU to many GPUs.

The names below are imported on first use (``__getattr__``), so the commands that do not train (``--help``,
``plan``, ``export``, ``generate``...) never import Lightning, which takes seconds.

Configs and checkpoints written before the layout moved name ``moe_lightning.strategy`` and
``moe_lightning.callbacks`` (and their modules): those paths import the modules' new homes with a ``FutureWarning``
that names the new path (``MOVED``).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_LAZY = {"MoEConfig": ".model", "MoETransformer": ".model", "MoELanguageModel": ".training.module",
         "TextDataModule": ".data"}

__all__ = ["MoEConfig", "MoETransformer", "MoELanguageModel", "TextDataModule"]
__version__ = "0.1.0"


# old module path -> where it lives now (a module below an old path moved with it)
MOVED = {"moe_lightning.strategy": "moe_lightning.training.strategy",
         "moe_lightning.callbacks": "moe_lightning.training.callbacks"}


def moved_to(name: str) -> str | None:
    """The new name of a module imported by its path before the layout moved, else None."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module at its new one (the same module object, so the same classes), warning
    once per path. First on ``sys.meta_path``: the ordinary finder would load a moved submodule a second time."""

    def __init__(self):
        self.own_specs = {}  # old name -> the module's own spec, which the import machinery overwrites

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if moved_to(name) else None

    def create_module(self, spec):
        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} moved to {new}: write {new} in configs and code ({spec.name} will be removed).",
                      FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        self.own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        """The module was executed at its new path: only its own spec is put back (``reload`` reads it)."""
        module.__spec__ = self.own_specs.pop(module.__spec__.name)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
    if moved_to(f"{__name__}.{name}"):
        return importlib.import_module(f"{__name__}.{name}")  # through _MovedModules
    if name not in _LAZY:
        raise AttributeError(f"module 'moe_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
