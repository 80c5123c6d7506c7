"""Muon for hidden matrices and AdamW for the rest, in one optimizer (Lightning's automatic
optimization steps exactly one), with FlexShard placement under FSDP2."""

import math
from functools import partial
from collections.abc import Iterable
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

from moe_lightning.optim.host_staging import HostStagedNS
from moe_lightning.optim.flexshard import (RowExchange, check_trainable_agree, classify, comm_device, local_rows,
                        plan_shard_groups)
from moe_lightning.optim.muon_groups import split_by_algorithm
from moe_lightning.optim.newton_schulz import coefficient_schedule, newton_schulz, ns_dtype_for
from moe_lightning.run.console import info


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor (in-place ops on it update the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def lr_scale(shape: torch.Size, adjust_lr_fn: str) -> float:
    """Per-matrix multiplier of the learning rate, from the (global) ``[.., m, n]`` shape."""
    m, n = shape[-2], shape[-1]
    return math.sqrt(max(1.0, m / n)) if adjust_lr_fn == "original" else 0.2 * math.sqrt(max(m, n))


def _training_on_cuda() -> bool:
    """A GPU run (NCCL process group, or CUDA in use without one), as opposed to CPU training on a GPU host."""
    if not torch.cuda.is_available():
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "nccl" in str(torch.distributed.get_backend())
    return torch.cuda.is_initialized()


class Muon(torch.optim.Optimizer):
    """Muon (momentum → Newton–Schulz orthogonalization) on hidden matrices, AdamW on everything else.

    Groups from ``moe_lightning.optim.param_groups`` are split by role (``hidden_matrix`` and
    ``expert_stack`` → Muon, others → AdamW) unless a name pattern says otherwise. Expert stacks
    ``[E, m, n]`` are orthogonalized per expert in one batched iteration. FSDP2 DTensor parameters
    are handled by FlexShard placement (see ``flexshard``); Newton–Schulz runs on ``ns_device``.

    Args:
        params: Parameters or groups (``role``/``param_names``/``weight_decay`` keys are honoured).
        lr: Muon learning rate; with ``adjust_lr_fn="match_rms_adamw"`` an AdamW learning rate works.
        momentum: Momentum coefficient of the gradient average.
        nesterov: Orthogonalize the Nesterov look-ahead instead of the momentum buffer.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: ``"quintic"`` (3.4445, -4.7750, 2.0315 every step), ``"polar_express"`` (a
            per-step schedule), or a list of ``[a, b, c]`` triples, one per step (the last repeats).
        adjust_lr_fn: ``"original"``: scale by sqrt(max(1, m/n)); ``"match_rms_adamw"``: by
            0.2·sqrt(max(m, n)) so updates have AdamW's RMS and AdamW hyperparameters transfer.
        weight_decay: Decoupled weight decay for groups that do not set their own.
        eps: Floor of the Frobenius norm Newton–Schulz divides by.
        adamw_lr: Learning rate of the AdamW groups; ``None`` uses ``lr``.
        adamw_betas: AdamW (beta1, beta2).
        adamw_eps: AdamW denominator epsilon.
        muon_patterns: ``fnmatch`` globs of parameter names forced to Muon (matrices or stacks only).
        adamw_patterns: ``fnmatch`` globs of parameter names forced to AdamW.
        ns_device: Where Newton–Schulz runs; ``None``: the parameter's device, except that host-resident
            parameters of a GPU run (FSDP CPU offload) are orthogonalized on the current CUDA device (their
            copies staged and overlapped, ``host_staging``).
        ns_dtype: Newton–Schulz precision: ``"auto"`` (bf16 on GPUs and on CPUs with bf16 units, fp32 on other
            CPUs, where bf16 matmuls are emulated ~100x slower; said once in the log), ``"bfloat16"`` (the
            operations of ``torch.optim.Muon``) or ``"float32"``. Row-sharded matrices travel in it too.
    """

    def __init__(self, params: Iterable, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_coefficients: str | list[list[float]] = "quintic",
                 adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw",
                 weight_decay: float = 0.1, eps: float = 1e-7, adamw_lr: float | None = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 muon_patterns: list[str] | None = None, adamw_patterns: list[str] | None = None,
                 ns_device: str | None = None, ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"):
        for field, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps), ("adamw_eps", adamw_eps)):
            if value < 0:
                raise ValueError(f"Muon.{field}={value} must be >= 0.")
        if not 0 <= momentum < 1 or not all(0 <= b < 1 for b in adamw_betas):
            raise ValueError(f"Muon.momentum={momentum} and adamw_betas={adamw_betas} must lie in [0, 1).")
        if adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Muon.adjust_lr_fn={adjust_lr_fn!r}: use 'original' or 'match_rms_adamw'.")
        if ns_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"Muon.ns_dtype={ns_dtype!r}: use 'auto', 'bfloat16' or 'float32'.")
        coefficient_schedule(ns_coefficients, ns_steps)  # validate now, not at the first step
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        groups = split_by_algorithm(groups, muon_patterns or (), adamw_patterns or ())
        for group in groups:
            if group["algorithm"] == "adamw" and adamw_lr is not None:
                group.setdefault("lr", adamw_lr)
            if group["algorithm"] == "muon":
                bad = [tuple(p.shape) for p in group["params"] if p.ndim not in (2, 3)]
                if bad:
                    raise ValueError(f"Muon group {group.get('param_names', '')} holds non-matrix shapes {bad}: "
                                     f"Muon orthogonalizes [m, n] or [E, m, n]; send them to AdamW.")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay,
                        eps=eps, betas=tuple(adamw_betas), adamw_eps=adamw_eps)
        super().__init__(groups, defaults)
        self.ns_device = torch.device(ns_device) if ns_device else None
        self.ns_dtype = ns_dtype
        self._ns_dtypes: dict[torch.device, torch.dtype] = {}
        self._plan = None
        self._exchange_cache = None
        self._staging: HostStagedNS | None = None
        # The ranks that train the same parameters as this one (None: every rank); set by a strategy whose ranks
        # train different ones (MoEFSDPStrategy: a pipeline stage's ranks). FlexShard's check agrees over them.
        self.trainers_group: torch.distributed.ProcessGroup | None = None
        # None: stage where the state and Newton–Schulz live on different devices; False: the serial blocking path
        # (benchmarks/muon_gpu_step.py compares); True: always (CPU tests of the schedule, with stand-in streams)
        self.stage_host_copies: bool | None = None

    def _compute_device(self, like: torch.Tensor) -> torch.device:
        if self.ns_device is not None:
            return self.ns_device
        if like.device.type == "cpu" and _training_on_cuda():  # FSDP CPU offload: NS still on the GPU
            return torch.device("cuda", torch.cuda.current_device())
        return like.device

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        """``ns_dtype`` resolved for ``device``; the first time, the log says which and why."""
        if device not in self._ns_dtypes:
            dtype = self._ns_dtypes[device] = ns_dtype_for(device, self.ns_dtype)
            why = "as set (ns_dtype)" if self.ns_dtype != "auto" else (
                "this CPU has no bf16 matmul units (ns_dtype: bfloat16 forces it)" if dtype == torch.float32
                else "bf16 matmuls are fast here")
            info(f"Muon: Newton–Schulz runs in {str(dtype).removeprefix('torch.')} on {device}: {why}.")
        return self._ns_dtypes[device]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = [(g, p) for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"] if p.requires_grad]
        finish_muon = self._muon_step(muon) if muon else None
        for group in self.param_groups:  # while the scatters are in flight
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        if finish_muon is not None:
            finish_muon()
        return loss

    def _muon_step(self, muon: list[tuple[dict, torch.Tensor]]):
        """Momentum on local shards; start row exchanges; local NS meanwhile; NS of owned matrices; start
        the scatters. Returns the function that waits for them and applies the row-sharded updates.

        ``muon`` holds every trainable Muon parameter, with or without a gradient: the row exchanges are planned
        from all of them, identically on every rank. A parameter without a gradient here is skipped if it is
        orthogonalized locally; if it is row-sharded its gradient counts as zero, and the step is applied only
        if some rank had one (``RowExchange``'s flags)."""
        if self.stage_host_copies:  # before any state changes
            where = sorted({str(_local(p).device) for _, p in muon} - {"cpu"})
            if where:
                raise ValueError(f"Muon.stage_host_copies=True stages host-resident parameters (FSDP cpu_offload) "
                                 f"through pinned buffers, but some live on {where}: leave stage_host_copies at None "
                                 f"(stages exactly when the parameters are on the host and Newton–Schulz is not) or "
                                 f"set it to False.")
        device = self._compute_device(_local(muon[0][1]))
        dtype = self._ns_dtype(device)
        exchanges = self._exchanges(muon, device, dtype)
        sharded = {i for ex in exchanges for i, _ in ex.sg.indices}
        present = [p.grad is not None for _, p in muon]
        pending = {}  # row-sharded parameters without a gradient: their momentum buffer after this step
        updates = {}
        for i in sorted(sharded):
            group, p = muon[i]
            if present[i]:
                updates[i] = self._momentum_update(group, p)
            else:
                pending[i], updates[i] = self._momentum_without_grad(group, p)
        for ex in exchanges:
            ex.start_gather([updates[i] if e is None else updates[i][e] for i, e in ex.sg.indices],
                            [present[i] for i, _ in ex.sg.indices])
        schedules = {id(g): self._schedule(g) for g, _ in muon}  # once per group, not per matrix
        local = [muon[i] for i in range(len(muon)) if i not in sharded and present[i]]
        ns = [partial(newton_schulz, schedule=schedules[id(g)], eps=g["eps"], dtype=dtype) for g, _ in local]
        self._local_newton_schulz(local, ns, device)
        for ex in exchanges:  # NS of every owned matrix first, so all scatters are in flight together
            groups = [muon[ex.sg.indices[k][0]][0] for k in ex.mine]
            ex.start_scatter([newton_schulz(G_MN.to(device), schedules[id(group)], group["eps"], dtype)
                              for G_MN, group in zip(ex.owned_matrices(), groups)])

        def finish():
            for ex, received in zip(exchanges, local_rows(exchanges)):
                rows: dict[int, list[torch.Tensor]] = {}
                anyone: dict[int, torch.Tensor] = {}  # some rank had a gradient (0-d, 1 or 0)
                for (i, _), (O_rN, flag) in zip(ex.sg.indices, received):
                    rows.setdefault(i, []).append(O_rN)
                    anyone[i] = flag
                for i, O in rows.items():  # an expert stack's experts come back in order: restack them
                    group, p = muon[i]
                    if i in pending:  # no gradient here: the momentum step counts only if some rank had one
                        buffer = _local(self.state[p]["momentum_buffer"])
                        buffer.copy_(torch.where(anyone[i].to(buffer.device) > 0, pending[i], buffer))
                    self._apply(group, p, torch.stack(O) if p.ndim == 3 else O[0], anyone[i] if i in pending else None)
        return finish

    def _local_newton_schulz(self, local: list[tuple[dict, torch.Tensor]], ns: list, device: torch.device) -> None:
        """Momentum update, ``ns[i]`` on ``device`` and the step, for each ``(group, parameter)``, in order.
        Host-resident matrices orthogonalized on another device go through ``HostStagedNS`` (momentum written into
        pinned buffers while the previous matrix is orthogonalized, a stream per copy direction, each result
        applied once its copy back is done), unless ``stage_host_copies`` says otherwise; everything else runs where
        it is, without copies."""
        on_host = all(_local(p).device.type == "cpu" for _, p in local)
        stage = on_host and device.type != "cpu" if self.stage_host_copies is None else self.stage_host_copies
        if not stage:
            for (g, p), fn in zip(local, ns):
                self._apply(g, p, fn(self._momentum_update(g, p).to(device)))
            return
        if self._staging is None or self._staging.device != device:
            self._staging = HostStagedNS(device)
        grads = [_local(p.grad) for _, p in local]
        self._staging.run([(G.shape, G.dtype) for G in grads],
                          lambda k, out: self._momentum_update(*local[k], out=out), ns,
                          lambda k, O: self._apply(*local[k], O))

    def _shard_groups(self, muon):
        """FlexShard plan for this parameter set; placements never change, so plan once."""
        key = tuple(id(p) for _, p in muon)
        if self._plan is None or self._plan[0] != key:
            names = [self._name(g, p) for g, p in muon]
            if any(classify(self._name(g, p), p) for g in self.param_groups if g["algorithm"] == "muon"
                   for p in g["params"]):  # row-sharded matrices (the same on every rank, trained or not)
                check_trainable_agree(names, self.trainers_group)
            steps = {g["ns_steps"] for g, _ in muon}
            self._plan = (key, plan_shard_groups(names, [p for _, p in muon], max(steps)))
        return self._plan[1]

    def _exchanges(self, muon, device: torch.device, dtype: torch.dtype) -> list[RowExchange]:
        """One ``RowExchange`` per shard group, built with the plan (its layout arithmetic is fixed too)."""
        groups = self._shard_groups(muon)
        key = (groups, device, dtype)
        if self._exchange_cache is None or self._exchange_cache[0] is not groups or self._exchange_cache[1:3] != key[1:]:
            self._exchange_cache = (*key, [RowExchange(sg, comm_device(sg.group, device), dtype) for sg in groups])
        return self._exchange_cache[3]

    @staticmethod
    def _name(group: dict, p: torch.Tensor) -> str:
        names = group.get("param_names")
        return names[[id(q) for q in group["params"]].index(id(p))] if names else f"param{tuple(p.shape)}"

    @staticmethod
    def _schedule(group: dict):
        return coefficient_schedule(group["ns_coefficients"], group["ns_steps"])

    def _momentum_update(self, group: dict, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Update the momentum buffer in place and return what gets orthogonalized (local shard, fp32), written
        into ``out`` if given (a pinned staging buffer)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        if group["nesterov"]:
            return grad.lerp(buf, group["momentum"]) if out is None else torch.lerp(grad, buf, group["momentum"], out=out)
        return buf if out is None else out.copy_(buf)

    def _momentum_without_grad(self, group: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_momentum_update`` for a zero gradient, without changing the buffer: (new buffer, local update)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        zero = torch.zeros_like(_local(state["momentum_buffer"]))
        buffer = _local(state["momentum_buffer"]).lerp(zero, 1 - group["momentum"])  # the ops of a zero gradient
        return buffer, zero.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    @staticmethod
    def _apply(group: dict, p: torch.Tensor, O: torch.Tensor, anyone: torch.Tensor | None = None) -> None:
        """Decoupled weight decay, then the orthogonalized step with the shape-dependent LR scale. ``anyone``: 0
        when no rank had a gradient (``O`` is then zero too), which leaves ``p`` untouched."""
        local = _local(p)
        decay = group["lr"] * group["weight_decay"]
        local.mul_(1 - decay if anyone is None else 1 - decay * anyone.to(local.device, local.dtype))
        local.add_(O.to(local.device), alpha=-group["lr"] * lr_scale(p.shape, group["adjust_lr_fn"]))

    def _adamw_step(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["adamw_eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            grad, m, v, local = _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(p)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            local.mul_(1 - lr * wd)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
            local.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
