"""Per-block ``torch.compile``, in place: each block's class is swapped for a subclass whose ``forward`` is compiled."""

from functools import cache

import torch

from moe_lightning.model import LocalTokenDispatcher


def compile_blocks(layers: torch.nn.ModuleList, backend: str = "inductor") -> None:
    """``torch.compile`` each block's ``forward`` in place (per block: the graphs are small and shared).

    Only ``forward`` is compiled (through a subclass, as FSDP2 itself swaps the class), never the module's
    ``__call__``: FSDP2's hooks stay eager around the compiled graph, so the order against sharding does not
    matter, and parameter names are unchanged. ActivationOffload's checkpoint wrapper is an instance ``forward``
    bound to the class's ``forward`` when applied, so compile must come first (``parallelize_moe`` does); the other
    order is refused. Compilation happens at the first call, after sharding. Blocks with local MoE dispatch compile
    with ``fullgraph=True``; the all-to-all dispatch of expert parallelism needs its split sizes on the host and
    runs eagerly between two graphs.
    """
    for index, block in enumerate(layers):
        if "forward" in block.__dict__:
            raise RuntimeError(f"compile_blocks: model.layers[{index}] already has an instance-level forward (e.g. "
                               "ActivationOffload applied), which would keep calling the eager forward; compile "
                               "the blocks before applying ActivationOffload.")
    for block in layers:
        block.__class__ = _compiled_class(type(block), backend)


@cache
def _compiled_class(cls: type, backend: str) -> type:
    whole = torch.compile(cls.forward, fullgraph=True, backend=backend)
    split = torch.compile(cls.forward, backend=backend)

    def forward(self, *args, **kwargs):
        dispatcher = getattr(self.ffn, "dispatcher", None)
        local = dispatcher is None or isinstance(dispatcher, LocalTokenDispatcher)
        return (whole if local else split)(self, *args, **kwargs)

    return type(f"Compiled{cls.__name__}", (cls,), {"forward": forward, "__doc__": cls.__doc__})
