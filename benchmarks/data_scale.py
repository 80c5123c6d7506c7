"""Data path at scale, measured (not asserted): tokenize throughput and memory, fit start-up, loader speed.

    python benchmarks/data_scale.py                 # the docs' figures (tens of minutes, ~3 GB of disk)
    python benchmarks/data_scale.py --quick         # small sizes, a few minutes
    python benchmarks/data_scale.py --parts startup # one measurement
    python benchmarks/data_scale.py --parts memory --scale 0.2   # 10 MB vs 400 MB

1. ``throughput``: ``moe-lightning tokenize`` with a trained BPE (8k) against the plain ``tokenizers`` loops
   (``encode_batch``, and ``encode_batch_fast`` that skips offsets and that ``tokenize`` uses, over the same
   documents, read before timing starts, in 4 MiB batches, split over the same number of processes), with 1 and 2
   workers, in ``--rounds`` rounds, each in another order: tokens/s of each and the median ratios; and byte-level
   tokens/s. ``tokenize``'s rate is its own report (after its imports): it also reads and parses the JSONL, writes
   the shards, and counts end-of-document tokens (one a document, under 1 % here). Needs tokenizers >= 0.20.
2. ``memory``: ``tokenize`` peak RSS (the largest single process) on one ``.txt`` of 50 MB and of 2 GB, with
   every core: a large file is cut into byte-range units, so the two should be within 10 %.
3. ``startup``: a ``TextDataModule``'s start-up (construction to the first training batch) and peak RSS on a
   1M-sequence and a 500M-sequence token file (sparse ``.npy`` files: no disk, no writing time), seq_len 128,
   each in three fresh processes.
4. ``fit``: ``moe-lightning fit`` (2 steps of configs/tiny.yaml) wall time and peak RSS on synthetic token files
   of 100M and 400M tokens, and on two 400M-token files as a list and as a weighted mixture.
5. ``loader``: the training loader's sequences/s with 0 and 2 workers on the 400M-token file, next to the tiny
   model's training rate (sequences/s of forward + backward + AdamW on one process, one thread).

Every figure comes from a fresh process; peak RSS is ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` of a wrapper
that runs only that command (the largest of its processes, workers included).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MEASURE = ("import resource, subprocess, sys, time; start = time.perf_counter(); "
           "code = subprocess.run(sys.argv[1:]).returncode; "
           "print('MEASURED', time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)")


def measure(command: list[str], log: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB, the largest process) of ``command``, run alone in a fresh wrapper."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "a") as out:
        result = subprocess.run([sys.executable, "-c", MEASURE, *command], env=env, stdout=subprocess.PIPE,
                                stderr=out, text=True, cwd=REPO)
    line = next(line for line in result.stdout.splitlines() if line.startswith("MEASURED"))
    _, seconds, rss_kb, code = line.split()
    if code != "0":
        raise RuntimeError(f"{' '.join(command)} failed (exit {code}); see {log}")
    return float(seconds), int(rss_kb) / 1024


def text_corpus(path: Path, megabytes: float) -> Path:
    """JSONL of real text (the standard library's sources, repeated) of about ``megabytes``."""
    from moe_lightning.data.sources import stdlib_files
    documents = [p.read_text(errors="replace") for p in stdlib_files()[:400]]
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            for doc in documents:
                line = json.dumps({"text": doc}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break
    return path


def bpe(path: Path, sample: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    with open(sample) as f:
        lines = [json.loads(line)["text"] for _, line in zip(range(400), f)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def text_file(path: Path, megabytes: float) -> Path:
    """One ``.txt`` (one document) of about ``megabytes``: the standard library's sources, repeated."""
    from moe_lightning.data.sources import stdlib_files
    block = "\n".join(p.read_text(errors="replace") for p in stdlib_files()[:400]).encode()
    target = int(megabytes * 1e6)
    with open(path, "wb") as f:
        for _ in range(target // len(block)):
            f.write(block)
        f.write(block[:target % len(block)])
    return path


PLAIN_LOOP = """
import json, sys, time, os
from multiprocessing import get_context
from tokenizers import Tokenizer
os.environ["TOKENIZERS_PARALLELISM"] = "false"
tok, texts = Tokenizer.from_file(sys.argv[1]), [json.loads(line)["text"] for line in open(sys.argv[2])]
workers, encode_batch = int(sys.argv[3]), getattr(tok, sys.argv[4])
def encode(part):
    count, batch, chars = 0, [], 0
    for text in part:
        batch.append(text); chars += len(text)
        if chars >= 1 << 22:
            count += sum(len(e.ids) for e in encode_batch(batch)); batch, chars = [], 0
    return count + sum(len(e.ids) for e in encode_batch(batch))
parts = [texts[i::workers] for i in range(workers)]
start = time.perf_counter()
with get_context("fork").Pool(workers) as pool:
    tokens = sum(pool.map(encode, parts))
print("RATE", tokens / (time.perf_counter() - start))
"""


def plain_loop(tokenizer: Path, corpus: Path, workers: int, method: str) -> float:
    """Tokens/s of ``tokenizers``' own batch encoding (``method``) over the corpus's documents (read beforehand)."""
    return rate(PLAIN_LOOP, tokenizer, corpus, workers, method)


def tokenize(corpus: Path, out: Path, workers: int, log: Path, tokenizer: Path | None = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # this script's own output of an earlier run in the same --workdir
    command = [sys.executable, "-m", "moe_lightning", "tokenize", str(corpus), "--out", str(out),
               "--workers", str(workers)] + (["--tokenizer", str(tokenizer)] if tokenizer else [])
    seconds, rss = measure(command, log)
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    reported = [line for line in log.read_text().splitlines() if line.startswith("tokenize:")][-1]
    rate = int(reported.split(" tokens/s")[0].rsplit(", ", 1)[1].replace(",", ""))  # the command's own, after imports
    return {"workers": workers, "tokens": tokens, "wall_s": round(seconds, 1), "tokens_per_s": rate,
            "peak_rss_mb": round(rss)}


def token_file(path: Path, tokens: int) -> Path:
    """A synthetic byte-level token file with its sidecar, written in chunks (cheap at any size)."""
    if not path.exists():
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(tokens,))
        rng = np.random.default_rng(0)
        for start in range(0, tokens, 1 << 26):
            out[start:start + (1 << 26)] = rng.integers(0, 257, min(1 << 26, tokens - start), dtype=np.uint16)
        out.flush()
        del out
        path.with_name(path.name + ".json").write_text(json.dumps({"vocab_size": 257, "max_id": 256}))
    return path


def sparse_token_file(path: Path, tokens: int) -> Path:
    """A token file of any length that costs no disk: an ``.npy`` header, then a hole (zeros) to the length."""
    if not path.exists():
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<u2", "fortran_order": False, "shape": (tokens,)})
            f.truncate(f.tell() + 2 * tokens)
        path.with_name(path.name + ".json").write_text(json.dumps({"vocab_size": 257, "max_id": 256}))
    return path


STARTUP = """
import sys, time, json
from moe_lightning.data import TextDataModule
start = time.perf_counter()  # after the imports: what the data costs
dm = TextDataModule(json.loads(sys.argv[1]), seq_len=128, batch_size=16)
dm.setup("fit")
next(iter(dm.train_dataloader()))
print("STARTUP", time.perf_counter() - start)
"""


def data_startup(source, log: Path) -> tuple[float, float]:
    """Seconds from the DataModule's construction to the first training batch, and that process's peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", STARTUP, json.dumps(source)]
    with open(log, "a") as out:
        result = subprocess.run([sys.executable, "-c", MEASURE, *command], env=env, stdout=subprocess.PIPE,
                                stderr=out, text=True, cwd=REPO)
    lines = result.stdout.splitlines()
    startup = float(next(line for line in lines if line.startswith("STARTUP")).split()[1])
    rss = int(next(line for line in lines if line.startswith("MEASURED")).split()[2]) / 1024
    return startup, rss


def fit(source, log: Path, workdir: Path) -> dict:
    """``moe-lightning fit`` of configs/tiny.yaml for 2 steps on ``source``: wall seconds and peak RSS."""
    command = [sys.executable, "-m", "moe_lightning", "fit", "--config", str(REPO / "configs" / "tiny.yaml"),
               f"--data.init_args.source={source if isinstance(source, str) else json.dumps(source)}",
               "--trainer.max_steps=2", "--trainer.logger=false",
               "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
               "--trainer.enable_progress_bar=false"]
    seconds, rss = measure(command, log)
    startup, data_rss = data_startup(source, log)
    return {"fit_seconds": round(seconds, 1), "fit_peak_rss_mb": round(rss), "data_startup_s": round(startup, 2),
            "data_peak_rss_mb": round(data_rss)}


LOADER = """
import sys, time, json
from moe_lightning.data import TextDataModule
dm = TextDataModule(sys.argv[1], seq_len=128, batch_size=16, num_workers=int(sys.argv[2]))
dm.setup("fit")
loader = iter(dm.train_dataloader())
next(loader)
start, batches = time.perf_counter(), int(sys.argv[3])
for _ in range(batches):
    next(loader)
print("RATE", batches * 16 / (time.perf_counter() - start))
"""

TRAIN = """
import sys, time, torch, yaml
from moe_lightning import MoETransformer
from moe_lightning.planner.run_config import load_model_config
torch.manual_seed(0)
model = MoETransformer(load_model_config(sys.argv[1]))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 257, (16, 129))
def step():
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step(); optimizer.zero_grad()
step()
start, steps = time.perf_counter(), int(sys.argv[2])
for _ in range(steps):
    step()
print("RATE", steps * 16 / (time.perf_counter() - start))
"""


def rate(script: str, *args) -> float:
    # one thread: on a shared, oversubscribed machine two OpenMP threads per process ran the tiny model 18x slower
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                         cwd=REPO)
    line = next((line for line in out.stdout.splitlines() if line.startswith("RATE")), None)
    if line is None:
        raise RuntimeError(out.stderr[-2000:])
    return float(line.split()[1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: check the script, not the figures")
    parser.add_argument("--scale", type=float, default=None, help="multiply the corpus sizes (--quick: 0.02)")
    parser.add_argument("--workdir", default=None, help="where corpora go (default: a temporary folder)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=5, choices=range(1, 100), metavar="1..99",
                        help="rounds of each throughput comparison")
    parts = ["throughput", "memory", "startup", "fit", "loader"]
    parser.add_argument("--parts", nargs="+", default=parts, choices=parts, help="which measurements (default: all)")
    args = parser.parse_args(argv)
    scale = args.scale or (0.02 if args.quick else 1.0)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="data_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    report = {"cpus": os.cpu_count(), "workdir": str(work), "load_average_at_start": os.getloadavg()}

    def show(name, value):
        report[name] = value
        print(json.dumps({name: value}), flush=True)

    if "throughput" in args.parts:  # 1. tokenize against the plain tokenizers loop, 1 and 2 workers
        corpus = text_corpus(work / "text.jsonl", 60 * scale)
        tok = bpe(work / "bpe.json", corpus)
        small_corpus = text_corpus(work / "text_small.jsonl", 30 * scale)  # BPE is ~50x slower than bytes
        for workers in (1, 2):  # alternated rounds: one run of either varied by 20-50 % on a quiet machine
            rounds = []
            for r in range(args.rounds):
                runs = {"ours": lambda: tokenize(small_corpus, work / f"tp_bpe_{workers}", workers, log, tok),
                        "encode_batch": lambda: plain_loop(tok, small_corpus, workers, "encode_batch"),
                        "encode_batch_fast": lambda: plain_loop(tok, small_corpus, workers, "encode_batch_fast")}
                names = list(runs)[r % 3:] + list(runs)[:r % 3]  # each round starts with another
                measured = {name: runs[name]() for name in names}
                ours = measured["ours"]
                rounds.append((ours["tokens_per_s"], round(measured["encode_batch"]),
                               round(measured["encode_batch_fast"])))
            show(f"tokenize_bpe8k_{workers}_workers", {
                **ours, "rounds_ours_encode_batch_encode_batch_fast_tokens_per_s": rounds,
                "median_ratio_to_encode_batch": round(statistics.median(o / p for o, p, _ in rounds), 3),
                "median_ratio_to_encode_batch_fast": round(statistics.median(o / f for o, _, f in rounds), 3)})
        show("tokenize_bytes", [tokenize(corpus, work / f"tp_bytes_{w}", w, log) for w in sorted({1, args.workers})])
    if "memory" in args.parts:  # 2. one .txt of 50 MB and of 2 GB: the same memory
        for megabytes in (50, 2000):
            sized = text_file(work / f"text_{megabytes}.txt", megabytes * scale)
            show(f"tokenize_rss_{megabytes}mb_txt", tokenize(sized, work / f"rss_{megabytes}", args.workers, log))
            shutil.rmtree(work / f"rss_{megabytes}")
            sized.unlink()
    if "startup" in args.parts:  # 3. data start-up at 1M and 500M sequences of 128 (sparse files)
        for sequences in (1_000_000, 500_000_000):
            path = sparse_token_file(work / f"sparse_{sequences}.npy", sequences * 128 + 1)
            runs = [data_startup(str(path), log) for _ in range(3)]  # fresh processes: milliseconds vary
            show(f"startup_{sequences}_sequences", {"startup_ms_of_3_runs": [round(s * 1000, 1) for s, _ in runs],
                                                     "peak_rss_mb": [round(rss) for _, rss in runs]})
    small, large = (work / f"tokens_{n}.npy" for n in (100, 400))
    if "fit" in args.parts:  # 4. fit start-up and memory
        small, large = (token_file(work / f"tokens_{n}.npy", int(n * 1e6 * scale)) for n in (100, 400))
        large2 = token_file(work / "tokens_400b.npy", int(400e6 * scale))
        show("fit_one_file_100M", fit(str(small), log, work))
        show("fit_one_file_400M", fit(str(large), log, work))
        show("fit_list_of_two_400M", fit([str(large), str(large2)], log, work))
        show("fit_mixture_of_two_400M", fit([{"path": str(large), "weight": 3}, {"path": str(large2), "weight": 1}],
                                            log, work))
    if "loader" in args.parts:  # 5. loader vs model
        large = token_file(large, int(400e6 * scale))
        batches = 50 if args.quick else 400
        show("loader_sequences_per_s", {w: round(rate(LOADER, large, w, batches)) for w in (0, 2)})
        show("tiny_model_train_sequences_per_s", round(rate(TRAIN, REPO / "configs" / "tiny.yaml", 5), 1))
    show("load_average_at_end", os.getloadavg())
    return report


if __name__ == "__main__":
    main()
