"""Lightning callbacks for MoE training, added from YAML by ``class_path``: offload, memory, speed, expert load."""

from .activation_offload import ActivationOffload

__all__ = ["ActivationOffload"]
