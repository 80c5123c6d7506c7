from .grouping import param_groups, parameter_roles
from .schedule import WarmupCosineLR

__all__ = ["param_groups", "parameter_roles", "WarmupCosineLR"]
