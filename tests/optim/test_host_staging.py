"""Muon with host-resident matrices orthogonalized on another device: the staged, overlapped schedule.

On CPU the schedule runs its real code path with host buffers and stand-in streams that record which stream each
operation is issued on, each wait and each host synchronization; these tests pin its order (the host writes
matrix i+1 only after the Newton–Schulz of matrix i is enqueued), a stream per copy direction, one host wait per
step, buffer reuse across steps, that a CPU-only run does not stage at all, that row-sharded matrices cross the
bus in one copy each way per group, and that Muon's results are bitwise those of the unstaged path.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim import Muon, newton_schulz, param_groups
from moe_lightning.optim.flexshard import RowExchange, ShardGroup, local_rows
from moe_lightning.optim.host_staging import HostStagedNS, staging_bytes
from moe_lightning.optim.newton_schulz import coefficient_schedule

QUINTIC5 = coefficient_schedule("quintic", 5)


class RecordingStreams:
    """Stand-in for ``CudaStreams`` on the host: logs the stream each device tensor is allocated on, every event,
    wait and host wait."""

    pin = False

    def __init__(self, log: list):
        self.log, self.current, self.events = log, "compute", 0

    @contextmanager
    def on(self, name):
        self.current = name
        try:
            yield
        finally:
            self.current = "compute"

    def record(self):
        self.events += 1
        event = ("event", self.events, self.current)
        self.log.append(("record", event))
        return event

    def wait(self, event):
        self.log.append(("wait", self.current, event))

    def empty(self, shape, dtype):
        self.log.append(("empty", self.current))
        return torch.empty(shape, dtype=dtype)

    def synchronize(self, event):
        self.log.append(("host_wait", event))


def ns(G):
    return newton_schulz(G, QUINTIC5)


def staged_run(matrices, log, staging=None):
    staging = staging or HostStagedNS(torch.device("cpu"), streams=RecordingStreams(log), trace=log)
    results = {}
    staging.run([(G.shape, G.dtype) for G in matrices], lambda i, out: out.copy_(matrices[i]),
                [ns] * len(matrices), lambda i, O: results.setdefault(i, O.clone()))
    return staging, [results[i] for i in range(len(matrices))]


def test_the_host_fills_the_next_matrix_after_this_ones_newton_schulz_is_enqueued():
    torch.manual_seed(0)
    matrices = [torch.randn(8, 12), torch.randn(12, 8), torch.randn(8, 12), torch.randn(3, 6, 4)]
    log = []
    _, results = staged_run(matrices, log)
    trace = [e for e in log if e[0] in ("fill", "copy_in", "ns", "copy_out", "apply")]
    # each result is applied once the next matrix is on its way in, the last one at the end
    assert trace == [("fill", 0), ("copy_in", 0)] + [
        step for i in range(4) for step in [("ns", i), ("copy_out", i)] + (
            [("fill", i + 1), ("copy_in", i + 1)] if i < 3 else []) + ([("apply", i - 1)] if i else [])] + [
        ("apply", 3)]
    for G, O in zip(matrices, results):
        assert torch.equal(O, ns(G))


def test_each_copy_direction_has_its_own_stream_and_the_host_waits_only_to_reuse_or_apply():
    log = []
    staged_run([torch.randn(8, 12) for _ in range(3)], log)
    allocated, arrival, done = {}, {}, {}
    for k, entry in enumerate(log):
        if entry[0] == "allocate":  # on the compute stream, marked by an event recorded there
            assert log[k - 1] == ("empty", "compute")
            assert log[k + 1][0] == "record" and log[k + 1][1][2] == "compute"
            allocated[entry[1]] = log[k + 1][1]
        if entry[0] == "copy_in":  # the copy waited for the allocation's event, then its arrival was recorded
            assert log[k - 2] == ("wait", "to_device", allocated[entry[1]])
            assert log[k - 1][0] == "record" and log[k - 1][1][2] == "to_device"
            arrival[entry[1]] = log[k - 1][1]
        if entry[0] == "ns":  # the compute stream waited on that matrix's arrival, right before its NS
            assert log[k - 1] == ("wait", "compute", arrival[entry[1]])
            assert log[k + 1][0] == "record" and log[k + 1][1][2] == "compute"
            assert log[k + 2] == ("wait", "to_host", log[k + 1][1])  # copy back only after the NS
            assert log[k + 3][0] == "record" and log[k + 3][1][2] == "to_host"
            done[entry[1]] = log[k + 3][1]
        if entry[0] == "apply":  # the host read the result only after its own copy back
            assert log[k - 1] == ("host_wait", done[entry[1]])
        if entry[0] == "fill" and entry[1] >= 2:  # slot i % 2 again: its previous copy in must be done
            assert log[k - 1] == ("host_wait", arrival[entry[1] - 2])
    assert {e[1][2] for e in log if e[0] == "record"} == {"to_device", "compute", "to_host"}
    assert [e for e in log if e[0] == "host_wait"] == [
        ("host_wait", arrival[0]), ("host_wait", done[0]), ("host_wait", done[1]), ("host_wait", done[2])]
    assert sum(e[0] == "copy_in" for e in log) == sum(e[0] == "copy_out" for e in log) == 3


def test_device_copies_come_from_the_compute_streams_pool_and_the_next_is_allocated_before_this_ns():
    """A tensor a side stream allocates lives in that stream's pool, cached for it alone (the seed's side streams
    held 27.3 GiB with 6.4 GiB in use). Every device tensor is allocated while the compute stream is current;
    matrix i+1's destination before matrix i's Newton–Schulz is enqueued, so the event its copy in waits for
    does not cover that Newton–Schulz (the copy overlaps it)."""
    log = []
    staged_run([torch.randn(8, 12), torch.randn(12, 8), torch.randn(8, 12)], log)
    assert [e for e in log if e[0] == "empty"] == [("empty", "compute")] * 3
    steps = [e for e in log if e[0] in ("allocate", "ns", "copy_in")]
    assert steps == [("allocate", 0), ("copy_in", 0), ("allocate", 1), ("ns", 0), ("copy_in", 1),
                     ("allocate", 2), ("ns", 1), ("copy_in", 2), ("ns", 2)]
    assert not any(e[0] == "keep_for" for e in log)  # no record_stream: ordering is by events


def test_staging_pins_a_ring_of_two_buffers_per_shape_reused_across_steps():
    """One pinned in and out buffer per matrix, kept forever, was ~15 GiB per GPU at configs/1t.yaml: the ring
    holds two of each per distinct shape, however many matrices share it."""
    torch.manual_seed(0)
    shapes = [(8, 12)] * 5 + [(2, 6, 4)] * 3 + [(12, 8)]
    staging = HostStagedNS(torch.device("cpu"), streams=RecordingStreams([]))
    matrices = [torch.randn(s) for s in shapes]
    _, first = staged_run(matrices, [], staging)
    buffers = {k: b.data_ptr() for k, b in staging._buffers.items()}
    assert len(buffers) == 2 * 2 * 2 + 2 * 1  # (in, out) x 2 slots per shape seen twice or more, 1 slot otherwise
    held = sum(b.numel() * b.element_size() for b in staging._buffers.values())
    assert held == 2 * (8 * 12 + 2 * 6 * 4) * (4 + 2) + 12 * 8 * (4 + 2)  # fp32 in, bf16 (NS's dtype) out
    assert held == staging_bytes(shapes, 2, lambda n: n) - 12 * 8 * (4 + 2)  # priced: both slots of every shape
    for G, O in zip(matrices, first):
        assert torch.equal(O, ns(G))
    matrices = [torch.randn(s) for s in shapes]
    _, second = staged_run(matrices, [], staging)
    assert {k: b.data_ptr() for k, b in staging._buffers.items()} == buffers
    for G, O in zip(matrices, second):
        assert torch.equal(O, ns(G))


def test_staging_bytes_round_each_buffer_to_the_pinned_allocators_power_of_two():
    from moe_lightning.planner.activations import pinned_bytes
    # two fp32 inputs of 3·1000 elements (12,000 B -> 16,384) and two bf16 outputs (6,000 B -> 8,192)
    assert staging_bytes([(3, 1000), (3, 1000)], 2, pinned_bytes) == 2 * 16384 + 2 * 8192


def small_model(seed):
    torch.manual_seed(seed)
    model = MoETransformer(MoEConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                     num_experts=4, expert_hidden=8))
    for p in model.parameters():  # O(1) weights
        torch.nn.init.normal_(p, std=1.0)
    return model


@pytest.mark.parametrize("nesterov", [True, False])
def test_staged_muon_steps_are_bitwise_the_unstaged_ones_with_the_ring_of_buffers(nesterov):
    staged, plain = small_model(0), small_model(0)
    opt_staged = Muon(param_groups(staged, 0.1), lr=0.01, nesterov=nesterov)
    opt_plain = Muon(param_groups(plain, 0.1), lr=0.01, nesterov=nesterov)
    log = []
    opt_staged.stage_host_copies = True  # as on a GPU run with cpu_offload, with stand-in streams
    opt_staged._staging = HostStagedNS(torch.device("cpu"), streams=RecordingStreams(log), trace=log)
    matrices = sum(g["algorithm"] == "muon" and len(g["params"]) for g in opt_staged.param_groups)
    for step in range(3):
        torch.manual_seed(100 + step)
        for p, q in zip(staged.parameters(), plain.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        log.clear()
        opt_staged.step()
        opt_plain.step()
        assert sum(e[0] == "apply" for e in log) == matrices  # each applied after its own copy back
        assert sum(e[0] == "copy_in" for e in log) == sum(e[0] == "copy_out" for e in log) == matrices
    shapes = {(tuple(p.shape), p.dtype) for g in opt_staged.param_groups if g["algorithm"] == "muon"
              for p in g["params"]}
    assert len(opt_staged._staging._buffers) <= 4 * len(shapes) < 2 * matrices
    assert opt_plain._staging is None  # a CPU-only run orthogonalizes in place: no staging, no buffers
    for (name, p), q in zip(staged.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_cpu_only_muon_does_not_stage_and_equals_torch_muon():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 24), (24, 16), (16, 24)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn="original")
    opt_a, opt_b = Muon(ours, **kw, ns_dtype="bfloat16"), torch.optim.Muon(theirs, **kw)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a._staging is None
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_sharded_host_matrices_cross_the_bus_once_each_way_per_group(one_rank_group, dtype):
    """FSDP cpu_offload with NCCL: the row exchange used to copy each matrix in and back with a blocking pageable
    copy (a host sync per matrix). Staged, a group's K matrices take one copy each way and one host wait."""
    torch.manual_seed(0)
    shapes = [(8, 12), (12, 8), (6, 6), (8, 12), (5, 7)]
    shards = [torch.randn(s) for s in shapes]
    sg = ShardGroup(one_rank_group, 1, 0, [(k, None) for k in range(len(shapes))], shapes, [0] * len(shapes))
    results = {}
    for stage in (False, True):
        trace = []
        ex = RowExchange(sg, torch.device("cpu"), dtype, stage=stage, trace=trace)
        ex.start_gather(shards, [True, True, False, True, True])
        ex.start_scatter([newton_schulz(G, QUINTIC5, dtype=dtype) for G in ex.owned_matrices()])
        (results[stage],) = local_rows([ex])
        elements = sum(m * n for m, n in shapes) + len(shapes)
        assert trace == ([("to_device", elements), ("to_host", elements), ("synchronize", 0)] if stage else [])
    for (O, flag), (O_staged, flag_staged) in zip(results[False], results[True]):
        assert O.dtype == dtype and torch.equal(O, O_staged) and torch.equal(flag, flag_staged)
    assert results[True][2][0].abs().sum() == 0  # no rank had a gradient: a zero update, flagged 0


def test_every_groups_copy_back_is_issued_before_the_one_host_wait_of_the_step(one_rank_group):
    """Each group used to wait for its scatter, copy back and wait on the host before the next group's copy was
    issued: a host wait per group, the copies serialized. Now: every copy back, then one wait, then the reads."""
    torch.manual_seed(0)
    shapes = [[(8, 12), (6, 6)], [(12, 8)], [(5, 7), (8, 12), (4, 4)]]
    trace, exchanges, expected = [], [], []
    for group_shapes in shapes:
        shards = [torch.randn(s) for s in group_shapes]
        sg = ShardGroup(one_rank_group, 1, 0, [(k, None) for k in range(len(group_shapes))], group_shapes,
                        [0] * len(group_shapes))
        ex = RowExchange(sg, torch.device("cpu"), torch.float32, stage=True, trace=trace)
        ex.start_gather(shards, [True] * len(shards))
        results = [newton_schulz(G, QUINTIC5, dtype=torch.float32) for G in ex.owned_matrices()]
        ex.start_scatter(results)
        exchanges.append(ex)
        expected.append(results)
    rows = local_rows(exchanges)
    assert [op for op, _ in trace] == ["to_device"] * 3 + ["to_host"] * 3 + ["synchronize"]
    for got, want in zip(rows, expected):
        for (O, flag), W in zip(got, want):
            assert torch.equal(O, W) and flag == 1


def test_stage_host_copies_with_device_resident_parameters_is_refused_before_any_state_changes():
    """It used to fail inside the step (``torch.lerp(out=)`` a pinned host buffer from device tensors)."""
    torch.manual_seed(0)
    on_host = torch.nn.Parameter(torch.randn(8, 12))
    elsewhere = torch.nn.Parameter(torch.randn(8, 12, device="meta"))  # stands for a GPU-resident parameter
    opt = Muon([on_host, elsewhere], lr=0.01)
    opt.stage_host_copies = True
    on_host.grad, elsewhere.grad = torch.randn(8, 12), torch.randn(8, 12, device="meta")
    before = on_host.detach().clone()
    with pytest.raises(ValueError, match=r"stage_host_copies=True .*meta.*None"):
        opt.step()
    assert not opt.state and torch.equal(on_host, before)  # no momentum taken, nothing stepped
