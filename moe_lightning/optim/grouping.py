"""Sort parameters into optimizer groups by their role in the model.

Roles are found through the model's structure (module types), never by guessing from shapes:
- ``hidden_matrix``: 2-D weights inside blocks (attention projections, dense FFN, shared experts)
- ``expert_stack``: 3-D routed-expert stacks ``[E, out, in]`` (each expert its own matrix)
- ``router``: the router gate
- ``embedding``, ``head``: token embedding and output projection
- ``norm``: RMSNorm weights and any bias

Weight decay applies to ``hidden_matrix``, ``expert_stack``, ``router`` and ``head``; never to
norms, biases or embeddings. The balancing bias is a buffer and is never optimized.
"""

from torch import nn

from moe_lightning.model import GroupedExperts, MoETransformer, Router
from moe_lightning.model.layers import RMSNorm

ROLES = ("hidden_matrix", "expert_stack", "router", "embedding", "head", "norm")
NO_DECAY_ROLES = ("embedding", "norm")


def parameter_roles(model: MoETransformer) -> dict[str, str]:
    """Map every trainable parameter's qualified name to its role (tied weights appear once)."""
    roles: dict[str, str] = {}
    router_gates = {id(m.gate) for m in model.modules() if isinstance(m, Router)}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if module is model.tok_embeddings:
                role = "embedding"
            elif module is model.output:
                role = "head"
            elif isinstance(module, (RMSNorm,)) or param_name.endswith("bias"):
                role = "norm"
            elif isinstance(module, GroupedExperts):
                role = "expert_stack"
            elif id(module) in router_gates:
                role = "router"
            elif isinstance(module, nn.Linear):
                role = "hidden_matrix"
            else:
                raise ValueError(f"parameter {name!r} of {type(module).__name__} has no optimizer role")
            roles[name] = role
    params = dict(model.named_parameters())
    return {name: role for name, role in roles.items() if name in params}


def param_groups(model: MoETransformer, weight_decay: float) -> list[dict]:
    """One optimizer group per non-empty role, carrying ``role`` and ``param_names`` for optimizers."""
    roles = parameter_roles(model)
    params = dict(model.named_parameters())
    groups = []
    for role in ROLES:
        names = [name for name, r in roles.items() if r == role]
        if names:
            groups.append({
                "params": [params[n] for n in names],
                "param_names": names,
                "role": role,
                "weight_decay": 0.0 if role in NO_DECAY_ROLES else weight_decay,
            })
    return groups
