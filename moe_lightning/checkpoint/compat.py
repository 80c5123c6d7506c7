"""The one resume check: a checkpoint continues only the model it was trained as, on the data it was trained on.

LightningCLI would re-parse the checkpoint's hyperparameters over the command line, so a checkpoint of
another shape would silently win. Instead the command line always wins, and ``check_checkpoint`` refuses, before
anything is built (``moe-lightning`` runs it once, for every subcommand and every ``ckpt_path``, ``last``
resolved): a model that differs in its shape or function (one line per differing field; training knobs may
change), and a training position saved on other data (another source, mixture, seq_len, shuffle or split),
whatever kind of source it is: the guard. Paths Lightning resolves itself (``best``, remote files, ``Trainer.fit``
from Python) are checked when it hands the checkpoint over, by one backup each: the model in
``MoELanguageModel.on_load_checkpoint`` (before any strategy loads a weight), the data in ``check_position`` when the
loader's position is restored.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_lightning.model import MoEConfig
from moe_lightning.checkpoint.commit import OLD_SUFFIX
from moe_lightning.checkpoint.discovery import checkpoint_metadata

# MoEConfig fields a resumed run may change: they steer training, not what the weights compute.
MAY_CHANGE = frozenset({"bias_update_rate", "aux_loss_coef", "z_loss_coef", "init_std", "max_seq_len",
                        "document_masking", "eod_token_id", "mtp_loss_weight"})
_LIGHTNING_KEYS = ("_class_path", "_instantiator")


class ResumeMismatchError(ValueError):
    """The checkpoint holds a different model than the one requested."""


LIGHTNING_NAMES = ("last", "best", "hpc", "registry")  # ckpt_path values Lightning resolves, not paths


def checkpoint_state(ckpt_path: str | Path) -> dict | None:
    """The plain data of a single-file or sharded checkpoint (hyperparameters, loop state), read without tensors
    or code; ``None`` for what Lightning resolves itself."""
    path = Path(ckpt_path)
    if not path.exists() and not path.with_name(path.name + OLD_SUFFIX).exists():
        if str(ckpt_path) in LIGHTNING_NAMES or "://" in str(ckpt_path) or str(ckpt_path).startswith("registry:"):
            return None  # Lightning resolves those itself
        raise FileNotFoundError(f"ckpt_path={str(ckpt_path)!r}: no such checkpoint file or folder; pass a saved "
                                "checkpoint (e.g. <run>/checkpoints/last.ckpt, or a sharded checkpoint folder).")
    return checkpoint_metadata(path)  # the package's one reader and unpickling rule


def config_fields(config: MoEConfig | dict) -> dict[str, Any]:
    """Every field of a validated ``MoEConfig`` (derived ones such as ``head_dim`` filled in).

    Fields the checkpoint predates take their defaults; fields this version no longer has are dropped.
    """
    raw = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    known = {f.name for f in dataclasses.fields(MoEConfig)}
    return dataclasses.asdict(MoEConfig(**{k: v for k, v in raw.items() if k in known}))


def _named(ckpt_path: str | None) -> str:
    """The checkpoint as messages name it: its ``ckpt_path`` where the caller knows it."""
    return "the checkpoint being restored" if ckpt_path is None else f"ckpt_path={str(ckpt_path)!r}"


def check_resume(saved_hparams: dict, requested: dict[str, Any], ckpt_path: str | None) -> list[str]:
    """Raise if the model config differs in a field outside ``MAY_CHANGE``; return what else changed.

    ``requested`` is the model's init arguments from the command line (``config`` a dict or ``MoEConfig``);
    ``ckpt_path`` ``None`` where the caller only has the loaded checkpoint.
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
            f"{_named(ckpt_path)} holds a different model than the one requested:\n  " + "\n  ".join(refused)
            + "\nResume with the config the checkpoint was trained with (pass its config.yaml with --config), "
              "or start a new run without --ckpt_path.")
    for name, value in requested.items():
        if name != "config" and name not in _LIGHTNING_KEYS and name in saved_hparams \
                and saved_hparams[name] != value:
            changed.append(f"model.init_args.{name}: checkpoint {saved_hparams[name]!r}, requested {value!r}")
    return [f"resume: {line} (using the requested value)" for line in changed]


def saved_position(state: dict) -> dict | None:
    """The training loader's saved position (``TextDataModule``'s: epoch, samples, and what the data was), or
    that of a checkpoint older still, which kept it in the datamodule's own state."""
    loaders = (((state.get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {}).get("combined_loader")
    if isinstance(loaders, list) and loaders and isinstance(loaders[0], dict):
        return loaders[0]
    datamodule = state.get("TextDataModule")
    return datamodule if isinstance(datamodule, dict) and "epoch" in datamodule else None


def check_order(saved: dict, ckpt_path: str | None) -> None:
    """Refuse a position saved part-way through an epoch of an earlier version's shuffle (its position names no
    ``order``): here it would repeat and skip sequences. One saved at an epoch's start resumes exactly."""
    if "order" not in saved and saved.get("samples", 0) > 0:
        raise ResumeMismatchError(
            f"{_named(ckpt_path)} stopped {saved['samples']:,} sequences into epoch {saved.get('epoch', 0)} of the "
            "shuffle order of an earlier version (its position names no order); this version would repeat and skip "
            "sequences. Finish that run with the version that wrote it, or start a new run.")


def check_data(saved: dict, current: dict, ckpt_path: str | None) -> None:
    """Refuse a position saved on other data: every description field both sides have must agree (a field only
    one side has, from an older or newer version, is not compared), and the mixture always (none: one corpus)."""
    differ = [f"data {name}: checkpoint {saved.get(name)!r}, requested {current[name]!r}"
              for name in current if (name in saved or name == "mixture") and saved.get(name) != current[name]]
    if differ:
        raise ResumeMismatchError(
            f"{_named(ckpt_path)} was trained on other data, so its position in the training order means nothing "
            "here:\n  " + "\n  ".join(differ) + "\nResume with the data.source, weights, seq_len, val_fraction, "
            "max_tokens and shuffle_seed it was trained with, or start a new run without --ckpt_path.")


def check_position(saved: dict, current: dict) -> None:
    """The backup of the data check, for the paths ``check_checkpoint`` never sees (``Trainer.fit(ckpt_path=...)``
    from Python, ``best``): the data a restored position was saved on (``current``: ``TextDataModule.description``),
    then its order."""
    check_data(saved, current, None)
    check_order(saved, None)


def check_checkpoint(ckpt_path: str | Path, model_args: dict[str, Any], data=None,
                     check_tokenizer: Callable[[], None] = lambda: None, training: bool = True) -> list[str]:
    """The resume guard, run once by ``moe-lightning`` before anything is built: the model (``check_resume``), then the tokenizer (the
    caller's ``check_tokenizer``: other ids would also make other data, and that says it better), then, when
    ``data`` describes itself (``TextDataModule.description``; it is set up for that, so the caller passes ``None``
    when that would mean tokenizing text the run has not tokenized yet: the restore checks it then) and the checkpoint
    saved a training position, the data, and (``training``: ``fit`` continues from that position) its order.
    Returns the lines saying which training settings the run changes."""
    state = checkpoint_state(ckpt_path)
    if state is None:
        return []
    lines = check_resume(state.get("hyper_parameters") or {}, model_args, str(ckpt_path))
    check_tokenizer()
    position = saved_position(state)
    if position is not None and training:
        check_order(position, str(ckpt_path))
    if position is not None and callable(getattr(data, "description", None)):
        data.setup("fit")
        check_data(position, data.description(), str(ckpt_path))
    return lines
