"""Sampling settings and the token stream that ``generate`` and ``predict`` share (plain PyTorch, no I/O)."""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_lightning.model.transformer import MoETransformer, check_sampling


@dataclass
class Sampling:
    """How to pick each next token. ``temperature`` 0 is greedy; ``top_k``/``top_p`` restrict the candidates.
    These defaults are those of ``generate`` and ``predict`` (``add_sampling_arguments``)."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    stop_at_eod: bool = True
    seed: int = 0

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.top_k, self.top_p)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 = greedy).")



def stream(model: MoETransformer, prompt_1S: torch.Tensor, sampling: Sampling, eod_id: int) -> Iterator[int]:
    """New token ids one by one, from the model's KV-cached ``generate_stream``; the end-of-document token that
    stops a sample is not yielded."""
    generator = torch.Generator(prompt_1S.device).manual_seed(sampling.seed)
    stop_token = eod_id if sampling.stop_at_eod else None
    for next_1 in model.generate_stream(prompt_1S, sampling.max_new_tokens, sampling.temperature, sampling.top_k,
                                        generator, top_p=sampling.top_p, stop_token=stop_token):
        token = int(next_1)  # one read back to the host per token
        if token == stop_token:
            return
        yield token

