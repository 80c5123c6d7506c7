"""``plan``'s pipeline rows (``--pipeline-parallel-size``, ``--pipeline-schedule``, ``--pipeline-microbatches``,
``--pipeline-stages-per-rank``).

At the same world size and global batch as the plan without stages: ``world / P`` data-parallel pipelines, each
taking ``P x micro_batch`` sequences a step in ``M`` micro-batches of ``b = P · micro_batch / M``. Priced per
pipeline rank (its stages' blocks, from ``parallel.pipeline.stage_layout``, the function the strategy builds with):

- Parameters, gradients and optimizer state: ``16`` bytes (AdamW, fp32) per parameter the rank's stages hold, over
  the stage's shard ranks ``world / (replicate · P)``; the first stage adds the embedding, the last the final norm,
  the head, the MTP modules (and the embedding's copy when MTP or a tied head reads it).
- Boundary activations: ``in flight x blocks x b·(s/cp)·d·2`` (bf16 block inputs, a CP rank's share of the
  sequence), ``in flight`` the most micro-batches whose forward ran and whose backward has not, read from torch's
  own order of the schedule's actions
  (``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``: the schedule classes themselves,
  built on mock stages; private in torch 2.11-2.13).
  Under activation offload (``ActivationOffload``, default ``blocks``: every block's input but the model's last
  block's) they split as the callback places them (``offloaded_boundaries``): on the GPU the last stage keeps the
  model's last block's input for each micro-batch in flight there, and the rank's backward holds the non-stage
  plan's ``1 + prefetch`` copied back (the input of the block in backward and the next ``prefetch`` offloaded
  ones of its stage); the rest is in pinned host memory, each input a power-of-two block (``activations.pinned_bytes``),
  checked against ``--host-memory`` with the rank's other host rows.
- The block working set, the expert exchange buffers (``ep_traffic.transient_bytes`` at the stage's ``ep``, on a
  rank holding a MoE block) and (last stage) the loss working set: the plan's rows at ``b`` sequences instead of
  ``micro_batch``; as there, the peak takes the larger of the block's (with its exchange) and the loss's, which
  never coexist.
- FSDP within a stage, from torch's lowered action order (``lowered_actions``, ``held_stages``): the plan's
  all-gather buffers (a unit in flight and its prefetch); the gathered stages (bf16), the most of the rank's stages
  whose every unit is gathered at once: torch's runtime all-gathers a whole stage ahead (UNSHARD, at most 3 of a
  rank's stages) and frees it at RESHARD or its gradient reduction (REDUCE_GRAD), ``PipelineStage`` runs every
  backward without resharding after it, and a forward reshards only under ``reshard_after_forward`` (the
  strategy's default, forced off for a split backward); and the unsharded gradients (fp32), each stage's from its
  first backward to its REDUCE_GRAD (``PipelineStage`` turns gradient sync off until then). Routed experts count
  ``1 / ep``, ``ep`` the expert-parallel size that fits in a stage's ``world / (replicate · P)`` ranks. FSDP
  traffic: the plan's times the rank's share of the parameters, all-gathered as often as that same order gathers
  each stage again (an UNSHARD, or a computation on a stage not gathered: with ``reshard_after_forward`` a forward
  after a forward, or a backward after one) and reduce-scattered once; exposed where it exceeds the rank's
  compute.

Time: the schedule's actions timed in that same order (forward ``f_s``, full backward ``2·f_s``, a zero-bubble
schedule's input and weight halves ``f_s`` each; ``f_s`` the stage's share of the plan's compute, from its FLOPs),
each send between ranks ``b·(s/cp)·d·2 / IB bandwidth`` (stages across nodes). The bubble is the idle fraction of
that timeline; the step is its length plus the rank's exposed FSDP time; the expert exchange of the plan is priced per
micro-batch at the same total (the same tokens cross the same links).
"""

import argparse
from collections import defaultdict

import torch

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.parallel.mesh import resolve_layout
from moe_lightning.parallel.pipeline import (SCHEDULES, SPLIT_BACKWARD, block_costs, reads_embedding_last,
                                             resolve_pipeline)
from moe_lightning.planner import ep_traffic
from moe_lightning.planner.activations import pinned_bytes

GiB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline-parallel-size", type=int, default=None, help="pipeline stages P (prints the "
                        "per-stage rows and the step with and without them)")
    parser.add_argument("--pipeline-schedule", default="1F1B", choices=list(SCHEDULES), help="torch's schedule")
    parser.add_argument("--pipeline-microbatches", type=int, default=None, help="micro-batches a step (default P)")
    parser.add_argument("--pipeline-stages-per-rank", type=int, default=None, help="stages V on each rank (the "
                        "interleaved and V schedules; default 2, 1 for 1F1B and GPipe)")


def schedule_actions(schedule: str, size: int, microbatches: int, stages_per_rank: int) -> list[list]:
    """Each pipeline rank's ``(kind, stage, micro-batch)`` computations in the order torch's ``schedule`` runs
    them. The one-stage schedules run their own loop (torch 2.11-2.13 ``Schedule1F1B._step_microbatches``: rank
    ``r`` runs ``min(M, P - r)`` forwards, then alternates backward and forward, then the last backwards; GPipe
    every forward, then every backward); the others run their ``pipeline_order``, read from the schedule class
    built on mock stages (``_schedule_visualizer.get_schedule_ops``; its orders for the one-stage schedules are
    not what those run)."""
    M = microbatches
    if schedule == "GPipe":
        return [[("F", r, m) for m in range(M)] + [("B", r, m) for m in range(M)] for r in range(size)]
    if schedule == "1F1B":
        orders = []
        for r in range(size):
            warmup = min(M, size - r)
            order = [("F", r, m) for m in range(warmup)]
            for m in range(M):
                order.append(("B", r, m))
                if warmup + m < M:
                    order.append(("F", r, warmup + m))
            orders.append(order)
        return orders
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from moe_lightning.parallel.pipeline import schedule_class
    ops = get_schedule_ops(schedule_class(schedule), size, M, stages_per_rank)
    return [[step for a in rank if a is not None for step in _compute_steps(a)] for rank in ops]


def lowered_actions(schedule: str, size: int, microbatches: int, stages_per_rank: int) -> list[list[tuple[str, int]]]:
    """Each pipeline rank's actions as torch's runtime runs them, sends and receives left out: ``(kind, stage)``,
    kind ``F``, ``B``, ``I``, ``W``, ``UNSHARD`` (all-gather every FSDP unit of the stage), ``RESHARD`` (free them)
    or ``REDUCE_GRAD`` (the stage's gradient reduction, after its last backward). The several-stage schedules' list
    is their ``pipeline_order_with_comms`` (``get_schedule_ops(..., with_comms=True)``: ``_add_unshard_reshard``
    keeps at most 3 of a rank's stages gathered, ``_add_reduce_grad``; torch 2.11 and 2.13); the one-stage schedules
    have no UNSHARD or RESHARD and reduce once at the end (``Schedule1F1B``: ``perform_reduce_grad`` after its loop)."""
    if SCHEDULES[schedule][1] == "single":
        return [[(kind, stage) for kind, stage, _ in rank] + [("REDUCE_GRAD", r)]
                for r, rank in enumerate(schedule_actions(schedule, size, microbatches, 1))]
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from moe_lightning.parallel.pipeline import schedule_class
    ops = get_schedule_ops(schedule_class(schedule), size, microbatches, stages_per_rank, with_comms=True)
    return [[(kind, stage) for a in rank if a is not None for kind, stage, _ in _compute_steps(a, lowered=True)]
            for rank in ops]


def held_stages(actions: list[tuple[str, int]], reshard_after_forward: bool) -> list[dict]:
    """After each of one rank's ``lowered_actions``, its stages by what they hold: ``gathered``, every FSDP unit
    all-gathered; ``kept``, the units never resharded after forward (the head, the root's own parameters);
    ``gradients``, unsharded gradients; and ``all_gather``, the stage the action all-gathered, if any, with whether
    its kept units were still gathered (``(stage, kept)``; ``None``). Torch's ``PipelineStage`` runs every backward
    with ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``
    (``backward_maybe_with_nosync``) and REDUCE_GRAD (``perform_reduce_grad``) reduces and reshards. So a stage is
    gathered from its UNSHARD, or from any computation on it, until RESHARD or REDUCE_GRAD, except that a forward
    reshards it with ``reshard_after_forward`` (gathering one unit at a time: the all-gather buffers row) but not its
    kept units. Gradients are unsharded from the first ``B`` or ``W`` to REDUCE_GRAD (a RESHARD frees parameters,
    not gradients)."""
    gathered, kept, grads, held = set(), set(), set(), []
    for kind, stage in actions:
        all_gather = None
        if kind in ("RESHARD", "REDUCE_GRAD"):
            gathered.discard(stage)
            kept.discard(stage)
            if kind == "REDUCE_GRAD":
                grads.discard(stage)
        else:
            if stage not in gathered:
                all_gather = (stage, stage in kept)
            kept.add(stage)
            if kind == "F" and reshard_after_forward:
                gathered.discard(stage)
            else:
                gathered.add(stage)
            if kind in ("B", "W"):
                grads.add(stage)
        held.append({"gathered": frozenset(gathered), "kept": frozenset(kept), "gradients": frozenset(grads),
                     "all_gather": all_gather})
    return held


def peak_held(held: list[dict[str, frozenset]], whole: list[float], kept: list[float]) -> dict:
    """The most parameter elements one rank holds gathered at once over ``held`` (``held_stages``), with the
    number of its stages wholly gathered then and at most; the most unsharded gradient elements at once; and the
    elements it all-gathers in the step (``all_gathered``).
    ``whole[t]``: stage ``t``'s parameters as gathered (an expert stack's ``1 / ep``); ``kept[t]``: its kept
    units'."""
    params, stages, grads, all_gathered = 0.0, 0, 0.0, 0.0
    for now in held:
        gathered = sum(whole[t] for t in now["gathered"]) + sum(kept[t] for t in now["kept"] - now["gathered"])
        if gathered > params:
            params, stages = gathered, len(now["gathered"])
        grads = max(grads, sum(whole[t] for t in now["gradients"]))
        if now["all_gather"] is not None:
            stage, kept_gathered = now["all_gather"]
            all_gathered += whole[stage] - (kept[stage] if kept_gathered else 0.0)
    return {"parameters": params, "stages": stages, "gradients": grads, "all_gathered": all_gathered,
            "most_stages": max((len(now["gathered"]) for now in held), default=0)}


def _compute_steps(action, lowered: bool = False) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` of the computations in one action (a DualPipeV overlap holds two)."""
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [s for sub in subs for s in _compute_steps(sub, lowered)]
    kind = str(action.computation_type).split(".")[-1]
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}.get(kind, kind)
    if lowered and kind in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
        return [(kind, action.stage_index, None)]
    return [(kind, action.stage_index, action.microbatch_index)] if kind in "FBIW" and len(kind) == 1 else []


def simulate(actions: list[list], forward_s: list[float], hop_s: float) -> dict:
    """Time each rank's actions in order: an action starts when its rank is free and its inputs have arrived
    (the previous stage's forward, the next stage's backward, plus ``hop_s`` between ranks). Returns the step's
    length, each rank's busy time and idle fraction, and the most micro-batches each stage holds in flight."""
    steps = actions
    rank_of = {stage: r for r, rank in enumerate(steps) for _, stage, _ in rank}
    last = max(rank_of)
    done: dict[tuple[str, int, int], float] = {}
    free, busy, position = [0.0] * len(steps), [0.0] * len(steps), [0] * len(steps)
    held, most = defaultdict(int), defaultdict(int)

    def ready(kind: str, stage: int, mb: int) -> float | None:
        if kind == "F":
            need = None if stage == 0 else ("F", stage - 1, mb)
        elif kind in "BI":
            need = ("F", stage, mb) if stage == last else \
                (("B", stage + 1, mb) if ("B", stage + 1, mb) in done else ("I", stage + 1, mb))
        else:
            need = ("I", stage, mb)
        if need is None:
            return 0.0
        if need not in done:
            return None
        return done[need] + (hop_s if rank_of[need[1]] != rank_of[stage] else 0.0)

    progressed = True
    while progressed:
        progressed = False
        for r, rank in enumerate(steps):
            while position[r] < len(rank):
                kind, stage, mb = rank[position[r]]
                start = ready(kind, stage, mb)
                if start is None:
                    break
                cost = forward_s[stage] * (2 if kind == "B" else 1)
                end = max(start, free[r]) + cost
                done[(kind, stage, mb)], free[r] = end, end
                busy[r] += cost
                held[stage] += 1 if kind == "F" else (-1 if kind in "BI" else 0)
                most[stage] = max(most[stage], held[stage])
                position[r] += 1
                progressed = True
    if any(p < len(rank) for p, rank in zip(position, steps)):
        raise RuntimeError("the schedule's actions wait on each other (a dependency this timing does not know)")
    length = max(free)
    return {"seconds": length, "busy": busy, "idle_fraction": [1 - b / length for b in busy],
            "in_flight": [most[s] for s in range(last + 1)]}


def stage_parameters(config: MoEConfig, blocks_per_stage: list[int], routed: bool = False,
                     kept: bool = False) -> list[int]:
    """Parameters each stage holds (counted on a meta-device model); ``routed``: only the routed experts';
    ``kept``: only those of the FSDP units never resharded after forward (``parallel.units``: the head, and the
    root's own, the final norm and a tied embedding/head weight)."""
    with torch.device("meta"):
        model = MoETransformer(config)
    kept_names = ("norm.", "output.") + (("tok_embeddings.",) if config.tie_embeddings else ())
    numel = {name: p.numel() for name, p in model.named_parameters()
             if (not routed or ".ffn.experts." in name) and (not kept or name.startswith(kept_names))}
    block = [sum(n for k, n in numel.items() if k.startswith(f"layers.{i}.")) for i in range(config.n_layers)]
    embedding = numel.get("tok_embeddings.weight", 0)
    tail = sum(n for k, n in numel.items() if k.startswith(("norm.", "output.", "mtp.")))
    counts, start = [], 0
    for s, n in enumerate(blocks_per_stage):
        count = sum(block[start:start + n])
        if s == 0:
            count += embedding
        if s == len(blocks_per_stage) - 1:
            count += tail + (embedding if reads_embedding_last(config) and len(blocks_per_stage) > 1 else 0)
        counts.append(count)
        start += n
    return counts


def offloaded_boundaries(in_flight: list[int], blocks_per_stage: list[int], stages: list[int],
                         prefetch: int) -> dict[str, int]:
    """Block inputs of one pipeline rank's ``stages`` under ``ActivationOffload`` (default ``blocks``): ``kept`` on
    the GPU, the model's last block's for each micro-batch in flight on the last stage; ``copied_back``, the most
    on the GPU beyond those while the rank runs one backward: the input of the block in backward and the next
    ``prefetch`` offloaded inputs of its stage (the non-stage plan's ``1 + prefetch``; on the last stage the
    first of them is a kept one); ``host``, the offloaded inputs of the micro-batches in flight. ``kept + host`` is
    every input the rank holds without offload."""
    last = len(blocks_per_stage) - 1
    kept = in_flight[last] if last in stages else 0
    copied_back = max(min(prefetch, blocks_per_stage[t] - 1) + (0 if t == last else 1) for t in stages)
    host = sum(in_flight[t] * (blocks_per_stage[t] - (1 if t == last else 0)) for t in stages)
    return {"kept": kept, "copied_back": copied_back, "host": host}


def pipeline_rows(config: MoEConfig, cluster, work, result: dict, size: int, schedule: str,
                  microbatches: int | None, stages_per_rank: int | None = None) -> dict:
    """The rows above for ``plan``'s ``result`` (the same cluster and workload without stages)."""
    layout = resolve_pipeline(config, size, schedule, microbatches, stages_per_rank, seq_len=work.seq_len)
    M = layout.microbatches
    if work.activation_offload and schedule in SPLIT_BACKWARD:  # fit refuses it (strategy._check_pipeline_trainer)
        raise ValueError(f"--pipeline-schedule={schedule} with activation offload (ActivationOffload among the "
                         "callbacks): fit refuses it, torch's weight pass recomputes every checkpointed block; pass "
                         "--no-activation-offload or use 1F1B or Interleaved1F1B.")
    stage_mesh = resolve_layout(cluster.world_size, cluster.replicate_size, "auto", cluster.expert_parallel_size,
                                cluster.context_parallel_size, config, work.seq_len, size)  # the strategy's refusals
    if (size * work.micro_batch) % M:
        raise ValueError(f"--pipeline-parallel-size={size} with --pipeline-microbatches={M}: M must divide P x "
                         f"micro_batch = {size * work.micro_batch}.")
    shard, ep = stage_mesh.shard, stage_mesh.ep  # a stage's shard ranks; EP and CP within them
    b, s, d = size * work.micro_batch // M, work.seq_len, config.dim
    costs, first_extra, last_extra = block_costs(config, work.seq_len)
    stage_cost = []
    for stage in range(layout.num_stages):
        blocks = layout.blocks_of(stage)
        stage_cost.append(sum(costs[blocks.start:blocks.stop]) + (first_extra if stage == 0 else 0)
                          + (last_extra if stage == layout.num_stages - 1 else 0))
    compute = result["step_time"]["parts"]["compute"]  # one GPU's step without stages: the same FLOPs per GPU
    forward_s = [size * compute * c / sum(stage_cost) / (3 * M) for c in stage_cost]
    ib_bytes_per_s = result["bandwidths"][0] * 1e9
    hop_bytes = b * (s // stage_mesh.cp) * d * 2  # a stage sends its own [b, S / cp, D] (bf16)
    timeline = simulate(schedule_actions(schedule, size, M, layout.stages_per_rank), forward_s, hop_bytes / ib_bytes_per_s)
    params = stage_parameters(config, list(layout.blocks_per_stage))
    routed = stage_parameters(config, list(layout.blocks_per_stage), routed=True)
    gathered_whole = [n - e + e / ep for n, e in zip(params, routed)]  # as gathered: an expert stack's 1 / ep
    gathered_kept = stage_parameters(config, list(layout.blocks_per_stage), kept=True)
    reshard_after_forward = schedule not in SPLIT_BACKWARD  # the strategy's default; forced off where split
    lowered = lowered_actions(schedule, size, M, layout.stages_per_rank)
    total_params = result["parameters"]["total"]
    memory = result["memory"]["with_offload" if work.activation_offload else "without_offload"]["gpu_bytes"]
    scale = b / work.micro_batch
    fsdp_s = result["step_time"]["detail"]["fsdp"]["seconds"]
    ranks = []
    for r in range(size):
        stages = layout.stages_of(r)
        held = sum(params[t] for t in stages)
        inputs = sum(timeline["in_flight"][t] * layout.blocks_per_stage[t] for t in stages)
        split = offloaded_boundaries(timeline["in_flight"], list(layout.blocks_per_stage), stages,
                                     work.offload_prefetch) if work.activation_offload else None
        gathered = peak_held(held_stages(lowered[r], reshard_after_forward), gathered_whole, gathered_kept)
        whole_gathers = gathered["all_gathered"] / sum(gathered_whole[t] for t in stages)  # in whole-stage units
        rows = {"parameters, gradients, optimizer state (AdamW)": 16 * held / shard,
                "all-gather buffers (bf16)": memory["all-gather buffers (bf16)"],
                "gathered stages (bf16)": 2 * gathered["parameters"],
                "unsharded gradients across micro-batches": 4 * gathered["gradients"],
                **({"boundary activations (in flight)": inputs * hop_bytes} if split is None else {
                    "boundary activations kept (last block)": split["kept"] * hop_bytes,
                    "boundary activations copied back": split["copied_back"] * hop_bytes}),
                "block recompute working set": memory["block recompute working set"] * scale}
        if any(config.is_moe_layer(i) for t in stages for i in layout.blocks_of(t)):
            rows["expert exchange buffers"] = ep_traffic.transient_bytes(
                config, ep, b * s // stage_mesh.cp, work.ep_overlap_chunks, work.ep_imbalance)
        transient = rows["block recompute working set"] + rows.get("expert exchange buffers", 0)
        if layout.num_stages - 1 in stages:
            rows["loss working set"] = memory["loss working set"] * (scale if work.loss_chunk is None else 1)
            if config.mtp_layers:
                rows["multi-token prediction activations"] = memory["multi-token prediction activations"] * scale
        rows["runtime reserve"] = memory["runtime reserve"]
        host_rows = {} if split is None else {"boundary activations (pinned)": split["host"] * pinned_bytes(hop_bytes)}
        if work.async_checkpoint:  # a background save's host copy of the rank's fp32 parameters and AdamW state
            host_rows["async checkpoint staging"] = 12 * held / shard
        # the block's working set and its exchange never coexist with the loss's (the plan's peak)
        peak = int(sum(rows.values()) - min(transient, rows.get("loss working set", 0)))
        host = int(sum(host_rows.values()))
        ranks.append({"stages": stages, "blocks": [layout.blocks_per_stage[t] for t in stages],
                      "parameters": held, "bytes": {k: int(v) for k, v in rows.items()}, "peak": peak,
                      "host_bytes_by_row": {k: int(v) for k, v in host_rows.items()}, "host_bytes": host,
                      "boundary_inputs": split or {"kept": inputs, "copied_back": 0, "host": 0},
                      "fits": peak <= cluster.gpu_memory_gib * GiB and (
                          cluster.host_memory_gib is None or host <= cluster.host_memory_gib * GiB),
                      "p2p_bytes": layout.sends_between_ranks(r) * M * hop_bytes,
                      # the no-stage step all-gathers twice (2 bytes) and reduce-scatters once (4 bytes); a stage
                      # rank all-gathers as often as the action order regathers its stages, reduce-scatters once
                      "fsdp_seconds": fsdp_s * held / total_params * (whole_gathers + 2) / 4,
                      "in_flight": [timeline["in_flight"][t] for t in stages],
                      "gathered_stages": gathered["stages"],
                      "idle_fraction": timeline["idle_fraction"][r]})
    exposed = result["step_time"]["parts"]
    others = sum(v for k, v in exposed.items() if k not in ("compute", "FSDP collectives (exposed)"))
    exposed_fsdp = max(max(0.0, r["fsdp_seconds"] - b_) for r, b_ in zip(ranks, timeline["busy"]))
    step = timeline["seconds"] + exposed_fsdp + others
    return {"size": size, "schedule": schedule, "microbatches": M, "micro_batch_sequences": b, "shard": shard,
            "stages_per_rank": layout.stages_per_rank, "reshard_after_forward": reshard_after_forward,
            "blocks_per_stage": list(layout.blocks_per_stage), "ranks": ranks,
            "bubble": sum(r["idle_fraction"] for r in ranks) / size,
            "textbook_bubble_1f1b": (size - 1) / (M + size - 1),
            "p2p_seconds": hop_bytes / ib_bytes_per_s, "step_seconds": step, "step_seconds_without": result["step_seconds"],
            "exchange_seconds": exposed.get("expert exchange (exposed)"), "ib_bytes_per_s": ib_bytes_per_s,
            "gpu_memory_gib": cluster.gpu_memory_gib, "host_memory_gib": cluster.host_memory_gib,
            "activation_offload": work.activation_offload, "offload_prefetch": work.offload_prefetch}


def format_rows(rows: dict | None) -> list[str]:
    if rows is None:
        return []
    offload = f"activation offload on (prefetch {rows['offload_prefetch']})" if rows["activation_offload"] else \
        "activation offload off"
    lines = ["", f"pipeline          P={rows['size']} {rows['schedule']} over {rows['microbatches']} micro-batches of "
                 f"{rows['micro_batch_sequences']} sequence(s); blocks per stage {rows['blocks_per_stage']}; "
                 f"each stage sharded over {rows['shard']} ranks; {offload}"]
    names = list(rows["ranks"][0]["bytes"])
    for rank in rows["ranks"]:
        names += [n for n in rank["bytes"] if n not in names]
    lines.append(f"{'per-GPU memory (GiB), by stage rank':<44}" + "".join(f"{f'rank {i}':>10}"
                                                                      for i in range(len(rows["ranks"]))))
    for name in names:
        lines.append(f"{name:<44}" + "".join(f"{r['bytes'].get(name, 0) / GiB:>10.2f}" for r in rows["ranks"]))
    lines.append(f"{'peak (larger working set only)':<44}"
                 + "".join(f"{r['peak'] / GiB:>10.2f}" for r in rows["ranks"]))
    host_names = list(dict.fromkeys(n for r in rows["ranks"] for n in r["host_bytes_by_row"]))
    for name in host_names:
        lines.append(f"{'host: ' + name:<44}" + "".join(f"{r['host_bytes_by_row'].get(name, 0) / GiB:>10.2f}"
                                                        for r in rows["ranks"]))
    if host_names:
        lines.append(f"{'host memory per GPU':<44}" + "".join(f"{r['host_bytes'] / GiB:>10.2f}" for r in rows["ranks"]))
    fits = f"fits {rows['gpu_memory_gib']:g} GiB" + (f" (host {rows['host_memory_gib']:g} GiB)"
                                                     if rows["host_memory_gib"] is not None and host_names else "")
    lines.append(f"{fits:<44}" + "".join(f"{'yes' if r['fits'] else 'NO':>10}" for r in rows["ranks"]))
    lines.append(f"{'stages gathered at the peak (of V)':<44}" + "".join(
        f"{str(r['gathered_stages']) + ' of ' + str(rows['stages_per_rank']):>10}" for r in rows["ranks"]))
    lines.append(f"{'micro-batches in flight':<44}" + "".join(f"{str(r['in_flight']):>10}" for r in rows["ranks"]))
    lines.append(f"{'idle fraction (bubble)':<44}" + "".join(f"{r['idle_fraction']:>10.3f}" for r in rows["ranks"]))
    lines.append(f"{'P2P bytes per step (GB)':<44}" + "".join(f"{r['p2p_bytes'] / 1e9:>10.2f}" for r in rows["ranks"]))
    lines.append(f"{'P2P time per step (s, sends over IB)':<44}" + "".join(
        f"{r['p2p_bytes'] / rows['ib_bytes_per_s']:>10.2f}" for r in rows["ranks"]))
    lines.append(f"{'FSDP collectives per step (s)':<44}" + "".join(f"{r['fsdp_seconds']:>10.2f}" for r in rows["ranks"]))
    lines.append(f"bubble            {rows['bubble']:.3f} of the step (1F1B's textbook (P-1)/(M+P-1) = "
                 f"{rows['textbook_bubble_1f1b']:.3f}); one send {rows['p2p_seconds'] * 1e3:.1f} ms over IB")
    if rows["exchange_seconds"] is not None:
        lines.append(f"expert exchange   {rows['exchange_seconds']:.2f} s exposed a step, "
                     f"{rows['exchange_seconds'] / rows['microbatches']:.3f} s a micro-batch (the plan's at the "
                     "stage's expert_parallel_size: the same tokens over the same links, in M pieces)")
    if rows.get("without_refused"):
        lines.append(f"step              {rows['step_seconds']:.1f} s with the stages; without: not applicable "
                     f"({rows['without_refused']} The plan above is the stage's shard layout.)")
    else:
        lines.append(f"step              {rows['step_seconds']:.1f} s with the stages, "
                     f"{rows['step_seconds_without']:.1f} s without (same world and global batch)")
    return lines
