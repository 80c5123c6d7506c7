#!/usr/bin/env bash
# Every GPU measurement of the project in one command, smoke first, then in order of value, within one budget:
#   bash benchmarks/gpu_all.sh [BUDGET_SECONDS]     # default 420 s: leaves time to rerun in a 15-minute lease
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
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
start=$SECONDS
failed=()
python=${PYTHON:-python3}
echo "gpu_all: total budget ${budget} s; parts: smoke(90) offload(100) attention(60) muon(80) strategy(60)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, \
'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$out/machine.txt"

part() {  # part NAME BOX_SECONDS COMMAND...: run within min(BOX, budget left), record the outcome
    local name=$1 box=$2; shift 2
    local left=$((budget - (SECONDS - start)))
    if ((left < 15)); then
        echo "gpu_all: SKIPPED $name (${left} s of budget left)"; failed+=("$name:skipped"); return
    fi
    ((box > left)) && box=$left
    echo "gpu_all: --- $name (time box ${box} s, $((SECONDS - start)) s elapsed) ---"
    GPU_ALL_BOX_S=$box timeout --kill-after=5 "$box" "$@" 2>&1 | tee "$out/$name.log"
    local rc=$?
    if ((rc == 0)); then echo "gpu_all: ok $name"
    elif ((rc == 124 || rc == 137)); then echo "gpu_all: TIMEOUT $name after ${box} s"; failed+=("$name:timeout")
    else echo "gpu_all: FAILED $name (exit $rc)"; failed+=("$name:exit$rc"); fi
}

part smoke 90 "$python" benchmarks/gpu_smoke.py                  # the 1t-mini path end to end, host syncs
part offload 100 "$python" benchmarks/gpu_offload.py             # peak memory / tokens/s: off, checkpoint, prefetch
part attention 60 "$python" benchmarks/gpu_attention.py          # FlexAttention document mask vs dense-mask SDPA
part muon 80 "$python" benchmarks/muon_gpu_step.py --cases adamw,muon,muon_offload_ns_gpu,muon_offload_ns_gpu_serial
part strategy 60 "$python" benchmarks/gpu_strategy.py            # one variant on 1 GPU; unshard/prefetch on >= 2
# (benchmarks/block_memory.py counts saved bytes exactly on CPU: not worth GPU time)

echo "gpu_all: done in $((SECONDS - start)) s of ${budget} s"
if ((${#failed[@]})); then echo "gpu_all: FAILED PARTS: ${failed[*]}"; exit 1; fi
echo "gpu_all: all parts ok"
