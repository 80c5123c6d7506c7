"""The samplers' orders written from the rules their docstrings state (moe_lightning/data/sampling.py), in plain
Python integers, one index at a time: the held-out reference the samplers are checked against. Nothing here
calls the code under test; numpy appears only for the documented seeding (``SeedSequence``) and the pattern's
fixed permutation (``default_rng``)."""

import itertools
from functools import lru_cache

import numpy as np

from moe_lightning.data.sampling import PATTERN_SEED

MASK_64 = 2**64 - 1


def splitmix64_finalizer(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


@lru_cache(maxsize=None)
def shuffled(n: int, *seed: int):
    """Position -> sequence of ``Shuffle(n, *seed)``: a 6-round balanced Feistel network on ``2 * half`` bits, the
    smallest even width (at least 2) that holds ``n - 1``; round ``r`` maps ``(left, right)`` to ``(right, left ^
    (splitmix64_finalizer(right ^ key_r) & mask))``; applied again until the value is below ``n``."""
    half = -(-max(2, (n - 1).bit_length()) // 2)
    mask = (1 << half) - 1
    keys = [int(k) for k in np.random.SeedSequence([s % 2**64 for s in seed]).generate_state(6, np.uint64)]

    def at(position: int) -> int:
        value = position
        while True:
            left, right = value >> half, value & mask
            for key in keys:
                left, right = right, left ^ (splitmix64_finalizer(right ^ key) & mask)
            value = (left << half) | right
            if value < n:
                return value
    return at


def positions_of_rank(size: int, world: int, rank: int, start: int = 0) -> range:
    """The epoch's positions rank ``rank`` of ``world`` reads: every ``world``-th from ``start + rank``, the last
    ``size % world`` positions dropped (every rank reads as many)."""
    return range(start + rank, size - size % world, world)


def resumable_order(size: int, seed: int, epoch: int, world: int = 1, rank: int = 0, start: int = 0):
    """``ResumableSampler``: position ``i`` of epoch ``e`` is sequence ``Shuffle(size, seed, e)(i)``."""
    at = shuffled(size, seed, epoch)
    return (at(i) for i in positions_of_rank(size, world, rank, start))


def mixture_order(counts: list[int], lengths: list[int], seed: int, epoch: int, world: int = 1, rank: int = 0,
                  start: int = 0):
    """``MixtureSampler`` with a pattern of ``counts[k]`` draws of source ``k``: the draws are walked one by one
    from the very first (every mixture epoch continues the last), each source's draws counted as they come; the
    ``c``-th draw of source ``k`` is sequence ``c % len_k`` of that source's pass ``c // len_k``, shuffled by
    ``Shuffle(len_k, seed, k, pass)``, at index ``offset_k + that`` of the mixture."""
    pattern = np.random.default_rng(PATTERN_SEED).permutation(np.repeat(np.arange(len(counts)), counts)).tolist()
    offsets = list(itertools.accumulate([0, *lengths]))
    size = offsets[-1]
    wanted = positions_of_rank(size, world, rank, start)
    taken = [0] * len(counts)
    for draw in itertools.count():
        position = draw - epoch * size
        if position >= wanted.stop:
            return
        k = pattern[draw % len(pattern)]
        c, taken[k] = taken[k], taken[k] + 1
        if position in wanted:
            yield offsets[k] + shuffled(lengths[k], seed, k, c // lengths[k])(c % lengths[k])
