"""``moe-lightning tokenize``: a corpus of any size → a folder of ``.npy`` token shards and a manifest, on every core
and, as a scheduler's array of tasks, on many nodes.

The input is cut once into units of work, recorded in the folder's plan: spans of the corpus in order, cutting
large text and JSONL files by byte range (between words, between lines), Parquet files by row group and Arrow
files by record batch, and grouping small files. Each worker process tokenizes one unit at a time in bounded
batches and streams it into its own shards, so memory stays flat whatever the file sizes. Every file is written
through ``durable.atomic_write``; a unit's record follows its shards; the manifest, the only file ``fit`` reads
(its size does not grow with the number of input files), is written last, by whichever task finishes last.
``--resume`` reruns only the units without a record, after checking the arguments and inputs against the plan.
Nothing here imports torch or Lightning.

- ``reading``: a unit's text read in corpus order and encoded in bounded batches (also what ``fit`` uses to
  tokenize a small corpus in memory, and to key a run's tokenized folder);
- ``plan``: the corpus cut once into units, and the check that a resumed run is the same job;
- ``files``: what is written (``.npy`` shards streamed, unit records, the manifest, JSON an item a line, the
  single ``.npy`` of a small corpus);
- ``workers``: the process pool, its progress, and stopping it at the first failure or signal;
- ``tasks``: which share of the units this task of a SLURM array (or torchrun) takes;
- ``folder``: ``tokenize_to_folder``, the library function (``fit`` calls it for text sources);
- ``command``: ``moe-lightning tokenize``'s argument parsing and one-line errors.
"""
