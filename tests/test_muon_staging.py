"""Muon with host-resident matrices: the staged, overlapped Newton–Schulz schedule (``HostStagedNS``).

On CPU the schedule runs its real code path with host buffers and stand-in streams; these tests pin its order
(copy of matrix i+1 issued before the NS of matrix i, stream waits on the right events, one final wait), its
buffer reuse across steps, and that Muon's results are bitwise those of the serial path and of torch.optim.Muon.
"""

import torch

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim import Muon, newton_schulz, param_groups
from moe_lightning.optim.host_staging import HostStagedNS, _HostStreams
from moe_lightning.optim.newton_schulz import coefficient_schedule

QUINTIC5 = coefficient_schedule("quintic", 5)


class RecordingStreams(_HostStreams):
    """Host streams that log which stream each operation is issued on and the event each wait names."""

    def __init__(self, log: list):
        self.log, self.on_side, self.events = log, False, 0

    def side(self):
        streams = self

        class Side:
            def __enter__(self):
                streams.on_side = True

            def __exit__(self, *exc):
                streams.on_side = False

        return Side()

    def record(self):
        self.events += 1
        event = ("event", self.events, "side" if self.on_side else "compute")
        self.log.append(("record", event))
        return event

    def wait(self, event):
        self.log.append(("wait", "side" if self.on_side else "compute", event))

    def synchronize(self, event):
        self.log.append(("host_wait", event))


def ns(G):
    return newton_schulz(G, QUINTIC5)


def test_copy_of_the_next_matrix_is_issued_before_the_newton_schulz_of_this_one():
    torch.manual_seed(0)
    matrices = [torch.randn(8, 12), torch.randn(12, 8), torch.randn(8, 12), torch.randn(3, 6, 4)]
    trace = []
    HostStagedNS(torch.device("cpu"), trace=trace).run(matrices, [ns] * 4)
    assert trace == [("copy_in", 0), ("copy_in", 1), ("ns", 0), ("copy_out", 0), ("copy_in", 2), ("ns", 1),
                     ("copy_out", 1), ("copy_in", 3), ("ns", 2), ("copy_out", 2), ("ns", 3), ("copy_out", 3),
                     ("synchronize", 4)]


def test_streams_wait_on_the_copy_before_ns_and_on_ns_before_the_copy_back_and_the_host_waits_once():
    log, trace = [], []
    staging = HostStagedNS(torch.device("cpu"), trace=log)
    staging.streams = RecordingStreams(log)
    matrices = [torch.randn(8, 12) for _ in range(3)]
    staging.run(matrices, [ns] * 3)
    copied_in, ns_done = {}, {}
    last_event = None
    for k, entry in enumerate(log):
        if entry[0] == "copy_in":  # the event recorded just before, on the side stream, marks its arrival
            assert log[k - 1][0] == "record" and log[k - 1][1][2] == "side"
            copied_in[entry[1]] = log[k - 1][1]
        if entry[0] == "ns":  # the compute stream waited on that matrix's arrival, right before its NS
            assert log[k - 1] == ("wait", "compute", copied_in[entry[1]])
            assert log[k + 1][0] == "record" and log[k + 1][1][2] == "compute"
            ns_done[entry[1]] = log[k + 1][1]
            assert log[k + 2] == ("wait", "side", ns_done[entry[1]])  # copy back only after the NS
        if entry[0] == "record":
            last_event = entry[1]
    host_waits = [e for e in log if e[0] == "host_wait"]
    assert host_waits == [("host_wait", last_event)] and last_event[2] == "side"
    assert log[-2] == host_waits[0]  # after every copy back is queued


def test_staging_buffers_are_reused_across_steps_and_never_shared_within_one():
    torch.manual_seed(0)
    staging = HostStagedNS(torch.device("cpu"))
    shapes = [(8, 12), (8, 12), (2, 6, 4)]
    first = staging.run([torch.randn(s) for s in shapes], [ns] * 3)
    pointers = [O.data_ptr() for O in first]
    buffers = {k: b.data_ptr() for k, b in staging._buffers.items()}
    assert len(set(pointers)) == 3  # two same-shape matrices in flight get two buffers
    assert len(buffers) == 6  # one in, one out per matrix
    matrices = [torch.randn(s) for s in shapes]
    second = staging.run(matrices, [ns] * 3)
    assert [O.data_ptr() for O in second] == pointers
    assert {k: b.data_ptr() for k, b in staging._buffers.items()} == buffers
    for G, O in zip(matrices, second):
        assert torch.equal(O, ns(G))


def small_model(seed):
    torch.manual_seed(seed)
    model = MoETransformer(MoEConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                     num_experts=4, expert_hidden=8))
    for p in model.parameters():  # O(1) weights
        torch.nn.init.normal_(p, std=1.0)
    return model


def test_muon_steps_are_bitwise_those_of_the_serial_path():
    staged, serial = small_model(0), small_model(0)
    opt_staged = Muon(param_groups(staged, 0.1), lr=0.01)
    opt_serial = Muon(param_groups(serial, 0.1), lr=0.01)
    opt_serial.stage_host_copies = False
    for step in range(3):
        torch.manual_seed(100 + step)
        for p, q in zip(staged.parameters(), serial.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_staged.step()
        opt_serial.step()
    assert opt_staged._staging is not None and opt_staged._staging._buffers  # the staged path ran
    assert opt_serial._staging is None
    for (name, p), q in zip(staged.named_parameters(), serial.parameters()):
        assert torch.equal(p, q), name


def test_staged_muon_equals_torch_muon_on_matrices():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 24), (24, 16), (16, 24)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn="original")
    opt_a, opt_b = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a._staging is not None
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
