"""``TextDataModule``: the face users name in YAML. Sources → token streams → sequences → resumable loaders."""

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import ConcatDataset, DataLoader, SequentialSampler

from moe_lightning.checkpoint.compat import check_order, check_position
from moe_lightning.data.tokenizer import load_tokenizer, tokenizer_identity
from moe_lightning.data.sampling import (InOrderSampler, MixtureSampler, MixtureSequences, PackedSequences, ResumableSampler,
                       split_indices)
from moe_lightning.data.sources import is_token_source, parse_sources, resolve_source
from moe_lightning.data.tokens import TokenStream, open_shard_folder, open_tokens
from moe_lightning.run.console import info

ORDER = "feistel-v1"  # the shuffle (sampling.Shuffle): a position is a position in this order only


class ResumableLoader(DataLoader):
    """The training loader, stateful for Lightning: its ``state_dict`` is the position in the global order
    (asked of the DataModule, which counts what the trainer consumed, not what workers prefetched), and
    ``load_state_dict`` starts the sampler there. Lightning saves it in the checkpoint and, seeing a stateful
    loader, knows a mid-epoch resume is exact (no "dataloader is not resumable" warning)."""

    def __init__(self, *args, position: Callable[[], dict], restore: Callable[[dict], tuple[int, int]], **kwargs):
        self.position, self.restore = position, restore
        super().__init__(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.position()

    def load_state_dict(self, state_dict: dict) -> None:
        self.sampler.resume_epoch, self.sampler.resume_samples = self.restore(state_dict)


class SourceLoader(DataLoader):
    """A validation loader that names its source (``val/loss/<name>`` in the logs)."""

    def __init__(self, *args, name: str, **kwargs):
        self.name = name
        super().__init__(*args, **kwargs)


class TextDataModule(L.LightningDataModule):
    """Packs tokenized text into ``seq_len + 1`` windows; a resumable sampler splits them by rank.

    Checkpoints record how many training samples of the current epoch all ranks consumed together,
    so resuming (even at another world size with the same global batch) continues the same order.

    Args:
        source: ``stdlib``, a file, folder, glob, ``.jsonl``, Parquet/Arrow file or folder, ``.npy`` token file,
            or a shard folder written by ``moe-lightning tokenize``; or a list of these (read as one corpus); or
            a weighted mixture, a list of ``{path: ..., weight: ..., name: ...}`` (each source keeps its own
            held-out split and logs ``val/loss/<name>``).
        seq_len: Tokens per training sequence (targets are the next tokens).
        batch_size: Sequences per micro-batch on each device.
        val_fraction: Share of sequences held out for validation (of each source in a mixture).
        tokenizer: Path to a ``tokenizers`` JSON file; ``None`` for byte-level tokens.
        text_field: JSONL field or Parquet/Arrow column holding the text.
        max_tokens: Read at most this many tokens (of each source in a mixture).
        num_workers: DataLoader worker processes.
        shuffle_seed: Seed of the per-epoch shuffle of training sequences.
    """

    def __init__(self, source: str | list[str | dict[str, Any]] = "stdlib", seq_len: int = 256,
                 batch_size: int = 16, val_fraction: float = 0.05, tokenizer: str | None = None,
                 text_field: str = "text", max_tokens: int | None = None, num_workers: int = 0,
                 shuffle_seed: int = 0):
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"data.seq_len={seq_len} and data.batch_size={batch_size} must be positive.")
        if not 0 < val_fraction <= 0.5:
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 0.5].")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"data.max_tokens={max_tokens} must be positive (or null for everything).")
        self.entries, self.is_mixture = parse_sources(source)
        self.sources = [e["path"] for e in self.entries]
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.text_field, self.max_tokens, self.num_workers = text_field, max_tokens, num_workers
        self.shuffle_seed, self.tokenizer_path = shuffle_seed, tokenizer
        self.prepare_data_per_node = False  # text is tokenized once, by global rank 0, into the run's folder
        self._resume_position: tuple[int, int] | None = None  # (epoch, samples consumed by all ranks)
        self.tokenizer = load_tokenizer(tokenizer)
        # fail now, not after the model is built: paths resolve, token files' headers and manifests are checked
        self.resolved = [resolve_source(s) for s in self.sources]
        self._opened = {i: open_tokens(r, self.tokenizer, text_field, None)
                        for i, r in enumerate(self.resolved) if is_token_source(r)}
        self.train_set: PackedSequences | MixtureSequences | None = None
        self.val_set: PackedSequences | None = None
        self.val_sets: list[PackedSequences] = []

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _parts(self, i: int, budget: int | None):
        if i in self._opened:
            return self._opened[i]
        folder = self._tokenized_folder(i)
        if folder is not None and folder.joinpath("manifest.json").is_file():
            parts = open_shard_folder(folder, self.tokenizer)
            return parts, len(self.resolved[i])
        if folder is not None and self.trainer.global_rank != 0:  # rank 0 wrote it where this node cannot see
            raise ValueError(f"data.source={self.entries[i]['path']!r}: global rank {self.trainer.global_rank} finds "
                             f"no tokenized corpus in {folder}, which global rank 0 wrote: put trainer.logger's "
                             "save_dir on a file system every node shares.")
        return open_tokens(self.resolved[i], self.tokenizer, self.text_field, budget)

    def _tokenized_folder(self, i: int) -> Path | None:
        """Where text source ``i`` is tokenized for a run that logs: ``<logger root>/tokenized/<name>-<key>``,
        keyed by the files (paths, sizes, times), the tokenizer and the field, so a restart reuses it and
        changed text gets a new folder. ``None`` (tokenized in memory by each process, as without a trainer)
        for token sources, runs without a logger (nothing written), and ``max_tokens`` (stops tokenizing early)."""
        logger = self.trainer.logger if self.trainer is not None else None
        if logger is None or is_token_source(self.resolved[i]) or self.max_tokens is not None:
            return None
        from moe_lightning.data.tokenize.reading import describe_inputs
        key = json.dumps([describe_inputs(self.resolved[i]), tokenizer_identity(self.tokenizer.spec()), self.text_field])
        root = Path(getattr(logger, "root_dir", None) or logger.save_dir or self.trainer.default_root_dir)
        return root / "tokenized" / f"{self.entries[i]['name']}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def awaits_tokenizing(self) -> bool:
        """Whether a text source has a run folder still without its manifest (``prepare_data`` writes it): set up
        now, every rank would tokenize that whole corpus in memory just to describe it."""
        return any((folder := self._tokenized_folder(i)) is not None and not (folder / "manifest.json").is_file()
                   for i in range(len(self.entries)))

    def prepare_data(self) -> None:
        """Global rank 0 tokenizes text sources into the run's folder on every core (Lightning holds the other
        ranks at a barrier without a timeout); every rank then memory-maps the shards instead of tokenizing."""
        from moe_lightning.run.exits import Preempted
        from moe_lightning.data.tokenize.errors import Stopped, TokenizeError
        from moe_lightning.data.tokenize.folder import tokenize_to_folder
        for i, entry in enumerate(self.entries):
            folder = self._tokenized_folder(i)
            if folder is None:
                continue
            try:
                tokenize_to_folder([entry["path"]], str(folder), self.tokenizer_path, self.text_field,
                                   resume=True, num_tasks=1, task_index=0, wait=True)
            except Stopped as stop:
                raise Preempted(stop.exit_code, "preempted before the first step: nothing to save (tokenized "
                                                "units kept)") from None
            except TokenizeError as error:  # worded for tokenize's command line: keep what applies to fit
                said = str(error).removeprefix("tokenize --resume: ").removeprefix("tokenize: ").rstrip(".")
                kept = ("; ".join(c for c in sentence.split("; ") if "--resume" not in c) for sentence in
                        said.split(". "))  # the advice to rerun tokenize goes, the cause stays
                raise ValueError(f"data.source={entry['path']!r}: tokenizing it into {folder} failed: "
                                 f"{'. '.join(k for k in kept if k)}; fix that and start the run again (finished "
                                 "units are reused).") from None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            (self._setup_mixture if self.is_mixture else self._setup_corpus)()
        if stage == "fit":
            self._check_enough_for_fit()

    def _setup_corpus(self) -> None:
        """One corpus, as if every source were concatenated (read lazily, never concatenated)."""
        parts, files_read, count = [], 0, 0
        for i in range(len(self.sources)):
            budget = None if self.max_tokens is None else self.max_tokens - count
            source_parts, files = self._parts(i, budget)
            parts, files_read, count = parts + source_parts, files_read + files, count + sum(p.length for p in source_parts)
            if self.max_tokens is not None and count >= self.max_tokens:
                break
        tokens = TokenStream(parts, limit=self.max_tokens)
        num_sequences = (len(tokens) - 1) // self.seq_len
        if num_sequences < 2:
            raise ValueError(f"data.source={self.sources}: only {len(tokens)} tokens, fewer than two sequences "
                             f"of seq_len={self.seq_len}; add text or lower data.seq_len.")
        train_idx, val_idx = split_indices(num_sequences, self.val_fraction)
        self.train_set = PackedSequences(tokens, self.seq_len, train_idx)
        self.val_set = PackedSequences(tokens, self.seq_len, val_idx)
        self.val_sets = [self.val_set]
        info(f"data: {files_read:,} file(s), {len(tokens):,} tokens -> {len(train_idx):,} train / "
             f"{len(val_idx):,} validation sequences of {self.seq_len} tokens")

    def _setup_mixture(self) -> None:
        """A weighted mixture: each source its own sequences and held-out split."""
        trains, total = [], sum(e["weight"] for e in self.entries)
        for i, entry in enumerate(self.entries):
            tokens = TokenStream(self._parts(i, self.max_tokens)[0], limit=self.max_tokens)
            num_sequences = (len(tokens) - 1) // self.seq_len
            if num_sequences < 2:
                raise ValueError(f"data.source[{i}] ({entry['path']!r}): only {len(tokens)} tokens, fewer than two "
                                 f"sequences of seq_len={self.seq_len}; add text, drop the source, or lower "
                                 "data.seq_len.")
            train_idx, val_idx = split_indices(num_sequences, self.val_fraction)
            trains.append(PackedSequences(tokens, self.seq_len, train_idx))
            self.val_sets.append(PackedSequences(tokens, self.seq_len, val_idx))
            info(f"data: source {entry['name']} (weight {entry['weight']:g}, {100 * entry['weight'] / total:.1f} % "
                 f"of training sequences): {len(tokens):,} tokens -> {len(train_idx):,} train / {len(val_idx):,} "
                 f"validation sequences of {self.seq_len} tokens")
        self.train_set = MixtureSequences(trains)
        self.val_set = ConcatDataset(self.val_sets)

    def _check_enough_for_fit(self) -> None:
        """Refuse a dataset that makes no training batch (Lightning would exit 0 saying "No training batches"),
        or no validation batch while validation is on (it would silently skip validation)."""
        ranks = self._sampler_kwargs()["num_replicas"]
        if len(self.train_set) // ranks < self.batch_size:
            raise ValueError(f"data: {len(self.train_set)} training sequences of seq_len={self.seq_len} make no batch "
                             f"of data.batch_size={self.batch_size} on each of {ranks} process(es) (need "
                             f"{self.batch_size * ranks}): add text, or lower data.batch_size or data.seq_len.")
        validating = self.trainer is not None and self.trainer.limit_val_batches != 0
        for entry, val_set in zip(self.entries if self.is_mixture else [None], self.val_sets):
            if validating and len(val_set) == 0:
                which = f"source {entry['name']!r} has" if entry else "there is"
                raise ValueError(f"data: {which} no validation sequence (every "
                                 f"{max(2, round(1 / self.val_fraction))}th sequence is held out): add text, raise "
                                 "data.val_fraction, or turn validation off with trainer.limit_val_batches=0.")

    def _sampler_kwargs(self) -> dict:
        strategy = self.trainer.strategy if self.trainer is not None else None
        return getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}

    def _mixture_signature(self) -> list | None:
        return [[e["name"], e["weight"], len(s)] for e, s in zip(self.entries, self.train_set.sources)] \
            if self.is_mixture else None

    def description(self) -> dict:
        """What a position in the training order is a position in (saved with it; ``compat.check_checkpoint``
        refuses to resume it in another): the sources, their sequence counts, seq_len, the shuffle, and the tokens
        of the first and last training sequence."""
        ends = [self.train_set[i].numpy().tobytes() for i in (0, len(self.train_set) - 1)]
        return {"mixture": self._mixture_signature(), "seq_len": self.seq_len, "shuffle_seed": self.shuffle_seed,
                "order": ORDER,
                "train_sequences": len(self.train_set), "fingerprint": hashlib.sha256(b"".join(ends)).hexdigest()[:16]}

    def train_dataloader(self) -> DataLoader:
        kwargs = dict(seed=self.shuffle_seed, **self._sampler_kwargs())
        if self.is_mixture:
            sampler = MixtureSampler(self.train_set, [e["weight"] for e in self.entries],
                                     [e["name"] for e in self.entries], **kwargs)
        else:
            sampler = ResumableSampler(self.train_set, **kwargs)
        if self._resume_position is not None:  # a checkpoint written before the loader carried the position
            sampler.resume_epoch, sampler.resume_samples = self._resume_position
            self._resume_position = None
        return ResumableLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                               num_workers=self.num_workers, position=self._position, restore=self._restore)

    def _position(self) -> dict:
        """Batches processed this epoch x the global batch (valid at any world size) and the mixture it is in."""
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        global_batch = self.batch_size * self._sampler_kwargs()["num_replicas"]
        return {"epoch": self.trainer.current_epoch, "samples": processed * global_batch, **self.description()}

    def _restore(self, state: dict) -> tuple[int, int]:
        check_position(state, self.description())  # the backup of the CLI's guard, for Python users
        return state["epoch"], state["samples"]

    def state_dict(self) -> dict:
        """The tokenizer, so ``generate`` and ``export`` use the run's own without being told (the training
        position travels with the loader's state, see ``ResumableLoader``)."""
        return {"tokenizer": self.tokenizer.spec()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "epoch" in state_dict:  # written before the loader carried the position (and before ORDER)
            check_order(state_dict, None)
            self._resume_position = (state_dict["epoch"], state_dict["samples"])

    def _in_order(self, held_out: PackedSequences, loader: type[DataLoader] = DataLoader, **named) -> DataLoader:
        """The ranks split it as torch's ``DistributedSampler`` would, per index (one process too: under a
        distributed strategy Lightning would replace a ``SequentialSampler``); ``overfit_batches`` expects one."""
        overfit = getattr(self.trainer, "overfit_batches", 0) if self.trainer is not None else 0
        sampler = SequentialSampler(held_out) if overfit else InOrderSampler(held_out, **self._sampler_kwargs())
        return loader(held_out, batch_size=self.batch_size, num_workers=self.num_workers, sampler=sampler, **named)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        if not self.is_mixture:
            return self._in_order(self.val_set)
        return [self._in_order(val_set, SourceLoader, name=entry["name"])
                for entry, val_set in zip(self.entries, self.val_sets)]

    def test_dataloader(self) -> DataLoader:
        """The held-out split (of ``source``: point it at other text to score that text's held-out share)."""
        return self._in_order(self.val_set)
