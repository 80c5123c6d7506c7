"""Lightning callbacks for MoE training, added from YAML by ``class_path``: offload, memory, speed, expert load,
curves, QK-clip; and those every fit runs: preemption, the final checkpoint, the resume agreement and folder locks."""

from moe_lightning.training.callbacks.activation_offload import ActivationOffload
from moe_lightning.training.callbacks.allocator_monitor import AllocatorMonitor
from moe_lightning.training.callbacks.expert_load import ExpertLoad, ExpertLoadMonitor
from moe_lightning.training.callbacks.final_checkpoint import FinalCheckpoint
from moe_lightning.training.callbacks.nonfinite import NonFiniteGuard, NonFiniteLossError
from moe_lightning.training.callbacks.preemption import Preemption
from moe_lightning.training.callbacks.qk_clip import QKClip
from moe_lightning.training.callbacks.throughput import MoEThroughputMonitor
from moe_lightning.training.callbacks.training_curves import TrainingCurves

__all__ = ["ActivationOffload", "AllocatorMonitor", "ExpertLoad", "ExpertLoadMonitor", "FinalCheckpoint",
           "MoEThroughputMonitor", "NonFiniteGuard", "NonFiniteLossError", "Preemption", "QKClip", "TrainingCurves"]
