"""Does every GPU path of the package compute what its CPU reference computes? Checked first, in seconds, no Lightning.

    python benchmarks/gpu_paths.py             # one CUDA device, well inside 40 s (cold compiles included)
    python benchmarks/gpu_paths.py --dry-run   # the same checks on CPU (eager FlexAttention, gloo), tiny shapes

One line per check, as it ends: ``paths: PASS <check> (<seconds> s) <what was compared>`` or ``paths: FAIL <check>
(<seconds> s): <error>``; a failing check never stops the next. The cheap checks run first, the compiled
FlexAttention ones last (a time-out there loses nothing before it):
- ``grouped_mm``: ``GroupedExperts`` through ``torch._grouped_mm`` against its per-expert loop, forward and every
  gradient, with skewed expert counts and empty experts;
- ``offload``: ``ActivationOffload`` on a 3-block model against the plain model's gradients (real copy streams);
- ``host_ns``: ``HostStagedNS`` (pinned ring, copy streams, events) against Newton–Schulz of each matrix moved over
  one at a time, bitwise;
- ``all_to_all``: ``all_to_all_single`` on a one-rank NCCL group bound to the device by its index (gloo in the
  dry run);
- ``flex_S`` / ``flex_S-1``: the compiled FlexAttention kernel at the recipe's MLA head dims, document-masked, at
  S tokens, and at S - 1 tokens through the S-token mask (multi-token prediction's first depth: zero-padded to S,
  one kernel shape), forward and backward against SDPA with the dense mask of those tokens, and its
  ``AuxRequest(max_scores)`` maxima (the padded rows dropped) against ``exact_max_logits``; each line says how
  many graphs it compiled (S - 1 after S: 0 expected, the padded call reuses the kernel). A
  ratio near 1/ln 2 = 1.443 is torch 2.11's rescaling of ``max_scores``, named as such.
Exit status 1 when any check failed. A figure line (checks passed so far) follows ``all_to_all`` and the last
check; gpu_all.sh's table takes the last one printed.
"""

import argparse
import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_shapes import recipe_config  # noqa: E402
from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.model.attention import DocumentMask, attend, dense_mask, document_ids, exact_max_logits  # noqa: E402
from moe_lightning.model.grouped_mm import use_grouped_mm  # noqa: E402
from moe_lightning.model.moe import GroupedExperts  # noqa: E402
from moe_lightning.optim import newton_schulz  # noqa: E402
from moe_lightning.optim.host_staging import HostStagedNS  # noqa: E402
from moe_lightning.optim.newton_schulz import coefficient_schedule  # noqa: E402
from moe_lightning.training.callbacks import ActivationOffload  # noqa: E402

QUINTIC5 = coefficient_schedule("quintic", 5)


def relative_diff(got: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude, in fp32."""
    return ((got.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30)).item()


def check_grouped_mm(device: torch.device, dtype: torch.dtype, tolerance: float) -> str:
    torch.manual_seed(0)
    D, F_ = (512, 256) if device.type == "cuda" else (32, 16)
    counts_E = torch.tensor([0, 300, 5, 0, 1, 1000, 17, 0]) // (1 if device.type == "cuda" else 10)
    experts = GroupedExperts(len(counts_E), D, F_).to(device)
    with torch.no_grad():
        for w in experts.parameters():
            w.normal_(0, D ** -0.5)  # O(1) outputs
    x_TD = torch.randn(int(counts_E.sum()), D, device=device, dtype=dtype, requires_grad=True)
    scale_T1 = torch.rand(x_TD.shape[0], 1, device=device, dtype=dtype)
    counts_E = counts_E.to(device)
    if not use_grouped_mm(x_TD, F_):
        raise AssertionError(f"the grouped path is not taken for {dtype} on {device} (use_grouped_mm is False)")
    results = []
    for run in (experts.forward, experts.forward_loop):
        x_TD.grad = None
        experts.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y_TD = run(x_TD, counts_E, scale_T1)
        y_TD.float().backward(torch.linspace(-1, 1, y_TD.numel(), device=device).view_as(y_TD))  # not expanded
        results.append([y_TD.detach(), x_TD.grad.clone(), *(w.grad.clone() for w in experts.parameters())])
    diff = max(relative_diff(a, b) for a, b in zip(*results))
    if not diff < tolerance:
        raise AssertionError(f"grouped vs loop relative diff {diff:.2e} >= {tolerance:.0e}")
    return f"counts {counts_E.tolist()}, {dtype}, forward + 4 gradients, max relative diff {diff:.1e}"


def check_offload(device: torch.device) -> str:
    config = MoEConfig(vocab_size=256, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=256,
                       ffn_hidden=256, n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=128)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 257), generator=torch.Generator().manual_seed(1)).to(device)
    grads, offload = [], ActivationOffload(prefetch=1, min_offload_bytes=0)
    for use_offload in (False, True):
        torch.manual_seed(0)
        with torch.device(device):
            model = MoETransformer(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim > 1:
                    p.normal_(0, p.shape[-1] ** -0.5)
        if use_offload:
            offload.apply(model.layers)
        logits_BSV = model(tokens_BS[:, :-1])
        F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten()).backward()
        grads.append([p.grad for p in model.parameters()])
    offload.remove()
    if offload.tensors_offloaded != 2 or offload.tensors_copied_in != 2:
        raise AssertionError(f"expected 2 boundaries out and back, got {offload.tensors_offloaded} out, "
                             f"{offload.tensors_copied_in} in")
    diff = max(relative_diff(a, b) for a, b in zip(*grads))
    if not diff < 1e-5:  # fp32; CUDA's index_put_ accumulates in any order, recomputation may differ in the last bit
        raise AssertionError(f"gradients with offload differ by (relative) {diff:.2e}")
    return f"3 blocks, 2 boundaries out and back, fp32 gradients max relative diff {diff:.1e}"


class HostStreams:
    """``CudaStreams``' interface on the host (dry run): every copy is done when issued."""

    pin = False

    def on(self, name):
        return contextlib.nullcontext()

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def record(self):
        return None

    def wait(self, event):
        pass

    def synchronize(self, event):
        pass


def check_host_ns(device: torch.device) -> str:
    torch.manual_seed(0)
    shapes = [(256, 512), (512, 256), (256, 512), (4, 128, 256), (256, 512)]
    matrices = [torch.randn(s) for s in shapes]
    staging = HostStagedNS(device, streams=None if device.type == "cuda" else HostStreams())
    staged = {}
    staging.run([(G.shape, G.dtype) for G in matrices], lambda i, out: out.copy_(matrices[i]),
                [lambda G: newton_schulz(G, QUINTIC5)] * len(shapes), lambda i, O: staged.setdefault(i, O.clone()))
    for i, G in enumerate(matrices):
        serial = newton_schulz(G.to(device), QUINTIC5).cpu()
        if not torch.equal(staged[i], serial):
            raise AssertionError(f"matrix {i} {tuple(G.shape)}: staged differs from serial by "
                                 f"{relative_diff(staged[i], serial):.2e} (relative)")
    return f"{len(shapes)} matrices (3 shapes, one 3-D stack), staged == serial bitwise"


def check_all_to_all(device: torch.device, store_path: Path) -> str:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(store_path), 1), rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        x = torch.arange(12, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, [12], [12])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.equal(out, x):
            raise AssertionError(f"all_to_all_single returned {out.tolist()}")
    finally:
        dist.destroy_process_group()
    return f"{backend}, one rank, 12 elements round trip"


def check_flex(device: torch.device, seq: int, heads: int, qk_dim: int, v_dim: int, tolerance: float,
               mask_len: int | None = None) -> str:
    """FlexAttention (compiled on CUDA) with its max scores, against SDPA with the dense mask and exact maxima;
    ``mask_len``: the ``seq`` tokens attend through the first positions of a mask over that many."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(seq)
    mask_len = mask_len or seq
    tokens_BS = (torch.rand(1, mask_len, generator=g) < 1 / min(512, mask_len // 4)).long()  # 1 = end of document
    doc_BS = document_ids(tokens_BS, 1).to(device)
    # laid out as the model passes them ([B, S, H, D] transposed), so a padded call meets the compiled layout
    q, k, v = (torch.randn(1, seq, heads, d, generator=g).mul_(2).to(device, dtype).transpose(1, 2)
               .requires_grad_(cuda) for d in (qk_dim, qk_dim, v_dim))  # no CPU backward: forward only there
    scale = qk_dim ** -0.5
    mask = DocumentMask(doc_BS, flex=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out, max_logits_H = attend(q, k, v, mask, scale, return_max_logits=True)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    doc_BS = doc_BS[:, :seq]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc_BS, seq), scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out)) if cuda else ()
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref)) if cuda else ()
    diff = max(relative_diff(a, b) for a, b in zip((out, *grads), (ref, *ref_grads)))
    exact_H = exact_max_logits(q.detach(), k.detach(), DocumentMask(doc_BS, flex=False), scale)
    ratio = (max_logits_H / exact_H).median().item()
    logit_diff = relative_diff(max_logits_H, exact_H)
    problems = []
    if not diff < tolerance:
        problems.append(f"output/gradients differ from SDPA by {diff:.2e} (relative, tolerance {tolerance:.0e})")
    if not logit_diff < 1e-2:
        named = " (= 1/ln 2: torch 2.11 rescales AuxRequest.max_scores)" if abs(ratio - 1 / math.log(2)) < 1e-2 else (
            " (= ln 2)" if abs(ratio - math.log(2)) < 1e-2 else "")
        problems.append(f"max logits differ from exact_max_logits: median ratio {ratio:.4f}{named}, "
                        f"relative diff {logit_diff:.2e}")
    if problems:
        raise AssertionError("; ".join(problems))
    return (f"{dtype}{'' if cuda else ' (forward only: no CPU backward)'}, {heads} heads, qk {qk_dim} / v {v_dim}, {int(tokens_BS.sum()) + 1} documents: vs SDPA "
            f"{diff:.1e}, max logits ratio {ratio:.4f}, {compiled} new compiled graph(s)")


def compute_device(cuda: bool) -> torch.device:
    """The device the checks run on; on CUDA with its index, which ``init_process_group(device_id=...)`` requires."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def figure_line(outcome: dict[str, str], total: int) -> str:
    """The part's figure so far: a time-out in a later check keeps the checks done before it."""
    passed = sum(v == "PASS" for v in outcome.values())
    failed = [name for name, v in outcome.items() if v != "PASS"]
    pending = f", {total - len(outcome)} pending" if len(outcome) < total else ""
    return (f"figure: paths | {passed}/{total} checks pass{pending}"
            f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''} | all {total} | "
            f"{'PASS' if not failed and not pending else 'FAIL'}")


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU: the same checks, eager, tiny shapes")
    parser.add_argument("--seq", type=int, default=None, help="FlexAttention tokens (default 4096; dry run 64)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    device = compute_device(cuda)
    config = recipe_config(dry_run=not cuda)  # the recipe's head dims (MLA: query/key 128 + 64, value 128)
    heads, (qk_dim, v_dim) = config.n_heads, config.attention_head_dims
    seq = args.seq or (4096 if cuda else 64)
    store = Path(tempfile.mkdtemp()) / "store"
    checks = {
        "grouped_mm": lambda: check_grouped_mm(device, torch.bfloat16 if cuda else torch.float32,
                                               2e-2 if cuda else 1e-5),
        "offload": lambda: check_offload(device),
        "host_ns": lambda: check_host_ns(device),
        "all_to_all": lambda: check_all_to_all(device, store),
        "flex_S": lambda: check_flex(device, seq, heads, qk_dim, v_dim, 2e-2 if cuda else 1e-5),
        "flex_S-1": lambda: check_flex(device, seq - 1, heads, qk_dim, v_dim, 2e-2 if cuda else 1e-5, seq),
    }
    outcome = {}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            detail = check()
            outcome[name] = "PASS"
            print(f"paths: PASS {name} ({time.perf_counter() - start:.1f} s) {detail}", flush=True)
        except Exception as error:  # report it and run the next check
            outcome[name] = "FAIL"
            message = f"{type(error).__name__}: {error}".replace("\n", " ")[:600]
            print(f"paths: FAIL {name} ({time.perf_counter() - start:.1f} s): {message}", flush=True)
        if name == "all_to_all" or len(outcome) == len(checks):  # a figure before the compiled checks, then the last
            print(figure_line(outcome, len(checks)), flush=True)
    failed = [name for name, v in outcome.items() if v != "PASS"]
    if failed and __name__ == "__main__":
        sys.exit(1)
    return outcome


if __name__ == "__main__":
    main()
