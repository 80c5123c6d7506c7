"""The FSDP units of ``MoETransformer``: which modules ``fully_shard`` wraps, in which order, and what each owns.

``parallel/fsdp.py`` shards exactly these and ``moe-lightning plan`` prices memory from them, so the two cannot
describe different units. Module bookkeeping only (no process group): it runs on a meta-device model.

Wrapping order, inner units first (FSDP2 leaves a nested unit's parameters to that unit):

    tok_embeddings                        untied only; a tied embedding/head weight stays in the root
    layers.i.ffn.experts, layers.i        per block; the experts are a unit only under expert parallelism
    mtp.k.block.ffn.experts, mtp.k.block, mtp.k
    output                                untied only; kept gathered after forward (its backward comes next)
    (root)                                the final norm, a tied embedding/head, and anything else left
"""

import itertools
from dataclasses import dataclass

from torch import nn

from moe_lightning.model import MoETransformer


@dataclass(frozen=True, eq=False)
class Unit:
    """One ``fully_shard`` call on ``module`` (``name``: its path in the model, ``""`` for the root).

    ``params``: the parameters it owns, by name in the model: its module's minus those of the units inside it
    (a weight shared by two modules is listed once). ``stage``: units that run together (a block with its
    experts, an MTP module with its block), numbered in forward order; ``None`` for the root. ``experts``: an
    expert stack, sharded on the expert-FSDP mesh. ``keep_gathered``: never resharded after forward."""

    name: str
    module: nn.Module
    stage: int | None
    experts: bool
    keep_gathered: bool
    params: dict[str, nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())


def fsdp_units(model: MoETransformer, expert_parallel: bool) -> list[Unit]:
    """Every FSDP unit of ``model`` in wrapping order (inner before outer, stages in forward order, root last).

    ``expert_parallel``: each MoE block's routed experts are a unit of their own (on the expert-FSDP mesh)."""
    tied = model.config.tie_embeddings
    stages = itertools.count()
    planned: list[tuple[str, nn.Module, int | None, bool, bool]] = []  # name, module, stage, experts, keep

    def block(name: str, module: nn.Module, stage: int) -> None:
        if expert_parallel and module.is_moe:
            planned.append((f"{name}.ffn.experts", module.ffn.experts, stage, True, False))
        planned.append((name, module, stage, False, False))

    if not tied and model.tok_embeddings is not None:  # a pipeline stage may hold no embedding, head or blocks' all
        planned.append(("tok_embeddings", model.tok_embeddings, next(stages), False, False))
    for i, layer in model.layers.named_children():  # the model's block indices (a pipeline stage keeps them)
        block(f"layers.{i}", layer, next(stages))
    for k, module in enumerate(model.mtp):  # runs after the final norm: its norms and eh_proj enter the stage first
        stage = next(stages)
        block(f"mtp.{k}.block", module.block, stage)
        planned.append((f"mtp.{k}", module, stage, False, False))
    if not tied and model.output is not None:
        planned.append(("output", model.output, next(stages), False, True))
    planned.append(("", model, None, False, True))

    owned: set[int] = set()
    units = []
    for name, module, stage, experts, keep in planned:
        prefix = f"{name}." if name else ""
        params = {full: p for full, p in model.named_parameters()
                  if full.startswith(prefix) and id(p) not in owned}
        owned.update(map(id, params.values()))
        units.append(Unit(name, module, stage, experts, keep, params))
    return units
