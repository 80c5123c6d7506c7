"""Sequences cut from token streams, the train/validation split, and the orders ranks read them in.

``ResumableSampler`` shuffles one corpus; ``MixtureSampler`` interleaves several by weight. Both deal one
global order out to ranks (rank ``r`` of ``W`` takes every ``W``-th index), so the order never depends on the
world size and a resumed run, at any world size, skips exactly the samples already consumed.

Nothing here holds an array over the sequences: the split is closed-form and every shuffle is a seeded
bijection (``Shuffle``) computed for the indices a rank is about to read, so memory and start-up are the same
for a thousand sequences and for a trillion tokens' worth.
"""

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from moe_lightning.run.console import info
from moe_lightning.data.tokens import TokenStream

PATTERN_LENGTH = 10_000  # the mixture repeats a fixed pattern of this many draws
PATTERN_SEED = 0x6D6978  # the pattern's shuffle: fixed, so the interleave is the same for every run seed
CHUNK = 1 << 16  # indices handed out per step of a sampler's iterator
FIRST_CHUNK = 1 << 10  # ... at an epoch's start (shuffling 65,536 took 3-10 ms, up to 4 times the rest of start-up)


class Shuffle:
    """A seeded permutation of ``0..n-1`` evaluated per index in O(1) memory: a balanced Feistel network over
    the smallest power of 4 at or above ``n`` (at least 4), and cycle-walking (apply again until the value falls
    below ``n``, fewer than 4 times on average), which keeps it a bijection of ``0..n-1``. Replaces a ``randperm``
    per epoch (8 bytes per sequence, seconds at 50M).

    The rule, exactly (checkpoints record positions in this order, ``feistel-v1``): a value of ``2h`` bits splits
    into ``left`` (high ``h`` bits) and ``right`` (low ``h``); the 6 round keys are
    ``numpy.random.SeedSequence([s % 2**64 for s in seed]).generate_state(6, uint64)``; round ``r`` maps
    ``(left, right)`` to ``(right, left ^ (splitmix64_finalizer(right ^ key_r) & (2**h - 1)))``, all mod 2^64.
    tests/data/reference_orders.py writes it out in plain Python."""

    ROUNDS = 6

    def __init__(self, n: int, *seed: int):
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + bits % 2) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([s % 2**64 for s in seed]).generate_state(self.ROUNDS, dtype=np.uint64)

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            z = right ^ key
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            left, right = right, left ^ ((z ^ (z >> np.uint64(31))) & self.mask)
        return (left << half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        out = self._round_trip(np.asarray(indices, dtype=np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while len(outside):
            out[outside] = self._round_trip(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)


class Split:
    """The training or the validation part of ``num_sequences`` sequences, indexed in closed form: every
    ``every``-th sequence (the last of each group of ``every``) is held out."""

    def __init__(self, num_sequences: int, every: int, validation: bool):
        self.every, self.validation = every, validation
        held_out = num_sequences // every
        self.length = held_out if validation else num_sequences - held_out

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.length:
            raise IndexError(i)
        return i * self.every + self.every - 1 if self.validation else i + i // (self.every - 1)


class PackedSequences(Dataset):
    """Sequence ``i`` is ``tokens[s*S : s*S + S + 1]`` with ``s = indices[i]`` (inputs and shifted targets share
    the slice)."""

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int, indices: Split):
        self.tokens, self.seq_len, self.indices = tokens, seq_len, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.indices[i]) * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


def split_indices(num_sequences: int, val_fraction: float) -> tuple[Split, Split]:
    """Every k-th sequence (k = round(1/val_fraction)) goes to validation: deterministic and spread out."""
    every = max(2, round(1 / val_fraction))
    return Split(num_sequences, every, validation=False), Split(num_sequences, every, validation=True)


def dealt(start: int, end: int, step: int):
    """The positions ``start, start + step, ... < end`` of an epoch a rank reads, as arrays that grow from
    ``FIRST_CHUNK`` to ``CHUNK``: the first batch waits for a few indices, the rest are computed in bulk."""
    size = min(FIRST_CHUNK, CHUNK)
    while start < end:
        yield np.arange(start, min(start + size * step, end), step, dtype=np.int64)
        start, size = start + size * step, min(2 * size, CHUNK)


class _StartsPartWay(DistributedSampler):
    """A training order that can start epoch ``resume_epoch`` after ``resume_samples`` samples (all ranks'
    together), where a checkpoint stopped."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.resume_epoch, self.resume_samples = -1, 0

    def _start(self) -> int:
        return self.resume_samples if self.epoch == self.resume_epoch else 0


class ResumableSampler(_StartsPartWay):
    """Shuffles by ``(seed, epoch)`` and deals the order out to ranks; can start an epoch part-way through.

    Position ``i`` of epoch ``e`` is sequence ``Shuffle(len(dataset), seed, e)(i)``. The last ``len(dataset) %
    num_replicas`` positions are dropped (every rank reads as many); rank ``r`` reads positions ``start + r,
    start + r + num_replicas, ...``, where ``start`` is ``resume_samples`` in epoch ``resume_epoch`` and 0 otherwise.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(dataset, num_replicas, rank, seed)

    def __iter__(self):
        size = len(self.dataset)
        shuffle = Shuffle(size, self.seed, self.epoch)
        for positions in dealt(self._start() + self.rank, size - size % self.num_replicas, self.num_replicas):
            yield from shuffle(positions).tolist()


class InOrderSampler(DistributedSampler):
    """Validation and test across ranks: ``DistributedSampler``'s order without shuffling (each rank every
    ``num_replicas``-th sequence, the tail padded from the start so every rank runs as many batches, which FSDP's
    gathers in each forward need), computed per index. Lightning would otherwise put a ``DistributedSampler`` in,
    whose list of every index costs each rank 8 bytes a sequence at every validation; being one, this stays."""

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self):
        size = len(self.dataset)
        return ((self.rank + self.num_replicas * k) % size for k in range(self.num_samples))


class MixtureSequences(Dataset):
    """Several sources' sequences under one index: ``offsets[k] + i`` is sequence ``i`` of source ``k``."""

    def __init__(self, sources: list[PackedSequences]):
        self.sources = sources
        self.offsets = np.cumsum([0] + [len(s) for s in sources]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, flat: int) -> torch.Tensor:
        k = bisect.bisect_right(self.offsets, flat) - 1
        return self.sources[k][flat - self.offsets[k]]


def interleave_pattern(weights: list[float], length: int = PATTERN_LENGTH) -> np.ndarray:
    """Which source each of ``length`` consecutive draws comes from: every source gets its share of the
    pattern (largest remainders, at least one draw each), in a fixed shuffled order (the draws listed source by
    source, permuted by ``numpy.random.default_rng(PATTERN_SEED).permutation``). Repeated, any window of
    ``length`` draws holds exactly those counts. The shuffle is why every rank sees every source: an evenly
    spread pattern has a short period (``[1, 1]`` is ``abab...``) that lines up with the world size when rank
    ``r`` takes every ``W``-th draw, so each rank would read one source only."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.maximum(np.floor(shares * length).astype(np.int64), 1)
    while counts.sum() < length:  # largest remainders first
        counts[np.argmax(shares * length - counts)] += 1
    while counts.sum() > length:  # tiny weights rounded up to one draw: take it back from the largest
        counts[np.argmax(counts)] -= 1
    pattern = np.repeat(np.arange(len(counts)), counts)
    return np.random.default_rng(PATTERN_SEED).permutation(pattern)


class MixtureSampler(_StartsPartWay):
    """Weighted interleave of several sources, dealt out to ranks; resumable at any world size.

    Draw ``n`` of the endless mixture (epoch ``e``, position ``i``: ``n = e * len(dataset) + i``) comes from
    source ``k = pattern[n % P]``; it is that source's ``c``-th draw (``c`` counts the draws of ``k`` before ``n``,
    from 0), so sequence ``perm_{k,c // len_k}[c % len_k]`` where each pass over a source (a source epoch) has its
    own ``Shuffle`` seeded by ``(seed, k, source epoch)``; its index here is ``offsets[k]`` plus that. A source that
    runs out starts its next epoch with a new shuffle while the others go on. Positions are dealt to ranks as
    ``ResumableSampler`` deals them.
    """

    def __init__(self, dataset: MixtureSequences, weights: list[float], names: list[str], num_replicas: int = 1,
                 rank: int = 0, seed: int = 0):
        super().__init__(dataset, num_replicas, rank, seed)
        self.names = names
        self.pattern = interleave_pattern(weights)
        self.per_pattern = np.bincount(self.pattern, minlength=len(weights))
        onehot = np.eye(len(weights), dtype=np.int64)[self.pattern]
        self.before = np.cumsum(onehot, axis=0) - onehot  # [P, K]: draws of each source before each position
        self.lengths = np.array([len(s) for s in dataset.sources])

    def count(self, n, k):
        """How many of the global draws before draw ``n`` came from source ``k`` (both may be arrays)."""
        return (n // len(self.pattern)) * self.per_pattern[k] + self.before[n % len(self.pattern), k]

    def draws(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source of each global draw number ``n`` and how many draws of that source came before it."""
        k = self.pattern[n % len(self.pattern)]
        return k, self.count(n, k)

    def __iter__(self):
        size = len(self.dataset)
        end, first = size - size % self.num_replicas, self.epoch * size
        self._log_epochs(first + self._start(), first + end - 1)
        for positions in dealt(self._start() + self.rank, end, self.num_replicas):
            k, c = self.draws(first + positions)
            source_epoch, position = c // self.lengths[k], c % self.lengths[k]
            flat = np.empty_like(positions)
            for source in np.unique(k):
                of_source = k == source
                for epoch in np.unique(source_epoch[of_source]):
                    chosen = of_source & (source_epoch == epoch)
                    shuffle = Shuffle(int(self.lengths[source]), self.seed, int(source), int(epoch))
                    flat[chosen] = self.dataset.offsets[source] + shuffle(position[chosen])
            yield from flat.tolist()

    def _log_epochs(self, first: int, last: int) -> None:
        """Say which epoch of each source the draws ``first..last`` read (rank 0, once per mixture epoch)."""
        if last < first:
            return
        spans = []
        for k, name in enumerate(self.names):
            e0, e1 = (int(self.count(n, k)) // self.lengths[k] for n in (first, last))
            spans.append(f"{name} on its epoch {e0}" if e0 == e1 else f"{name} on its epochs {e0}-{e1}")
        info(f"data: mixture epoch {self.epoch} reads " + ", ".join(spans)
             + " (a source that runs out repeats with a new shuffle)")
