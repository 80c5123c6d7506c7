"""Block-boundary activation offload: checkpoint each block, park its input in host memory, prefetch it back.

Each block of ``model.layers`` runs under non-reentrant ``torch.utils.checkpoint``, so the only tensor
autograd keeps for it is its input (the boundary activation). A ``saved_tensors_hooks`` pair around the
checkpoint intercepts exactly that tensor: the pack hook copies it to (pinned) host memory on a side
stream while the block computes, and the device copy is released when the block's forward returns.
In backward, unpacking block *i*'s input also starts the host-to-device copies of the next ``prefetch``
offloaded inputs below *i*, so they travel while block *i* is recomputed and backpropagated.

Stream discipline (no ``record_stream``): device destinations are allocated on the compute stream; the
side stream waits on an event recorded there before writing, and the compute stream waits on the copy's
event before it reads the data or frees the source. Without CUDA the same code runs with host-to-host
copies and no streams, so numerics and ordering are testable on any machine.

Multi-token prediction blocks (``model.mtp[k].block``) are checkpointed too (``mtp=True``): uncheckpointed, one
keeps a whole block's working set from forward to backward (≈32 GiB per GPU at 1t.yaml, ``moe-lightning plan``).
Their inputs stay on the device: backward reaches them first, so a copy out and back would free nothing.

The blocks are not replaced: the wrapper is an instance-level ``forward``, so parameter names, state
dicts and FSDP2's module hooks (unshard before forward, reshard after) are untouched.
"""

import weakref
from collections.abc import Sequence
from typing import Optional

import lightning as L
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_lightning.training.lightning_internals import logs_written


class _Boundary:
    """One block's input for one forward: kept on device, or offloaded with a host copy."""

    __slots__ = ("index", "offloaded", "device", "device_tensor", "host_tensor", "copy_done", "compute_stream",
                 "generation", "buffer_versions", "__weakref__")

    def __init__(self, index: int, tensor: torch.Tensor, offloaded: bool, generation: "weakref.WeakValueDictionary",
                 buffer_versions: list[tuple[str, torch.Tensor, int]]):
        self.index, self.offloaded, self.device, self.generation = index, offloaded, tensor.device, generation
        self.device_tensor: Optional[torch.Tensor] = tensor
        self.host_tensor: Optional[torch.Tensor] = None
        self.copy_done: Optional[torch.cuda.Event] = None  # the side stream's copy (out or in) still pending
        self.compute_stream: Optional[torch.cuda.Stream] = None  # the stream the device tensor's memory belongs to
        self.buffer_versions = buffer_versions

    def __del__(self):
        """A boundary dropped with its copy pending (prefetched, then never unpacked: a backward that stopped
        early): the compute stream waits for the copy before the device tensor's memory returns to its pool, or
        the next allocation there could be overwritten by the copy still in flight."""
        if self.copy_done is not None and self.device_tensor is not None:
            self.compute_stream.wait_event(self.copy_done)


class ActivationOffload(L.Callback):
    """Checkpoint every block and keep the offloaded blocks' inputs in host memory between forward and backward.

    Applied by ``MoEFSDPStrategy`` inside ``parallelize_moe`` (after compile, before sharding: see that function for
    the order), or at ``on_fit_start`` on any other strategy or a model sharded by an earlier fit (FSDP2 composes:
    its hooks still run around each block); removed at ``on_fit_end``.

    Args:
        prefetch: How many offloaded inputs ahead to copy back during backward (0: copy on demand).
        min_offload_bytes: Inputs smaller than this stay on device (the copy is not worth its launch).
        blocks: The model's block indices whose inputs are offloaded (negative indices count from the end);
            all blocks are checkpointed either way. ``None``: every block except the model's last, whose input
            backward needs first, so offloading it would only add two copies. Under pipeline stages the indices
            are still the whole model's (a stage offloads those it holds), so every stage but the last offloads
            all its blocks: its micro-batches wait in flight for their backward (1F1B holds ``P - r`` on stage
            ``r``). The look-ahead copy-in follows block order within one forward's generation; with several
            stages per rank a generation can mix two stages' micro-batches, so it may fetch the wrong one (a copy
            on demand then; counted the same).
        mtp: Also checkpoint the multi-token prediction blocks (their inputs stay on the device). Off: they keep
            their whole working set for backward (``moe-lightning plan --no-offload-mtp`` prices it).
    """

    def __init__(self, prefetch: int = 1, min_offload_bytes: int = 1 << 20, blocks: Optional[list[int]] = None,
                 mtp: bool = True):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"ActivationOffload(prefetch={prefetch!r}): must be an integer >= 0 "
                             "(0 copies each input back when backward needs it, 1 is the default look-ahead).")
        if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"ActivationOffload(min_offload_bytes={min_offload_bytes!r}): must be an integer "
                             ">= 0 (0 offloads every block input).")
        if blocks is not None and (not isinstance(blocks, (list, tuple))
                                   or not all(isinstance(i, int) and not isinstance(i, bool) for i in blocks)):
            raise ValueError(f"ActivationOffload(blocks={blocks!r}): must be a list of block indices (integers, "
                             "e.g. [0, 1]) or null for every block but the model's last.")
        if not isinstance(mtp, bool):
            raise ValueError(f"ActivationOffload(mtp={mtp!r}): must be true (checkpoint the multi-token prediction "
                             "blocks too) or false.")
        self.prefetch, self.min_offload_bytes, self.blocks, self.mtp = prefetch, min_offload_bytes, blocks, mtp
        # ("offload"|"keep"|"copy_in"|"use", block) of the last step; MTP block k is len(model.layers) + k
        self.order: list[tuple[str, int]] = []
        self.reset_counters()
        self._layers: Optional[list[nn.Module]] = None  # model.layers, then the MTP blocks
        self._names: list[str] = []  # each wrapped block's name in the whole model, for messages
        self._offload_indices: set[int] = set()
        self._generation: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._packed: set[int] = set()
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    # ---- Lightning hooks -------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._layers is None:  # not applied by the strategy (parallelize_moe)
            self.wrap(pl_module)

    def wrap(self, model: nn.Module) -> None:
        """``apply`` to the blocks of ``model`` (a LightningModule or the transformer itself)."""
        layers = find_blocks(model)
        owner = next(m for m in model.modules() if getattr(m, "layers", None) is layers)
        self.apply(layers, find_mtp_blocks(model) if self.mtp else (),
                   n_layers=getattr(getattr(owner, "config", None), "n_layers", None))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remove()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.reset_counters()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if logs_written(trainer):  # Python numbers: each logged one is a blocking host-to-device copy
            pl_module.log_dict({"offload/bytes": float(self.bytes_offloaded),
                                "offload/tensors_out": float(self.tensors_offloaded),
                                "offload/tensors_in": float(self.tensors_copied_in)})

    def reset_counters(self) -> None:
        self.bytes_offloaded = self.tensors_offloaded = self.tensors_copied_in = 0

    # ---- wrapping --------------------------------------------------------------------------------
    def apply(self, layers: nn.ModuleList, mtp_blocks: Sequence[nn.Module] = (), n_layers: int | None = None) -> None:
        """Wrap each block's ``forward`` in place (the module objects, and any FSDP state, stay as they are);
        ``mtp_blocks`` are checkpointed, their inputs kept. ``n_layers``: the whole model's blocks, when ``layers``
        holds a pipeline stage's only, keyed by their indices in the model (``blocks`` names those); default
        ``len(layers)``."""
        if self._layers is not None:
            raise RuntimeError("ActivationOffload is already applied; call remove() first.")
        whole = n_layers or len(layers)
        for i in self.blocks or []:
            if not -whole <= i < whole:
                raise ValueError(f"ActivationOffload(blocks={self.blocks!r}): index {i} is outside the model's "
                                 f"n_layers={whole} blocks; use indices in [-{whole}, {whole - 1}].")
        position = {int(key): p for p, key in enumerate(layers._modules)}  # a block's model index -> its place here
        blocks = [*layers, *mtp_blocks]
        self._names = [f"model.layers[{key}]" for key in layers._modules] + \
            [f"model.mtp[{k}].block" for k in range(len(mtp_blocks))]
        for index, block in enumerate(blocks):
            if "forward" in block.__dict__:
                raise RuntimeError(f"{self._names[index]} already has an instance-level forward (another wrapper); "
                                   "ActivationOffload must own the block's forward.")
        offloaded = [i for i in position if i != whole - 1] if self.blocks is None else [i % whole for i in self.blocks]
        self._offload_indices = {position[i] for i in offloaded if i in position}
        self._layers = blocks
        for index, block in enumerate(blocks):
            block.forward = self._wrap(index, block.forward)

    def remove(self) -> None:
        if self._layers is not None:
            for block in self._layers:
                del block.forward
            self._layers = None

    def _wrap(self, index: int, forward):
        def offloaded_forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            boundary_input = weakref.ref(first) if first is not None else lambda: None
            del first

            def pack(tensor: torch.Tensor):
                # Checkpoint may save more than the input here (older torch also saves an empty marker).
                # Weak reference: autograd keeps this hook alive with the saved tensor.
                return self._pack(index, tensor) if tensor is boundary_input() else tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
            boundary = self._generation.get(index)
            if boundary is not None and boundary.offloaded:
                self._release_source(boundary)
            return out
        return offloaded_forward

    # ---- saved-tensor hooks ----------------------------------------------------------------------
    def _pack(self, index: int, tensor: torch.Tensor) -> _Boundary:
        """Called once per block forward, with the block's (first tensor) input."""
        if index in self._packed:  # a new forward began: start a new generation of boundaries
            self._generation, self._packed = weakref.WeakValueDictionary(), set()
            self.order.clear()
        self._packed.add(index)
        nbytes = tensor.numel() * tensor.element_size()
        offloaded = index in self._offload_indices and nbytes >= self.min_offload_bytes
        versions = [(name, buf, buf._version) for name, buf in self._layers[index].named_buffers()]
        boundary = _Boundary(index, tensor, offloaded, self._generation, versions)
        self._generation[index] = boundary
        self.order.append(("offload" if offloaded else "keep", index))
        if offloaded:
            self._copy_out(boundary)
            self.bytes_offloaded += nbytes
            self.tensors_offloaded += 1
        return boundary

    def _unpack(self, boundary: _Boundary | torch.Tensor) -> torch.Tensor:
        if isinstance(boundary, torch.Tensor):
            return boundary
        for name, buffer, version in boundary.buffer_versions:
            if buffer._version != version:
                raise RuntimeError(
                    f"ActivationOffload: {self._names[boundary.index]}.{name} changed between this block's forward "
                    "and backward, so recomputing the block would not reproduce its forward (for a router bias: "
                    "different experts, wrong gradients). Update such state after backward, e.g. in "
                    "on_before_optimizer_step rather than on_before_zero_grad (Lightning zeroes gradients after "
                    "training_step, before backward).")
        for needed in [boundary, *self._next_offloaded(boundary)]:  # this input, then the look-ahead
            if needed.offloaded and needed.device_tensor is None:
                self._copy_in(needed)
        tensor = boundary.device_tensor
        if boundary.offloaded:
            self._release_source(boundary)  # waits for the copy in, then drops our reference
        self.order.append(("use", boundary.index))
        return tensor

    def _next_offloaded(self, boundary: _Boundary) -> list[_Boundary]:
        below = sorted((i for i in boundary.generation.keys() if i < boundary.index), reverse=True)
        ahead = (boundary.generation.get(i) for i in below)
        return [b for b in ahead if b is not None and b.offloaded][:self.prefetch]

    # ---- copies ----------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        if device.type != "cuda":
            return None
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def _copy_out(self, boundary: _Boundary) -> None:
        """Start device→host; the source stays referenced until ``_release_source`` orders its free."""
        source = boundary.device_tensor
        host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.device.type == "cuda")
        self._copy(boundary, source, host)
        boundary.host_tensor = host

    def _copy(self, boundary: _Boundary, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy on the side stream after the compute stream's pending work; ``copy_done`` marks the end."""
        side = self._side_stream(boundary.device)
        with torch.no_grad():
            if side is None:
                destination.copy_(source)
                return
            boundary.compute_stream = torch.cuda.current_stream(boundary.device)
            side.wait_stream(boundary.compute_stream)
            with torch.cuda.stream(side):
                destination.copy_(source, non_blocking=True)
                boundary.copy_done = side.record_event()

    def _release_source(self, boundary: _Boundary) -> None:
        """Order the compute stream after the boundary's pending copy (out or in), then drop our device reference."""
        if boundary.copy_done is not None:
            torch.cuda.current_stream(boundary.device).wait_event(boundary.copy_done)
            boundary.copy_done = None
        boundary.device_tensor = None

    def _copy_in(self, boundary: _Boundary) -> None:
        """Start host→device into memory allocated on the compute stream."""
        destination = torch.empty(boundary.host_tensor.shape, dtype=boundary.host_tensor.dtype, device=boundary.device)
        self._copy(boundary, boundary.host_tensor, destination)
        boundary.device_tensor = destination
        self.tensors_copied_in += 1
        self.order.append(("copy_in", boundary.index))


def find_mtp_blocks(pl_module: nn.Module) -> list[nn.Module]:
    """The multi-token prediction blocks: ``block`` of each module in the first ``mtp`` ``nn.ModuleList``."""
    for module in pl_module.modules():
        mtp = getattr(module, "mtp", None)
        if isinstance(mtp, nn.ModuleList):
            return [depth.block for depth in mtp]
    return []


def find_blocks(pl_module: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the first ``layers`` attribute that is an ``nn.ModuleList``."""
    for module in pl_module.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(pl_module).__name__} has no submodule with a `layers` nn.ModuleList: the callbacks "
                     "find the model's repeated blocks there (MoETransformer.layers).")
