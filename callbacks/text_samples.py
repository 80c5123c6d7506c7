"""An example *user-project* callback: every N steps, let the model continue a prompt and save the text.

It lives outside the package on purpose: it is written exactly as you would write one in your own
project, and added from YAML by ``class_path`` (``callbacks.text_samples.TextSamples``).
"""

from pathlib import Path

import lightning as L
import torch


class TextSamples(L.Callback):
    """Write sampled continuations of ``prompt`` to ``<log_dir>/samples.txt`` (rank 0 only).

    Args:
        every_n_steps: Sample after every this many optimizer steps (and once when training ends).
        prompt: Text the model continues.
        max_new_tokens: Tokens to sample per continuation.
        temperature: Sampling temperature (0 = greedy).
        seed: Seed for the sampling generator, so samples are comparable across steps.
    """

    def __init__(self, every_n_steps: int = 100, prompt: str = "def ", max_new_tokens: int = 64,
                 temperature: float = 0.8, seed: int = 0):
        if every_n_steps < 1:
            raise ValueError(f"TextSamples.every_n_steps={every_n_steps} must be >= 1.")
        self.every_n_steps, self.prompt = every_n_steps, prompt
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self._last_sampled_step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step counts optimizer steps: with gradient accumulation several batches share one.
        if trainer.global_step % self.every_n_steps == 0:
            self._sample(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._sample(trainer, pl_module)

    def _sample(self, trainer, pl_module) -> None:
        if trainer.global_step == self._last_sampled_step:
            return
        self._last_sampled_step = trainer.global_step
        tokenizer = trainer.datamodule.tokenizer
        prompt_1S = torch.as_tensor(tokenizer.encode(self.prompt), dtype=torch.long, device=pl_module.device)[None]
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        was_training = pl_module.training
        pl_module.eval()
        tokens_1S = pl_module.model.generate(prompt_1S, self.max_new_tokens, self.temperature, generator=generator)
        pl_module.train(was_training)
        if trainer.is_global_zero:
            text = tokenizer.decode(tokens_1S[0].tolist())
            out = Path(trainer.log_dir or trainer.default_root_dir) / "samples.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a", encoding="utf-8") as f:
                f.write(f"=== step {trainer.global_step} ===\n{text}\n")
