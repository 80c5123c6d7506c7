"""Muon on one process: parity with torch.optim.Muon and AdamW, Newton–Schulz numerics, grouping, YAML.

Exact-equality checks compare the same bf16 operations run in the same process (our 2-D path issues
the ops of ``torch.optim.Muon``), so any difference would be a real deviation, not round-off.
"""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from moe_lightning.commands.main import run
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim import Muon, muon_param_groups, newton_schulz, param_groups
from moe_lightning.optim.flexshard import lpt_owners
from moe_lightning.optim.newton_schulz import POLAR_EXPRESS, coefficient_schedule
from moe_lightning.planner.run_config import load_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUINTIC5 = coefficient_schedule("quintic", 5)


def twin_params(shapes, seed=0):
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def step_both(ours, theirs, opt_a, opt_b, steps=3):
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_on_2d(adjust_lr_fn, nesterov):
    ours, theirs = twin_params([(16, 24), (24, 16), (20, 20)])
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    step_both(ours, theirs, Muon(ours, **kw, ns_dtype="bfloat16"), torch.optim.Muon(theirs, **kw))
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_expert_stack_step_equals_torch_muon_per_expert(adjust_lr_fn):
    """A [E, m, n] stack is E independent matrices: same momentum, NS and shape-based LR scale (of one expert's
    [m, n], under either rule)."""
    ours, _ = twin_params([(4, 12, 20)])
    theirs = [torch.nn.Parameter(e.detach().clone()) for e in ours[0]]
    opt_a = Muon(ours, lr=0.02, adjust_lr_fn=adjust_lr_fn, ns_dtype="bfloat16")
    opt_b = torch.optim.Muon(theirs, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    for _ in range(3):
        ours[0].grad = torch.randn_like(ours[0])
        for e, q in enumerate(theirs):
            q.grad = ours[0].grad[e].clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(ours[0].detach(), torch.stack(theirs).detach())


@pytest.mark.parametrize("shape", [(6, 16, 40), (6, 40, 16)])
def test_batched_expert_ns_equals_per_matrix(shape):
    """Per-matrix Frobenius normalisation and batched matmuls: each expert as if alone (≤ 1 bf16 ulp)."""
    G_EMN = torch.randn(shape)
    batched = newton_schulz(G_EMN, QUINTIC5).float()
    single = torch.stack([newton_schulz(G_MN, QUINTIC5) for G_MN in G_EMN]).float()
    # bitwise equal here; the batched bf16 kernel may accumulate in another order for other batch sizes
    assert (batched - single).abs().max() <= 2 ** -8 * single.abs().max()


def float64_iteration(G: np.ndarray, schedule) -> np.ndarray:
    """Independent float64 reference of the same polynomial iteration X <- aX + (bA + cA^2)X, A = XX^T."""
    tall = G.shape[0] > G.shape[1]
    X = (G.T if tall else G) / np.linalg.norm(G)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("name", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_matches_float64_reference(name, shape):
    """bf16 (8-bit mantissa, unit round-off 2^-9) rounds X, XX^T, the polynomial and the product each
    step and the early polynomials amplify perturbations by their slope (a ≈ 3.4 to 8): a few percent
    relative Frobenius error after 5 steps is expected (observed 1.4–3.5 %). Allowed: 5 %."""
    schedule = coefficient_schedule(name, 5)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = newton_schulz(G, schedule).double().numpy()
    ref = float64_iteration(G.double().numpy(), schedule)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 5e-2
    sigma = np.linalg.svd(ours, compute_uv=False)
    assert 0.5 < sigma.min() and sigma.max() < 1.5  # orthogonalized: singular values near 1


def test_coefficient_schedules():
    assert coefficient_schedule("quintic", 3) == ((3.4445, -4.7750, 2.0315),) * 3
    pe = coefficient_schedule("polar_express", 10)
    assert pe[:8] == POLAR_EXPRESS and pe[8:] == (POLAR_EXPRESS[-1],) * 2 and len(set(pe[:5])) == 5
    assert coefficient_schedule([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], 3) == ((1, 2, 3), (4, 5, 6), (4, 5, 6))
    with pytest.raises(ValueError, match="ns_coefficients='cubic'"):
        coefficient_schedule("cubic", 5)
    with pytest.raises(ValueError, match="ns_steps=0"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], ns_steps=0)


def test_adamw_groups_match_torch_adamw():
    ours, theirs = twin_params([(7,), (3, 4)])
    opt_a = Muon([{"params": ours, "algorithm": "adamw", "weight_decay": 0.05}], lr=1e-2)
    opt_b = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05)
    step_both(ours, theirs, opt_a, opt_b, steps=4)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def expected_algorithm(name: str) -> str:
    """Where each parameter of the shipped model belongs, written out by name independently of roles."""
    if name.startswith(("tok_embeddings", "output", "norm")) or "norm" in name.split(".")[-2] \
            or name.endswith(("bias", "router.gate.weight")):
        return "adamw"
    return "muon"


@pytest.mark.parametrize("config_file", ["tiny.yaml", "small.yaml", "16b.yaml"])
def test_grouping_puts_each_parameter_where_it_belongs(config_file):
    with torch.device("meta"):
        model = MoETransformer(load_model_config(CONFIGS / config_file))
    groups = muon_param_groups(model, 0.1)
    placed = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert placed.keys() == dict(model.named_parameters()).keys()
    for name, algorithm in placed.items():
        assert algorithm == expected_algorithm(name), name
    roles = {g["role"] for g in groups if g["algorithm"] == "muon"}
    assert roles == {"hidden_matrix", "expert_stack"}
    assert all(g["weight_decay"] == 0.0 for g in groups if g["role"] in ("embedding", "norm"))


def test_name_patterns_override_roles():
    model = MoETransformer(MoEConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                     num_experts=4, expert_hidden=8))
    groups = muon_param_groups(model, 0.1, muon_patterns=["*.router.gate.weight"], adamw_patterns=["layers.0.*"])
    placed = {n: g["algorithm"] for g in groups for n in g["param_names"]}
    assert placed["layers.1.ffn.router.gate.weight"] == "muon"
    assert placed["layers.0.attention.wq.weight"] == "adamw"
    assert placed["layers.1.attention.wq.weight"] == "muon"
    with pytest.raises(ValueError, match="matches muon_patterns"):
        muon_param_groups(model, 0.1, muon_patterns=["layers.0.*"], adamw_patterns=["*.wq.weight"])
    with pytest.raises(ValueError, match="has 1 dims"):
        Muon(param_groups(model, 0.1), muon_patterns=["norm.weight"])


def test_state_dict_round_trip_continues_identically():
    model = MoETransformer(MoEConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=32,
                                     num_experts=4, expert_hidden=8))
    clone = MoETransformer(model.config)
    clone.load_state_dict(model.state_dict())
    opt = Muon(param_groups(model, 0.1), lr=0.01)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    clone.load_state_dict(model.state_dict())
    restored = Muon(param_groups(clone, 0.1), lr=0.01)
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if read back from disk
    for p, q in zip(model.parameters(), clone.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    restored.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def test_lpt_owners_balanced():
    costs = [5.0, 3.0, 3.0, 2.0, 2.0, 2.0, 1.0]
    owners = lpt_owners(costs, 3)
    assert owners == [0, 1, 2, 1, 2, 0, 1]
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert loads == [7.0, 6.0, 5.0]  # optimum is 6; LPT guarantees ≤ 4/3 of it


def test_yaml_builds_muon_through_the_module_optimizer_callable(capsys):
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(CONFIGS / "tiny-muon.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["optimizer"]
    assert printed["class_path"] == "moe_lightning.optim.Muon"
    assert printed["init_args"]["adjust_lr_fn"] == "original" and printed["init_args"]["adamw_lr"] == 0.003
    cli = run(["fit", "--config", str(CONFIGS / "tiny-muon.yaml"), "--trainer.fast_dev_run=true",
                "--model.init_args.optimizer.init_args.adamw_patterns=[layers.0.*]",
                "--model.init_args.optimizer.init_args.ns_coefficients=polar_express",
                "--data.init_args.max_tokens=200000", "--trainer.logger=false"])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, Muon) and cli.trainer.global_step == 1
    placed = {n: g["algorithm"] for g in opt.param_groups for n in g["param_names"]}
    assert placed["layers.0.attention.wq.weight"] == "adamw" and placed["layers.1.ffn.experts.w1_EFD"] == "muon"


def test_newton_schulz_dtype_follows_what_the_cpu_runs_fast(monkeypatch):
    """An AVX2-only CPU emulates bf16 matmuls ~100x slower than fp32: ``auto`` picks fp32 there and says so once;
    a CPU with bf16 units (or a GPU) keeps bf16, and ``ns_dtype`` forces either."""
    import logging

    import importlib
    ns_module = importlib.import_module("moe_lightning.optim.newton_schulz")  # not the function optim exports

    avx2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    monkeypatch.setattr(ns_module, "_cpu_flags", lambda: avx2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert ns_module.ns_dtype_for(cpu) == torch.float32 and ns_module.ns_dtype_for(cuda) == torch.bfloat16
    assert ns_module.ns_dtype_for(cpu, "bfloat16") == torch.bfloat16
    ours, _ = twin_params([(16, 24), (4, 12, 20)])
    opt = Muon(ours, lr=0.02)
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.moe_lightning")  # where run.console.info writes
    logger.addHandler(handler)
    try:
        step_both(ours, [], opt, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), steps=2)
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "Newton–Schulz runs in" in r.getMessage()]
    assert said == ["Muon: Newton–Schulz runs in float32 on cpu: this CPU has no bf16 matmul units "
                    "(ns_dtype: bfloat16 forces it)."]
    assert opt._ns_dtypes == {cpu: torch.float32}
    monkeypatch.setattr(ns_module, "_cpu_flags", lambda: avx2 | {"avx512_bf16"})
    assert ns_module.ns_dtype_for(cpu) == torch.bfloat16
    monkeypatch.setattr(ns_module, "_cpu_flags", lambda: frozenset({"fp", "asimd", "bf16"}))  # Arm (Grace)
    assert ns_module.ns_dtype_for(cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="ns_dtype='fp16'"):
        Muon(ours, ns_dtype="fp16")


@pytest.mark.parametrize("shape", [(32, 64), (48, 48)])
def test_float32_newton_schulz_is_closer_to_the_float64_iteration(shape):
    schedule = coefficient_schedule("quintic", 5)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ref = float64_iteration(G.double().numpy(), schedule)
    errors = {dtype: np.linalg.norm(newton_schulz(G, schedule, dtype=dtype).double().numpy() - ref)
              / np.linalg.norm(ref) for dtype in (torch.float32, torch.bfloat16)}
    assert errors[torch.float32] < 1e-4 < errors[torch.bfloat16]
