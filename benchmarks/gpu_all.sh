#!/usr/bin/env bash
# Every GPU measurement of the project in one command, sized for one 10-minute run on one H200:
#   bash benchmarks/gpu_all.sh          # logs go to $OUT (the device tool's output folder) or ./gpu_results
# Each script has its own time box, so one slow script cannot eat the others' budget. Needs torch and
# lightning only (no install of this package: PYTHONPATH points at the checkout).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"; } | tee "$out/machine.txt"
timeout 250 python benchmarks/gpu_strategy.py 2>&1 | tee "$out/strategy.log"          # unshard_async_op x prefetch
timeout 150 python benchmarks/gpu_offload.py 2>&1 | tee "$out/offload.log"            # offload off / prefetch 0-2
timeout 150 python benchmarks/muon_gpu_step.py --cases adamw,muon,muon_offload_ns_gpu 2>&1 | tee "$out/muon.log"
