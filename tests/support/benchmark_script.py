"""Import a ``benchmarks/`` script as a module, so tests can run its ``--dry-run`` and check its pieces."""

import importlib.util
from types import ModuleType

from tests.support.distributed import REPO_ROOT


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
