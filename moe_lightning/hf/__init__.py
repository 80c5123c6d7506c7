"""Hugging Face checkpoints in and out: ``from_pretrained``, ``save_pretrained``, one mapping per family.

Imports the model, never the reverse. Reads only ``config.json`` and safetensors (no code from disk).
"""

from moe_lightning.hf.mapping import HFFormatError
from moe_lightning.hf.pretrained import (FAMILIES, choose_family, fill_state_dict, from_pretrained, load_config, merge_config,
                         replaced_fields, save_pretrained, write_pretrained)

__all__ = ["FAMILIES", "HFFormatError", "choose_family", "fill_state_dict", "from_pretrained", "load_config",
           "merge_config", "replaced_fields", "save_pretrained", "write_pretrained"]
