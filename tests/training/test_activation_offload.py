"""ActivationOffload: bit-identical numerics, device copies released, copy-back order follows the look-ahead."""

import json
import weakref

import pytest
import torch
import torch.nn.functional as F

from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.model import MoEConfig, MoETransformer
from tests.support.distributed import LAUNCHERS, run_ranks

CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.01,
                   z_loss_coef=0.001)


def train_step(offload: ActivationOffload | None):
    """One fp32 forward/backward; returns loss, grads and, per block, whether its input is still alive after forward."""
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    if offload is not None:
        offload.apply(model.layers)
    inputs = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    tokens_BS = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits_BSV = model(tokens_BS[:, :-1])
    loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten())
    alive_after_forward = [ref() is not None for ref in inputs]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, alive_after_forward


@pytest.fixture(scope="module")
def reference():
    return train_step(None)


@pytest.mark.parametrize("prefetch, blocks, expected_backward", [
    (0, [0, 1, 2, 3], ["copy_in 3", "use 3", "copy_in 2", "use 2", "copy_in 1", "use 1", "copy_in 0", "use 0"]),
    (1, None, ["copy_in 2", "use 3", "copy_in 1", "use 2", "copy_in 0", "use 1", "use 0"]),
    (2, [-4, -3, -2, -1], ["copy_in 3", "copy_in 2", "copy_in 1", "use 3", "copy_in 0", "use 2", "use 1", "use 0"]),
])
def test_offload_is_bit_identical_and_prefetches_in_order(reference, prefetch, blocks, expected_backward):
    offload = ActivationOffload(prefetch=prefetch, min_offload_bytes=0, blocks=blocks)
    loss, grads, alive = train_step(offload)
    ref_loss, ref_grads, ref_alive = reference
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    offloaded = [True, True, True, blocks is not None]
    assert ref_alive == [True] * 4  # without offload autograd keeps every block input on the device
    assert alive == [not o for o in offloaded]
    order = [f"{kind} {index}" for kind, index in offload.order]
    assert order[:4] == [f"{'offload' if o else 'keep'} {i}" for i, o in enumerate(offloaded)]
    assert order[4:] == expected_backward
    assert offload.tensors_offloaded == sum(offloaded)
    assert offload.bytes_offloaded == sum(offloaded) * 2 * 16 * 32 * 4


def test_small_inputs_stay_on_device(reference):
    offload = ActivationOffload(min_offload_bytes=2 * 16 * 32 * 4 + 1, blocks=[0, 1, 2, 3])
    loss, _, alive = train_step(offload)
    assert torch.equal(loss, reference[0])
    assert alive == [True] * 4 and offload.tensors_offloaded == 0 and offload.tensors_copied_in == 0
    assert [kind for kind, _ in offload.order] == ["keep"] * 4 + ["use"] * 4


def test_state_changed_between_forward_and_backward_is_an_error():
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    ActivationOffload(min_offload_bytes=0).apply(model.layers)
    tokens_BS = torch.randint(0, CONFIG.vocab_size, (2, 17))
    loss = F.cross_entropy(model(tokens_BS[:, :-1]).flatten(0, 1), tokens_BS[:, 1:].flatten())
    router = model.layers[2].ffn.router
    router.update_bias(torch.arange(CONFIG.num_experts), rate=0.1)
    with pytest.raises(RuntimeError, match=r"model.layers\[2\].ffn.router.expert_bias changed"):
        loss.backward()


class ScaledBlock(torch.nn.Module):
    """A block with a second tensor argument: checkpoint saves it too, but only the first is the boundary."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return x + torch.tanh(self.linear(x)) * scale


def test_only_the_first_tensor_argument_is_offloaded():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(ScaledBlock() for _ in range(3))
    x, scale = torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    offload = ActivationOffload(min_offload_bytes=0, blocks=[0, 1, 2])

    def loss():
        h = x
        for layer in layers:
            h = layer(h, scale)
        return h.square().sum()

    loss().backward()
    reference = [t.grad.clone() for t in (x, scale)]
    x.grad = scale.grad = None
    offload.apply(layers)
    loss().backward()
    assert torch.equal(x.grad, reference[0]) and torch.equal(scale.grad, reference[1])
    assert [f"{k} {i}" for k, i in offload.order] == [
        "offload 0", "offload 1", "offload 2", "copy_in 2", "copy_in 1", "use 2", "copy_in 0", "use 1", "use 0"]
    assert offload.bytes_offloaded == 3 * 4 * 8 * 4


def test_remove_restores_plain_forward():
    model = MoETransformer(CONFIG)
    offload = ActivationOffload(min_offload_bytes=0)
    offload.apply(model.layers)
    assert list(model.state_dict()) == list(MoETransformer(CONFIG).state_dict())  # names untouched while applied
    with pytest.raises(RuntimeError, match="already applied"):
        offload.apply(model.layers)
    offload.remove()
    assert all("forward" not in block.__dict__ for block in model.layers)
    assert list(model.state_dict()) == list(MoETransformer(CONFIG).state_dict())


@pytest.mark.parametrize("kwargs, match", [({"prefetch": -1}, "prefetch=-1"),
                                           ({"min_offload_bytes": -5}, "min_offload_bytes=-5"),
                                           ({"blocks": [7]}, "blocks=\\[7\\]")])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationOffload(**kwargs).apply(MoETransformer(CONFIG).layers)


def test_offload_under_fsdp2_two_processes():
    """MoEFSDPStrategy with expert parallelism (nested FSDP units, all-to-all dispatch recomputed in backward)."""
    script = LAUNCHERS / "offload_fsdp.py"
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_ranks(script, 2, "2")]
    for result in results:
        assert result["steps"] == 2 and result["losses_equal"] and result["params_equal"]
        assert result["tensors_out"] == 3
        assert [f"{k} {i}" for k, i in result["order"]] == [
            "offload 0", "offload 1", "offload 2", "copy_in 2", "copy_in 1", "use 2", "copy_in 0", "use 1", "use 0"]
    # each rank saw different tokens; torchmetrics summed the counts over both before computing
    assert results[0]["expert_load"] and results[0]["expert_load"] == results[1]["expert_load"]


MTP = MoEConfig(**{**CONFIG.__dict__, "mtp_layers": 2, "n_layers": 3})


def mtp_step(offload: ActivationOffload | None):
    """One fp32 multi-token-prediction step. Returns loss, grads, the bytes autograd kept from inside the MTP blocks'
    forward (a saved-tensor hook outside the blocks: a checkpointed block's tensors never reach it), and how often
    MTP block 0's attention ran during backward (recomputation)."""
    from moe_lightning.training.callbacks.activation_offload import find_mtp_blocks

    torch.manual_seed(0)
    model = MoETransformer(MTP)
    with torch.no_grad():  # O(1) activations, not the 0.02 init
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
    if offload is not None:
        offload.apply(model.layers, find_mtp_blocks(model) if offload.mtp else ())
    inside, kept, calls, phase = [False], [0], {"backward": 0}, ["forward"]
    for module in model.mtp:
        module.block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        module.block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    model.mtp[0].block.attention.register_forward_hook(
        lambda *_: calls.__setitem__("backward", calls["backward"] + (phase[0] == "backward")))

    def pack(t):
        if inside[0] and phase[0] == "forward":
            kept[0] += t.numel() * t.element_size()
        return t

    tokens_BS = torch.randint(0, MTP.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(tokens_BS[:, :-1], mtp=True)
    loss = sum(F.cross_entropy(model.output(h).flatten(0, 1), tokens_BS[:, 1 + k:].flatten())
               for k, h in enumerate(hidden))
    phase[0] = "backward"  # forward calls from here on are recomputations
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept[0], calls["backward"]


def test_mtp_blocks_are_recomputed_with_the_same_numerics():
    ref_loss, ref_grads, ref_kept, ref_recomputed = mtp_step(None)
    off = ActivationOffload(min_offload_bytes=0, mtp=False)
    on = ActivationOffload(min_offload_bytes=0)
    assert on.mtp and not off.mtp
    for offload, kept_inside, recomputed in ((off, ref_kept, 0), (on, 0, 1)):
        loss, grads, kept, recomputations = mtp_step(offload)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[name], ref_grads[name]) for name in ref_grads)
        assert kept == kept_inside and recomputations == recomputed
    assert ref_kept > 0 and ref_recomputed == 0
    # MTP blocks 3 and 4 are checkpointed, their inputs kept; the main blocks offload as before
    assert [f"{kind} {i}" for kind, i in on.order[:5]] == ["offload 0", "offload 1", "keep 2", "keep 3", "keep 4"]
    on.remove()


def test_a_boundary_dropped_with_its_copy_pending_makes_the_compute_stream_wait_before_its_memory_is_freed():
    """A prefetched input that backward never unpacks (it stopped early) used to be freed at once: its memory went
    back to the compute stream's pool while the side stream was still copying into it. Stand-in stream and event
    (CPU): the wait is enqueued before the tensor is released, and only while a copy is pending."""
    from moe_lightning.training.callbacks.activation_offload import _Boundary

    log = []

    class Stream:
        def wait_event(self, event):
            log.append(("wait", event, alive() is not None))

    tensor = torch.randn(4)
    alive = weakref.ref(tensor)
    boundary = _Boundary(0, tensor, True, weakref.WeakValueDictionary(), [])
    boundary.copy_done, boundary.compute_stream = "copy event", Stream()
    del tensor
    del boundary
    assert log == [("wait", "copy event", True)]  # enqueued while the tensor was still alive
    assert alive() is None  # freed right after the wait
    done = _Boundary(1, torch.randn(4), True, weakref.WeakValueDictionary(), [])
    done.compute_stream = Stream()
    done.copy_done = None  # unpacked: _release_source waited already
    del done
    kept = _Boundary(2, torch.randn(4), True, weakref.WeakValueDictionary(), [])
    kept.copy_done, kept.compute_stream, kept.device_tensor = "event", Stream(), None  # released: nothing to free
    del kept
    assert len(log) == 1
