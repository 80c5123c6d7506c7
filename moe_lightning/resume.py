"""Resume checks: a checkpoint continues only the model it was trained as; training knobs may change.

LightningCLI would re-parse the checkpoint's hyperparameters over the command line, so a checkpoint of
another shape would silently win. Instead the command line always wins, and any difference in the
model's shape or function is refused before anything is built, one line per differing field.
"""

import dataclasses
from pathlib import Path
from typing import Any

from .model import MoEConfig
from .parallel import checkpoint as ckpt

# MoEConfig fields a resumed run may change: they steer training, not what the weights compute.
MAY_CHANGE = frozenset({"bias_update_rate", "aux_loss_coef", "z_loss_coef", "init_std", "max_seq_len",
                        "document_masking", "eod_token_id", "mtp_loss_weight"})
_LIGHTNING_KEYS = ("_class_path", "_instantiator")


class ResumeMismatchError(ValueError):
    """The checkpoint holds a different model than the one requested."""


def checkpoint_hyperparameters(ckpt_path: str | Path) -> dict | None:
    """The ``hyper_parameters`` of a single-file or sharded checkpoint, read without tensors or code."""
    path = Path(ckpt_path)
    if not path.exists() and not path.with_name(path.name + ckpt.OLD_SUFFIX).exists():
        return None  # "last", "best", a remote URL...: Lightning resolves those itself
    return ckpt.checkpoint_metadata(path).get("hyper_parameters")  # the package's one reader and unpickling rule


def config_fields(config: MoEConfig | dict) -> dict[str, Any]:
    """Every field of a validated ``MoEConfig`` (derived ones such as ``head_dim`` filled in).

    Fields the checkpoint predates take their defaults; fields this version no longer has are dropped.
    """
    raw = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    known = {f.name for f in dataclasses.fields(MoEConfig)}
    return dataclasses.asdict(MoEConfig(**{k: v for k, v in raw.items() if k in known}))


def check_resume(saved_hparams: dict, requested: dict[str, Any], ckpt_path: str) -> list[str]:
    """Raise if the model config differs in a field outside ``MAY_CHANGE``; return what else changed.

    ``requested`` is the model's init arguments from the command line (``config`` a dict or ``MoEConfig``).
    """
    changed, refused = [], []
    if saved_hparams.get("config") is not None:  # the module builds MoEConfig() from config=None
        saved, wanted = config_fields(saved_hparams["config"]), config_fields(requested.get("config") or MoEConfig())
        for name in saved:
            if saved[name] != wanted[name]:
                line = f"model.init_args.config.{name}: checkpoint {saved[name]!r}, requested {wanted[name]!r}"
                (changed if name in MAY_CHANGE else refused).append(line)
    if refused:
        raise ResumeMismatchError(
            f"ckpt_path={ckpt_path!r} holds a different model than the one requested:\n  " + "\n  ".join(refused)
            + "\nResume with the config the checkpoint was trained with (pass its config.yaml with --config), "
              "or start a new run without --ckpt_path.")
    for name, value in requested.items():
        if name != "config" and name not in _LIGHTNING_KEYS and name in saved_hparams \
                and saved_hparams[name] != value:
            changed.append(f"model.init_args.{name}: checkpoint {saved_hparams[name]!r}, requested {value!r}")
    return [f"resume: {line} (using the requested value)" for line in changed]
