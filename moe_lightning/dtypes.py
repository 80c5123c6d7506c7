"""The package's one table of dtype names, in both spellings users type: ``bfloat16`` or ``bf16``, ``float16`` or
``fp16``, ``float32`` or ``fp32`` (every command's ``--dtype`` and the strategy's ``param_dtype``/``reduce_dtype``)."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
