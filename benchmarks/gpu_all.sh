#!/usr/bin/env bash
# Every GPU measurement of the project in one command, the 1T recipe first, then in order of value, within one
# budget:
#   bash benchmarks/gpu_all.sh [BUDGET_SECONDS]     # default 420 s (7 min, at most 8): a rerun fits a 15-minute lease
# First checks that Triton can build its launcher (a C compiler and Python.h; one line if not, and the compiled
# parts are skipped). Compiled kernels go to one cache ($GPU_ALL_CACHE, default /tmp/moe_lightning_compile_cache)
# shared by every part: the recipe part compiles FlexAttention once, later parts and reruns reuse it.
# Logs go to $OUT (the device tool's output folder) or ./gpu_results. Each part prints its JSON lines as they
# come, gets min(its own time box, what is left of the budget), and a failure or time-out of one part is
# reported while the others still run. Exits non-zero when any part failed or was skipped for lack of time.
# Needs torch and lightning only (PYTHONPATH points at the checkout; carry jsonargparse only for the CLI).
# The interpreter is ${PYTHON:-python3}. Each part learns its time box from $GPU_ALL_BOX_S, so a part that starts
# children can give them less and stop them (their whole process group) before the box closes.
set -u -o pipefail
cd "$(dirname "$0")/.."
budget=${1:-420}
out=${OUT:-gpu_results}
mkdir -p "$out"
cache=${GPU_ALL_CACHE:-/tmp/moe_lightning_compile_cache}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
start=$SECONDS
failed=()
python=${PYTHON:-python3}
echo "gpu_all: total budget ${budget} s; parts: recipe(150) offload(80) attention(50) muon(60) strategy(50)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, \
'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$out/machine.txt"

"$python" benchmarks/gpu_preflight.py | tee "$out/preflight.txt"
compiles=${PIPESTATUS[0]}  # 0: Triton's launcher builds; otherwise the parts that compile kernels are skipped
statuses=()

part() {  # part NAME BOX_SECONDS COMPILES COMMAND...: run within min(BOX, budget left), record the outcome
    local name=$1 box=$2 needs_compiler=$3; shift 3
    if ((needs_compiler && compiles != 0)); then
        echo "gpu_all: SKIPPED $name (Triton cannot build its launcher, see above)"; failed+=("$name:no-compiler")
        statuses+=("$name|skipped: no C compiler or Python.h"); return
    fi
    local left=$((budget - (SECONDS - start)))
    if ((left < 15)); then
        echo "gpu_all: SKIPPED $name (${left} s of budget left)"; failed+=("$name:skipped")
        statuses+=("$name|skipped: ${left} s of budget left"); return
    fi
    ((box > left)) && box=$left
    echo "gpu_all: --- $name (time box ${box} s, $((SECONDS - start)) s elapsed) ---"
    local t0=$SECONDS
    GPU_ALL_BOX_S=$box timeout --kill-after=5 "$box" "$@" 2>&1 | tee "$out/$name.log"
    local rc=$? took=$((SECONDS - t0))
    if ((rc == 0)); then echo "gpu_all: ok $name"; statuses+=("$name|ok in ${took} s")
    elif ((rc == 124 || rc == 137)); then echo "gpu_all: TIMEOUT $name after ${box} s"; failed+=("$name:timeout")
        statuses+=("$name|TIMEOUT after ${box} s")
    else echo "gpu_all: FAILED $name (exit $rc)"; failed+=("$name:exit$rc"); statuses+=("$name|FAILED (exit $rc)"); fi
}

# recipe: one MLA + Muon + QK-clip + MTP + document-masked + offloaded 1t-mini step: tokens/s, MFU, peak memory,
# host syncs per step, offload copies against compute (measured overlap); prints its own Markdown table
part recipe 150 1 "$python" benchmarks/gpu_smoke.py
part offload 80 0 "$python" benchmarks/gpu_offload.py           # peak memory / tokens/s: off, checkpoint, prefetch
part attention 50 1 "$python" benchmarks/gpu_attention.py       # FlexAttention document mask vs dense-mask SDPA
part muon 60 0 "$python" benchmarks/muon_gpu_step.py --cases adamw,muon,muon_offload_ns_gpu,muon_offload_ns_gpu_serial
part strategy 50 0 "$python" benchmarks/gpu_strategy.py         # one variant on 1 GPU; unshard/prefetch on >= 2
# (benchmarks/block_memory.py counts saved bytes exactly on CPU: not worth GPU time)

echo "gpu_all: done in $((SECONDS - start)) s of ${budget} s"
echo
echo "| part | outcome |"
echo "| --- | --- |"
for row in "${statuses[@]}"; do echo "| ${row%%|*} | ${row#*|} |"; done
[[ -f $out/recipe.log ]] && { echo; grep '^|' "$out/recipe.log"; }
echo
if ((${#failed[@]})); then echo "gpu_all: FAILED PARTS: ${failed[*]}"; exit 1; fi
echo "gpu_all: all parts ok"
