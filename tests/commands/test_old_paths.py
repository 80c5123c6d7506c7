"""Configs written before the layout moved (``moe_lightning.strategy``, ``moe_lightning.callbacks``) keep working:
each old path imports the class at its new home, with a FutureWarning naming the new path."""

import importlib
import sys
import warnings

import yaml
from jsonargparse._util import import_object  # how LightningCLI resolves a class_path

import moe_lightning

from moe_lightning.commands import main as commands
from moe_lightning.training.callbacks import ExpertLoadMonitor, TrainingCurves
from moe_lightning.training.strategy import MoEFSDPStrategy

from tests.support.distributed import REPO_ROOT

# Every class_path a config could name before the move: the strategy and each entry of the old
# moe_lightning/callbacks/__init__.py, by package and by module (the old files' names)
OLD_PATHS = {
    "moe_lightning.strategy.MoEFSDPStrategy": "moe_lightning.training.strategy",
    **{f"moe_lightning.callbacks.{name}": "moe_lightning.training.callbacks"
       for name in ("ActivationOffload", "AllocatorMonitor", "ExpertLoad", "ExpertLoadMonitor", "FinalCheckpoint",
                    "MoEThroughputMonitor", "NonFiniteGuard", "QKClip", "TrainingCurves")},
    **{f"moe_lightning.callbacks.{module}.{name}": f"moe_lightning.training.callbacks.{module}"
       for module, name in (("activation_offload", "ActivationOffload"), ("allocator_monitor", "AllocatorMonitor"),
                            ("expert_load", "ExpertLoadMonitor"), ("final_checkpoint", "FinalCheckpoint"),
                            ("nonfinite", "NonFiniteGuard"), ("qk_clip", "QKClip"),
                            ("throughput", "MoEThroughputMonitor"), ("training_curves", "TrainingCurves"))},
}

def forget_old_paths(monkeypatch) -> None:
    """This process as if no old path had been imported yet (restored after the test)."""
    for name in [n for n in sys.modules if n.startswith(("moe_lightning.strategy", "moe_lightning.callbacks"))]:
        monkeypatch.delitem(sys.modules, name)
    for attribute in ("strategy", "callbacks"):
        monkeypatch.delattr(moe_lightning, attribute, raising=False)


def test_every_old_class_path_is_the_new_class_with_a_warning_naming_the_new_path(monkeypatch):
    """Resolved as LightningCLI resolves a class_path (jsonargparse's ``import_object``): the class at the new path
    (the same object, not a second copy of its module), and the first import of each old module warns with its new
    name."""
    forget_old_paths(monkeypatch)
    for old, new_module in OLD_PATHS.items():
        old_module, name = old.rsplit(".", 1)
        first = old_module not in sys.modules
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls = import_object(old)
        assert cls is getattr(importlib.import_module(new_module), name), old
        said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        if first:
            assert any(m.startswith(f"{old_module} moved to {new_module}:") for m in said), (old, said)


def test_an_old_path_leaves_the_modules_own_spec_so_reload_works(monkeypatch):
    """Importing by an old path does not rename the real module (was: its ``__spec__`` became the old path's, so
    ``importlib.reload`` of it looked up the old name and ran nothing)."""
    forget_old_paths(monkeypatch)
    for new in ("moe_lightning.training.strategy", "moe_lightning.training.callbacks.qk_clip"):
        module = importlib.import_module(new)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            importlib.import_module(new.replace("training.", ""))
        assert module.__spec__.name == new and module.__spec__.origin.endswith(new.rsplit(".", 1)[1] + ".py")
        before = dict(vars(module))
        try:
            module.__dict__.pop("__doc__")  # reload executes the file again: it sets the docstring back
            assert importlib.reload(module) is module and module.__doc__ == before["__doc__"]
        finally:
            vars(module).clear()
            vars(module).update(before)  # the classes other tests hold

def test_fit_runs_a_config_with_the_old_strategy_and_callback_paths(tmp_path, monkeypatch):
    forget_old_paths(monkeypatch)
    config = yaml.safe_load((REPO_ROOT / "configs" / "tiny-fsdp.yaml").read_text())
    config["trainer"]["strategy"]["class_path"] = "moe_lightning.strategy.MoEFSDPStrategy"
    config["trainer"]["strategy"]["init_args"]["expert_parallel_size"] = 1
    config["trainer"]["callbacks"] = [{"class_path": "moe_lightning.callbacks.ExpertLoadMonitor"},
                                      {"class_path": "moe_lightning.callbacks.training_curves.TrainingCurves"}]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(config))
    run = commands.run(["fit", "--config", str(tmp_path / "old.yaml"), "--trainer.devices=1", "--trainer.max_steps=1",
                        "--trainer.limit_val_batches=0", f"--trainer.logger.init_args.save_dir={tmp_path}",
                        "--data.init_args.batch_size=2", "--data.init_args.max_tokens=20000",
                        "--trainer.enable_progress_bar=false"])
    assert run.trainer.global_step == 1 and isinstance(run.trainer.strategy, MoEFSDPStrategy)
    assert any(isinstance(c, ExpertLoadMonitor) for c in run.trainer.callbacks)
    assert any(isinstance(c, TrainingCurves) for c in run.trainer.callbacks)
