"""Host syncs in a profiler trace: every blocking CUDA call of a step, named by the code that made it.

Read from the Chrome trace ``torch.profiler.profile(with_stack=True).export_chrome_trace`` writes (the same file
on a GPU and in the tests, which parse a recorded one: ``tests/benchmarks/fixtures/``). A blocking call is a CUDA
runtime or driver event named in ``SYNC_CALLS``; ``cudaFree`` is among them because the caching allocator calls it
when an allocation fails and it frees its cache to retry (an allocator retry), and it waits for the whole device.
A benchmark's own synchronisations (its timing window's bounds, inside Lightning's callback hooks) are named
``OWN + frame`` so the step's count can leave them out: those whose innermost frame of our code (a benchmark's,
this package's or Lightning's) is a benchmark's ``benchmarks/gpu_*.py``.
"""

import json
from pathlib import Path

SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                        "cudaMemcpy2D", "cudaFree", "cudaFreeHost"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
ENCLOSING_CATEGORIES = frozenset({"python_function", "cpu_op", "user_annotation"})
PREFERRED_PACKAGES = ("moe_lightning/", "lightning/")  # the frame that names a site: ours, else Lightning's
OWN = "benchmark's own: "


def is_benchmark_frame(frame: str) -> bool:
    """A frame of ``benchmarks/gpu_*.py``; the profiler names files relative to the sys.path entry that holds
    them, and the parts put ``benchmarks/`` first on it: ``gpu_recipe.py(157): on_train_batch_end``."""
    path = frame.split("(")[0]
    return path.rsplit("/", 1)[-1].startswith("gpu_") and ("/" not in path or "benchmarks/gpu_" in path)


def load_trace(path: str | Path) -> list[dict]:
    """The complete (``"ph": "X"``) events of a Chrome trace file."""
    with open(path) as f:
        return [event for event in json.load(f)["traceEvents"] if event.get("ph") == "X"]


def _site(enclosing: list[dict]) -> str:
    """The innermost enclosing Python frame of this package, else of Lightning, else any frame, else the
    innermost operator; ``enclosing`` is ordered outermost first."""
    frames = [e["name"] for e in reversed(enclosing) if e.get("cat") == "python_function"]
    ours = next((frame for frame in frames if is_benchmark_frame(frame)
                 or any(frame.startswith(p) or f"/{p}" in frame for p in PREFERRED_PACKAGES)), None)
    if ours is not None and is_benchmark_frame(ours):
        return OWN + ours
    for package in PREFERRED_PACKAGES:
        for frame in frames:
            if frame.startswith(package) or f"/{package}" in frame:
                return frame[frame.index(package):]
    if frames:
        return frames[0]
    return enclosing[-1]["name"] if enclosing else "unknown"


def sync_sites(events: list[dict]) -> list[str]:
    """One entry per blocking CUDA call among ``events``, in time order, named by ``_site`` of what encloses it on
    its thread (one sweep per thread: events sorted by start, a stack of the open ones)."""
    threads: dict[tuple, list[dict]] = {}
    for event in events:
        if event.get("cat") in ENCLOSING_CATEGORIES or (
                event.get("cat") in RUNTIME_CATEGORIES and event.get("name") in SYNC_CALLS):
            threads.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    found: list[tuple[float, str]] = []
    for thread in threads.values():
        thread.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # a parent before the child starting with it
        stack: list[dict] = []
        for event in thread:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < event["ts"]:
                stack.pop()
            if event.get("cat") in RUNTIME_CATEGORIES:
                found.append((event["ts"], _site(stack)))
            else:
                stack.append(event)
    return [site for _, site in sorted(found)]
