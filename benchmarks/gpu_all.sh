#!/usr/bin/env bash
# Every GPU measurement of the project in one command, within one budget, ending in one table:
#   bash benchmarks/gpu_all.sh [BUDGET_SECONDS]        # default 500 s; GPU_ALL_PARTS=paths,recipe runs only those
#   bash benchmarks/gpu_all.sh --list [--gpu-memory GIB]   # each part, its box and the shapes picked (no GPU needed;
#                                                      # sized by GIB, else the card's free memory, else 80)
#   bash benchmarks/gpu_all.sh --dry-run [BUDGET]      # every selected part with --dry-run, on CPU
# Parts, in order (the path check first, then by value): see PARTS below. Each part gets min(its box, what is
# left), prints its lines as they come and, as soon as it has it, one "figure: part | key number | target |
# PASS/FAIL" line; a failure or time-out of one part is reported while the others still run.
# Sizing: the parts with a large shape read the free memory (torch.cuda.mem_get_info) and keep a planned peak
# (moe_lightning.planner.plan) under 92 % of it: the recipe picks its number of blocks (benchmarks/gpu_shapes.py),
# the others refuse in one line. Every part but "strategy" (which reports the allocator's retries as they come by
# default) runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
# Time: each box is a cold-start estimate (empty compile cache; written beside it below; not yet measured on a
# GPU); the boxes add up to 460 s, and with the start-up (machine facts, Triton preflight, ~10-15 s) fit the 500 s
# budget; the cache packing (~5-10 s) comes after it, inside one 600 s device call. A lease is 900 s of device time: a fresh machine's
# start (~60-120 s), this run and a rerun of the failed parts on a fresh machine fit.
# Files under $OUT (the device tool's output folder, else ./gpu_results; it returns 8 files of <= 16 MiB): gpu_all.md
# (machine facts, preflight, each part's outcome, the table), gpu_all.log (every part's lines, in order, after a
# "=== part" header; its last 15 MiB if longer) and compile_cache.tgz.0, .1, ... (the Inductor/Triton cache, gzipped
# and cut into 15 MiB pieces, at most 3: kept when it packs into 45 MiB, which leaves the carried tree under the
# 64 MiB a call sends; none when nothing was compiled). To reuse the compiled kernels on the next call, replace the
# contents of .gpu_cache/ in the checkout with those pieces (.gitignore keeps it and gpu_results/ out of commits) and
# carry .gpu_cache: they are unpacked first, all or nothing.
# Exits non-zero when any part failed, timed out or was skipped. Needs torch and lightning only (no jsonargparse).
# The interpreter is ${PYTHON:-python3}. Each part learns its time box from $GPU_ALL_BOX_S.
set -u -o pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
list=0 dry=() memory=()
while (($#)); do
    case $1 in
        --list) list=1 ;;
        --dry-run) dry=(--dry-run) ;;
        --gpu-memory) memory=(--gpu-memory "${2:?--gpu-memory needs GiB, e.g. --gpu-memory 80}"); shift ;;
        *) break ;;
    esac
    shift
done
budget=${1:-500}

# name|time box s|needs Triton|expandable segments|command|what it measures|the box's cold-start estimate
PARTS=(
  "paths|45|1|1|benchmarks/gpu_paths.py|grouped_mm, offload, host-staged NS, NCCL, FlexAttention (S, S-1) + max_scores: PASS/FAIL each|imports 8 s, eager checks 5 s, FlexAttention fwd+bwd compile 20 s (S-1 reuses it), slack 12 s"
  "recipe|150|1|1|benchmarks/gpu_recipe.py|the card-sized recipe: tokens/s, MFU (989 TFLOP/s and measured GEMM) over 3 timed steps, memory, syncs, phases, offload stall|imports + meta init 20 s, GEMM 3 s, step 0 compiles FlexAttention 40 s, timed steps 1-3 at ~3 s then the figure, snapshot step 4 and profiled step 5 ~6 s, trace export 15 s, slack 55 s"
  "attention|40|1|1|benchmarks/gpu_attention.py|FlexAttention + max scores vs dense-mask SDPA at the recipe's batch, MLA first: time, memory, difference|imports 6 s, GQA shape's compile 15 s (MLA's is the recipe's), 28 timed calls 5 s, slack 14 s"
  "compile|90|1|1|benchmarks/gpu_compile.py|2 recipe blocks compiled vs eager: tokens/s, compile seconds (eager's figure first, provisional)|imports 8 s, eager 4 steps 3 s, Inductor's cold compile of 2 block graphs fwd+bwd 60 s, 4 compiled steps 3 s, slack 16 s"
  "offload|35|0|1|benchmarks/gpu_offload.py|ActivationOffload vs activation checkpointing: peak memory, tokens/s|imports 5 s, 5 modes x 3 steps at 65,536 tokens 20 s, slack 10 s; no compile"
  "muon|40|0|1|benchmarks/gpu_muon.py|NS of one GPU's 1T expert shard on 16 host cores vs the GPU (also with its pinned host round trip); Muon vs AdamW steps on fp32 master weights|imports 5 s, GPU NS with and without the round trip of 9.7 GB pinned 5 s, host NS 12 s (capped), 1.4B fp32 init 5 s, 8 optimizer steps 5 s, slack 8 s; no compile"
  "strategy|40|0|0|benchmarks/gpu_strategy.py|MoEFSDPStrategy default variant: tokens/s (median and range of the steps), MFU, allocator retries (default allocator)|parent: imports, CUDA start, fit check 8 s, then its child in what is left of the box less 5 s: imports 8 s, meta init 2 s, 5 steps 5 s, teardown 2 s, slack 10 s; report 5 s; no compile"
  "ep_chunks|20|0|1|benchmarks/gpu_ep_chunks.py|one MoE layer, one-rank NCCL group: ep_overlap_chunks 4 vs 1 (what chunking costs), FP8 dispatch|imports 5 s, NCCL init 3 s, 4 modes x 13 steps 4 s, slack 8 s; no compile"
)
selected=()
for row in "${PARTS[@]}"; do
    name=${row%%|*}
    if [[ -z ${GPU_ALL_PARTS:-} || ,${GPU_ALL_PARTS}, == *,$name,* ]]; then selected+=("$row"); fi
done
parts_wanted=${GPU_ALL_PARTS:-}
for want in ${parts_wanted//,/ }; do
    printf '%s\n' "${PARTS[@]}" | grep -q "^$want|" || { echo "gpu_all: GPU_ALL_PARTS names an unknown part '$want'; parts: $(printf '%s ' "${PARTS[@]%%|*}")"; exit 2; }
done

# every part, the list's shapes and the preflight import torch: without it, one line instead of their tracebacks
"$python" -c "import torch" >/dev/null 2>&1 || {
    echo "gpu_all: $python cannot import torch: install torch and lightning there, or point PYTHON at an interpreter that has them"
    exit 2
}

if ((list)); then
    total=0
    for row in "${selected[@]}"; do
        IFS='|' read -r name box compiles expandable script what estimate <<<"$row"
        total=$((total + box))
        printf '%-9s %4s s  %s\n                 box: %s\n' "$name" "$box" "$what" "$estimate"
    done
    PYTHONPATH=$PWD "$python" benchmarks/gpu_shapes.py "${memory[@]}" || exit 2
    echo "boxes: ${total} s of a ${budget} s budget; start-up (machine facts, preflight) ~10-15 s, measured in each run"
    exit 0
fi

out=${OUT:-gpu_results}
mkdir -p "$out"
cache=${GPU_ALL_CACHE:-/tmp/moe_lightning_compile_cache}
carried=${GPU_ALL_CARRIED:-.gpu_cache}
logs=$(mktemp -d)  # each part's own log, read for its figure; $out gets them all in one file
trap 'rm -rf "$logs"' EXIT
mkdir -p "$cache"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
start=$SECONDS
report=$out/gpu_all.md
: >"$out/gpu_all.log"
{
    echo "# gpu_all $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${budget} s, parts: $(printf '%s ' "${selected[@]%%|*}")"
    if compgen -G "$carried/compile_cache.tgz.*" >/dev/null; then  # all or nothing: a bad piece leaves no half kernels
        mkdir -p "$logs/unpacked"
        if cat "$carried"/compile_cache.tgz.* | tar xz -C "$logs/unpacked" 2>/dev/null; then
            cp -a "$logs/unpacked/." "$cache/" && rm -rf "$logs/unpacked"
            echo "compile cache: unpacked $carried/compile_cache.tgz.* ($(du -sh "$cache" | cut -f1))"
        else echo "compile cache: $carried/compile_cache.tgz.* do not unpack (pieces of two runs, or one missing): not used"; fi
    fi
    "$python" - <<'EOF'
import subprocess, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}", end="")
if torch.cuda.is_available():
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    b = torch.backends.cuda
    print(f", NCCL {nccl}\nGPU: {smi}, {torch.cuda.device_count()} device(s), capability "
          f"{torch.cuda.get_device_capability()}\nSDPA backends enabled: flash {b.flash_sdp_enabled()}, "
          f"mem_efficient {b.mem_efficient_sdp_enabled()}, cudnn {b.cudnn_sdp_enabled()}, math {b.math_sdp_enabled()}")
else:
    print("\nGPU: none (CPU)")
EOF
} 2>&1 | tee "$report"
compiles=0
if ((${#dry[@]} == 0)); then
    "$python" benchmarks/gpu_preflight.py 2>&1 | tee -a "$report"
    compiles=${PIPESTATUS[0]}  # 0: Triton's launcher builds; otherwise the parts that compile kernels are skipped
fi
echo "start-up: $((SECONDS - start)) s (machine facts, preflight)" | tee -a "$report"
failed=() rows=()

children_cpu_s() {  # CPU seconds (user + system) of every child this shell has waited for, into variable $1
    times >"$logs/times"  # in this shell: a $(...) subshell would report its own children (none)
    printf -v "$1" '%s' "$(awk 'NR == 2 { s = 0; for (i = 1; i <= 2; i++) { split($i, t, "m"); s += t[1] * 60 + t[2] }
                               printf "%d", s }' "$logs/times")"
}

part() {  # part NAME BOX NEEDS_TRITON EXPANDABLE SCRIPT: run within min(BOX, budget left), record figure and outcome
    local name=$1 box=$2 needs_compiler=$3 expandable=$4 script=$5 outcome allocator=""
    local left=$((budget - (SECONDS - start)))
    if ((needs_compiler && compiles != 0)); then
        outcome="skipped: Triton cannot build its launcher"; failed+=("$name:no-compiler")
    elif ((left < 15)); then
        outcome="skipped: ${left} s of budget left"; failed+=("$name:skipped")
    else
        ((box > left)) && box=$left
        echo "gpu_all: --- $name (time box ${box} s, $((SECONDS - start)) s elapsed) ---"
        local t0=$SECONDS cpu0 cpu1
        children_cpu_s cpu0
        echo "=== $name (time box ${box} s) ===" >>"$out/gpu_all.log"
        ((expandable)) && allocator=expandable_segments:True
        PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-$allocator} GPU_ALL_BOX_S=$box timeout --kill-after=5 "$box" "$python" "$script" "${dry[@]}" 2>&1 | tee "$logs/$name.log" \
            | tee -a "$out/gpu_all.log"
        local rc=$? took=$((SECONDS - t0)) cpu
        children_cpu_s cpu1
        cpu=$((cpu1 - cpu0))  # beside the wall time: on a shared machine the two part ways
        if ((rc == 0)); then outcome="ok in ${took} s (CPU ${cpu} s)"
        elif ((rc == 124 || rc == 137)); then outcome="TIMEOUT after ${box} s (CPU ${cpu} s)"; failed+=("$name:timeout")
        else outcome="FAILED (exit $rc) after ${took} s (CPU ${cpu} s)"; failed+=("$name:exit$rc"); fi
    fi
    echo "gpu_all: $name: $outcome"
    local figure
    figure=$(grep -h '^figure: ' "$logs/$name.log" 2>/dev/null | tail -1)
    figure=${figure#figure: }
    if [[ -n $figure ]]; then rows+=("| $figure | $outcome |")
    else rows+=("| $name | (no figure) | - | FAIL | $outcome |"); fi
}

for row in "${selected[@]}"; do
    IFS='|' read -r name box compiles_needed expandable script what estimate <<<"$row"
    part "$name" "$box" "$compiles_needed" "$expandable" "$script"
done

rm -f "$out"/compile_cache.tgz.*
if [[ -n $(find "$cache" -type f -print -quit 2>/dev/null) ]]; then  # packed aside first: $out gets what fits
    tar c -C "$cache" . | gzip -1 >"$logs/cache.tgz"
    size=$(stat -c %s "$logs/cache.tgz")
    if ((size > 45 << 20)); then cache_note="compile cache: $((size >> 20)) MiB packed, over 45 MiB: not kept"
    else
        split -b 15M -d -a 1 "$logs/cache.tgz" "$out/compile_cache.tgz."
        pieces=$(compgen -G "$out/compile_cache.tgz.*" | wc -l)
        cache_note="compile cache: $((size >> 10)) KiB in $pieces piece(s), $out/compile_cache.tgz.* (carry them in"
        cache_note+=" .gpu_cache/, replacing what is there)"
    fi
else cache_note="compile cache: empty (nothing compiled)"; fi
if (($(stat -c %s "$out/gpu_all.log") > 15 << 20)); then  # the device returns files of <= 16 MiB: keep the end
    tail -c 15M "$out/gpu_all.log" >"$logs/tail.log" && mv "$logs/tail.log" "$out/gpu_all.log"
    cache_note+="; gpu_all.log cut to its last 15 MiB"
fi
{
    echo
    echo "gpu_all: done in $((SECONDS - start)) s of ${budget} s; $cache_note"
    echo
    echo "| part | key number | target | pass/fail | outcome |"
    echo "| --- | --- | --- | --- | --- |"
    printf '%s\n' "${rows[@]}"
    echo
    if ((${#failed[@]})); then echo "gpu_all: FAILED PARTS: ${failed[*]} (rerun: GPU_ALL_PARTS=$(printf '%s\n' "${failed[@]%%:*}" | paste -sd,) bash benchmarks/gpu_all.sh)"
    else echo "gpu_all: all parts ok"; fi
} | tee -a "$report"
((${#failed[@]} == 0))
