"""What a run's YAML says, read without Lightning: the model's ``MoEConfig`` (typed by jsonargparse as ``fit``
types it) and the mesh, offload, optimizer and data fields that ``plan`` prices, from one file or several
composed as ``fit --config A --config B`` composes them."""

from pathlib import Path
from typing import Any

import yaml

from moe_lightning.model import MoEConfig


def read_config(paths: str | Path | list) -> dict[str, Any]:
    """The run config of one YAML file, or of several composed as ``fit --config A --config B`` composes them: a
    later file overrides an earlier one field by field; a mapping naming another ``class_path`` replaces the earlier
    one whole, and a list (``trainer.callbacks``) is replaced, not extended.

    Not fit's parser itself: that is LightningCLI's, which imports Lightning (seconds) to read the trainer's, the
    strategy's and the callbacks' signatures. ``tests/planner/test_plan.py`` checks the two compose alike."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    composed: dict[str, Any] = {}
    for path in paths:
        with open(path) as f:
            composed = _merge(composed, yaml.safe_load(f) or {})
    return composed


def _merge(earlier: Any, later: Any) -> Any:
    if not (isinstance(earlier, dict) and isinstance(later, dict)):
        return later
    if later.get("class_path", earlier.get("class_path")) != earlier.get("class_path"):
        return later
    return {**earlier, **{key: _merge(earlier.get(key), value) for key, value in later.items()}}


def load_model_config(path: str | Path | list) -> MoEConfig:
    """``model.init_args.config`` of a LightningCLI YAML (or several composed; or a bare mapping of MoEConfig
    fields), typed and checked by jsonargparse against ``MoEConfig``'s fields as ``fit`` reads it (``1e-3`` is a
    float, a misspelt field an error)."""
    from jsonargparse import ArgumentError, ArgumentParser

    data = read_config(path)
    fields = data.get("model", {}).get("init_args", {}).get("config", data if "dim" in data else None)
    if fields is None:
        raise ValueError(f"{path}: no model.init_args.config section with MoEConfig fields.")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", type=MoEConfig)
    try:
        parsed = parser.parse_object({"config": fields})
    except ArgumentError as error:
        raise ValueError(f"model.init_args.config: {str(error).strip()}") from None
    return MoEConfig(**parsed.config.as_dict())


def _class_name(entry: Any) -> str:
    return str(entry.get("class_path", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else ""


def read_run_config(path: str | list[str]) -> dict[str, Any]:
    """What LightningCLI YAML (one file or several composed) says about the plan's inputs (``run_inputs``)."""
    return run_inputs(read_config(path))


def run_inputs(data: dict[str, Any]) -> dict[str, Any]:
    """The plan's inputs a run config sets, keyed by ``Cluster``/``Workload`` field names.

    Only values the config sets are returned (``activation_offload`` always: the callback is there or not);
    ``optimizer`` is ``adamw``/``muon``, or the class path when it is neither.
    """
    trainer, found = data.get("trainer") or {}, {}
    for key, name in (("num_nodes", "nodes"), ("devices", "gpus_per_node")):
        if isinstance(trainer.get(key), int):
            found[name] = trainer[key]
    strategy = trainer.get("strategy")
    if _class_name(strategy) == "MoEFSDPStrategy":
        args = strategy.get("init_args") or {}
        for key in ("replicate_size", "shard_size", "expert_parallel_size", "cpu_offload", "prefetch_depth",
                    "async_checkpoint", "accumulate_unsharded_grads", "context_parallel_size", "ep_overlap_chunks",
                    "dispatch_dtype"):
            if key in args:
                found[key] = None if args[key] == "auto" else args[key]
    callbacks = trainer.get("callbacks") or []
    offload = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
               if _class_name(c) == "ActivationOffload"]
    found["activation_offload"] = bool(offload)
    for key, name in (("prefetch", "offload_prefetch"), ("mtp", "offload_mtp")):
        if offload and key in (offload[0].get("init_args") or {}):
            found[name] = offload[0]["init_args"][key]
    model = (data.get("model") or {}).get("init_args") or {}
    if "loss_chunk_size" in model:
        found["loss_chunk"] = model["loss_chunk_size"]
    if isinstance(model.get("optimizer"), dict):
        name = _class_name(model["optimizer"])
        found["optimizer"] = {"Muon": "muon", "AdamW": "adamw", "Adam": "adamw"}.get(
            name, model["optimizer"].get("class_path"))
    datamodule = (data.get("data") or {}).get("init_args") or {}
    for key, name in (("batch_size", "micro_batch"), ("seq_len", "seq_len")):
        if key in datamodule:
            found[name] = datamodule[key]
    return found
