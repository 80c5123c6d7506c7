from .flexshard import FlexShardLayoutError
from .grouping import param_groups, parameter_roles
from .muon import Muon
from .muon_groups import muon_param_groups
from .newton_schulz import newton_schulz
from .schedule import WarmupCosineLR

__all__ = ["param_groups", "parameter_roles", "WarmupCosineLR", "Muon", "muon_param_groups", "newton_schulz",
           "FlexShardLayoutError"]
