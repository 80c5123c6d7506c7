from moe_lightning.optim.flexshard import FlexShardLayoutError
from moe_lightning.optim.grouping import param_groups, parameter_roles
from moe_lightning.optim.muon import Muon
from moe_lightning.optim.muon_groups import muon_param_groups
from moe_lightning.optim.newton_schulz import newton_schulz
from moe_lightning.optim.schedule import WarmupCosineLR

__all__ = ["param_groups", "parameter_roles", "WarmupCosineLR", "Muon", "muon_param_groups", "newton_schulz",
           "FlexShardLayoutError"]
