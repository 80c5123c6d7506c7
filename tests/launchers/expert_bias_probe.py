"""A test-only callback for tests/launchers/pipeline_fit_run.py (``--biases``): after every optimizer step, every
MoE layer's aux-loss-free balancing bias by its name in the whole model (under pipeline stages each rank holds its
stage's layers: rank 0 merges what every rank holds). Rank 0 writes ``[{"step", "biases": {name: [E floats]},
"agree": bool}]``; ``agree`` says every rank holding a layer holds the same bias (the ranks of a stage must)."""

import json
from pathlib import Path

import lightning as L
import torch.distributed as dist


class ExpertBiasProbe(L.Callback):
    def __init__(self, out: str):
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mine = {name: buffer.tolist() for name, buffer in pl_module.named_buffers() if name.endswith("expert_bias")}
        held = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            held = [None] * dist.get_world_size()
            dist.all_gather_object(held, mine)
        merged, agree = {}, True
        for biases in held:
            for name, values in biases.items():
                agree &= merged.setdefault(name, values) == values
        self.rows.append({"step": trainer.global_step, "biases": merged, "agree": agree})
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(self.rows))
