"""Count collective calls and their payload bytes (tests of communication patterns)."""

import functools
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

# FSDP2 and the expert-parallel dispatcher call these through the ``torch.distributed`` namespace.
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_reduce", "all_to_all_single", "broadcast")


class CollectiveCounter:
    """``calls[name]`` and ``bytes[name]``: the payload is the largest tensor argument (what one rank sends
    or receives: the gathered output of an all-gather, the full input of a reduce-scatter)."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.calls), dict(self.bytes)

    @contextmanager
    def installed(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name, fn):
            @functools.wraps(fn)
            def counted(*args, **kwargs):
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                self.calls[name] += 1
                self.bytes[name] += max((t.numel() * t.element_size() for t in tensors), default=0)
                return fn(*args, **kwargs)
            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def recorded_schedule(monkeypatch, events: list[str], describe=lambda rows: str(rows.shape[0])) -> None:
    """Record in ``events`` the order of the token exchanges: a blocking ``all_to_all_single`` (the split sizes) as
    ``counts``, an asynchronous one as ``launch <describe(its input)>`` and, when awaited, ``wait <its rows>``."""
    launch = dist.all_to_all_single

    class Work:
        def __init__(self, work, rows):
            self.work, self.rows = work, rows

        def wait(self):
            events.append(f"wait {self.rows}")
            return self.work.wait()

    def recorded(output, input, *args, async_op=False, **kwargs):
        work = launch(output, input, *args, async_op=async_op, **kwargs)
        if not async_op:
            events.append("counts")
            return work
        events.append(f"launch {describe(input)}")
        return Work(work, input.shape[0])

    monkeypatch.setattr(dist, "all_to_all_single", recorded)
