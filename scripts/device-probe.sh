#!/usr/bin/env bash
# Run on the lent GPU host (see docs/device.md): captures the probe, doctor and timings into $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
py=python3
n=$(nvidia-smi -L | grep -c '^GPU')
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,pci.device_id,compute_cap,memory.total,memory.used,memory.free,driver_version,mig.mode.current,power.limit,clocks.max.sm --format=csv,noheader,nounits > "$OUT/nvidia-smi-query.csv" 2>&1
nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1
$py scripts/capture_nvml.py > "$OUT/nvml-capture.json" 2>&1
{
  echo "## nvidia-smi -L"; nvidia-smi -L
  echo; echo "## m31ctl probe (all GPUs)"; $py -m m31ctl probe
  echo; echo "## CUDA_VISIBLE_DEVICES=0 m31ctl probe"; CUDA_VISIBLE_DEVICES=0 $py -m m31ctl probe
  echo; echo "## m31ctl probe with NVML hidden (nvidia-smi fallback)"; M31CTL_PROBE_METHODS=nvidia-smi $py -m m31ctl probe
  echo; echo "## m31ctl plan (probed)"; $py -m m31ctl plan; echo "exit=$?"
  echo; echo "## m31ctl doctor (probed plan)"; $py -m m31ctl doctor; echo "exit=$?"
  echo; echo "## m31ctl doctor --set parallelism.tensor=$n --set serving.max_model_len=8192"
  $py -m m31ctl doctor --set parallelism.tensor="$n" --set serving.max_model_len=8192; echo "exit=$?"
} > "$OUT/session.txt" 2>&1
$py -m m31ctl probe --json > "$OUT/probe-${n}gpu.json" 2>&1
[ "$n" -gt 1 ] && CUDA_VISIBLE_DEVICES=0 $py -m m31ctl probe --json > "$OUT/probe-1gpu.json" 2>&1
$py -m m31ctl doctor --json --set parallelism.tensor="$n" --set serving.max_model_len=8192 > "$OUT/doctor.json" 2>&1
{
  echo; echo "## whole-process timings (median of 11)"
  $py scripts/bench.py --runs 11 "probe --json" "plan --json" "plan --hardware b300x4 --json" "doctor --json"
  echo; echo "## pytest -m gpu"
  $py -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -5
} >> "$OUT/session.txt" 2>&1
cat "$OUT/session.txt"
