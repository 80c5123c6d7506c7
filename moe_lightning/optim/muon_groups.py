"""Which parameters Muon orthogonalizes and which AdamW handles.

Muon is for hidden matrices: attention projections, dense FFN, shared experts (role
``hidden_matrix``) and routed-expert stacks ``[E, out, in]`` (role ``expert_stack``, each expert its
own matrix). Embeddings, the output head, norms, biases and the router gate go to AdamW (the
balancing bias is a buffer and never optimized). Name patterns (``fnmatch`` globs on qualified
parameter names) override the role, e.g. ``adamw_patterns: ["layers.0.*"]``.
"""

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from moe_lightning.optim.grouping import param_groups

MUON_ROLES = ("hidden_matrix", "expert_stack")


def algorithm_for(name: str, role: str | None, ndim: int, muon_patterns: Sequence[str] = (),
                  adamw_patterns: Sequence[str] = ()) -> str:
    """``"muon"`` or ``"adamw"`` for one parameter; patterns beat roles, roles beat shapes."""
    to_muon = [p for p in muon_patterns if fnmatchcase(name, p)]
    to_adamw = [p for p in adamw_patterns if fnmatchcase(name, p)]
    if to_muon and to_adamw:
        raise ValueError(f"parameter {name!r} matches muon_patterns {to_muon} and adamw_patterns {to_adamw}: "
                         f"make the patterns disjoint.")
    if to_muon:
        if ndim not in (2, 3):
            raise ValueError(f"parameter {name!r} has {ndim} dims but muon_patterns {to_muon} send it to Muon, "
                             f"which orthogonalizes matrices [m, n] or stacks [E, m, n]: drop it from the pattern.")
        return "muon"
    if to_adamw:
        return "adamw"
    if role is None:  # a plain parameter list without roles: matrices go to Muon
        return "muon" if ndim in (2, 3) else "adamw"
    return "muon" if role in MUON_ROLES else "adamw"


def split_by_algorithm(groups: Sequence[dict], muon_patterns: Sequence[str] = (),
                       adamw_patterns: Sequence[str] = ()) -> list[dict]:
    """Split each group into a Muon part and an AdamW part, tagging each with ``algorithm``.

    Groups may carry ``param_names`` (needed for patterns) and ``role`` as made by ``param_groups``;
    every other key is kept. A group that already has ``algorithm`` is left as it is.
    """
    out = []
    for group in groups:
        if "algorithm" in group:
            out.append(dict(group))
            continue
        params = list(group["params"])
        names = group.get("param_names") or [None] * len(params)
        if (muon_patterns or adamw_patterns) and None in names:
            raise ValueError("Muon muon_patterns/adamw_patterns need parameter names: pass groups made by "
                             "moe_lightning.optim.param_groups (they carry 'param_names').")
        parts: dict[str, tuple[list, list]] = {"muon": ([], []), "adamw": ([], [])}
        for name, p in zip(names, params):
            algo = algorithm_for(name or "", group.get("role"), p.ndim, muon_patterns, adamw_patterns)
            parts[algo][0].append(p)
            parts[algo][1].append(name)
        for algo, (ps, ns) in parts.items():
            if ps:
                part = {**group, "params": ps, "algorithm": algo}
                if "param_names" in group:
                    part["param_names"] = ns
                out.append(part)
    return out


def muon_param_groups(model: nn.Module, weight_decay: float, muon_patterns: Sequence[str] = (),
                      adamw_patterns: Sequence[str] = ()) -> list[dict]:
    """``param_groups`` of the model split into Muon and AdamW groups (what ``Muon`` builds internally)."""
    return split_by_algorithm(param_groups(model, weight_decay), muon_patterns, adamw_patterns)
