"""Newton–Schulz orthogonalization for Muon, batched over leading dims (expert stacks ``[E, m, n]``).

The iteration runs in bf16 where bf16 matmuls are fast (GPUs, CPUs with bf16 units): Muon only needs the
singular values pushed towards 1 (roughly into [0.5, 1.5]), not an exact polar factor, and bf16 halves memory
traffic and doubles matmul speed. A CPU without bf16 units emulates bf16 matmuls ~100x slower than fp32
(a 1024² matmul: 0.9 against 105 GFLOP/s on an AVX2-only EPYC), so there it runs in fp32 (``ns_dtype``).
"""

import functools
from collections.abc import Sequence

import torch

Coefficients = tuple[float, float, float]

# Quintic with the slope at zero maximised (Keller Jordan's Muon; the same as ``torch.optim.Muon``).
QUINTIC: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# Polar Express (Amsel et al., arXiv 2505.16932): one minimax-optimal quintic per step, each step
# but the last divided by the paper's safety factor 1.01 so bf16 round-off cannot push a singular
# value past the interval the next polynomial was designed for.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS: tuple[Coefficients, ...] = tuple(
    (a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]) + _POLAR_EXPRESS_RAW[-1:]

SCHEDULES = {"quintic": QUINTIC, "polar_express": POLAR_EXPRESS}


def coefficient_schedule(coefficients: str | Sequence[Sequence[float]], steps: int) -> tuple[Coefficients, ...]:
    """``steps`` triples ``(a, b, c)``: a named schedule or an explicit list; the last triple repeats."""
    if isinstance(coefficients, str):
        if coefficients not in SCHEDULES:
            raise ValueError(f"Muon.ns_coefficients={coefficients!r}: use one of {sorted(SCHEDULES)} "
                             f"or a list of [a, b, c] triples, one per Newton–Schulz step.")
        coefficients = SCHEDULES[coefficients]
    triples = tuple(tuple(float(x) for x in abc) for abc in coefficients)
    if not triples or any(len(abc) != 3 for abc in triples):
        raise ValueError(f"Muon.ns_coefficients={coefficients!r}: each entry must be one [a, b, c] triple.")
    if steps < 1:
        raise ValueError(f"Muon.ns_steps={steps} must be >= 1.")
    return tuple(triples[min(i, len(triples) - 1)] for i in range(steps))


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86 ``avx512_bf16``/``amx_bf16``, Arm ``bf16``), read from
    ``/proc/cpuinfo``; False where that file is missing."""
    return _cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"} != set()


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "Features"))]
    except OSError:
        return frozenset()
    return frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset()


def ns_dtype_for(device: torch.device, ns_dtype: str = "auto") -> torch.dtype:
    """The dtype Newton–Schulz runs in on ``device``: ``ns_dtype`` ``"bfloat16"``/``"float32"``, or ``"auto"``:
    bf16 on accelerators and on CPUs with bf16 units, fp32 on other CPUs."""
    if ns_dtype != "auto":
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[ns_dtype]
    return torch.float32 if device.type == "cpu" and not cpu_has_fast_bf16() else torch.bfloat16


def newton_schulz(G_BMN: torch.Tensor, schedule: Sequence[Coefficients], eps: float = 1e-7,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate the orthogonal polar factor of each trailing ``[m, n]`` matrix, in ``dtype``.

    ``G_BMN`` is ``[m, n]`` or ``[B, m, n]``; each matrix is normalised by its own Frobenius norm, so a
    batch equals the matrices done one by one. Wide orientation keeps the Gram matrix ``min(m, n)``-sized.
    In bf16 the 2-D path uses exactly the operations of ``torch.optim.Muon``.
    """
    if G_BMN.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [m, n] or [B, m, n], got shape {tuple(G_BMN.shape)}")
    X = G_BMN.to(dtype)
    tall = G_BMN.shape[-2] > G_BMN.shape[-1]
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm_add = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in schedule:
        gram = X @ X.mT
        poly = mm_add(gram, gram, gram, beta=b, alpha=c)
        X = mm_add(X, poly, X, beta=a)
    return X.mT if tall else X


def newton_schulz_flops(m: int, n: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` iterations on one ``[m, n]`` matrix: the cost owners are balanced by."""
    small, large = min(m, n), max(m, n)
    return steps * (4 * small * small * large + 2 * small ** 3)
