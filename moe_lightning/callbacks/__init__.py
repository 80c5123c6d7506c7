"""Lightning callbacks for MoE training, added from YAML by ``class_path``: offload, memory, speed, expert load,
curves, QK-clip."""

from .activation_offload import ActivationOffload
from .allocator_monitor import AllocatorMonitor
from .expert_load import ExpertLoad, ExpertLoadMonitor
from .final_checkpoint import FinalCheckpoint
from .nonfinite import NonFiniteGuard, NonFiniteLossError
from .qk_clip import QKClip
from .throughput import MoEThroughputMonitor
from .training_curves import TrainingCurves

__all__ = ["ActivationOffload", "AllocatorMonitor", "ExpertLoad", "ExpertLoadMonitor", "FinalCheckpoint",
           "MoEThroughputMonitor", "NonFiniteGuard", "NonFiniteLossError", "QKClip", "TrainingCurves"]
