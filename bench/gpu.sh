#!/usr/bin/env bash
# The benchmark and a CUDA parity check on the H200 device machine, in one call (device time is
# scarce: everything that needs the GPU runs here, results go to $OUT).
#
# Before it, from the project root here: ../shared/tools/mlx-cuda-wheels.sh, then one device call
#   carry [".dev/a"]: mkdir -p /root/stash && cp .dev/a/* /root/stash/
# then this, in a second call on the same warm machine:
#   carry [".dev/b"]: bash bench/gpu.sh [bench args...]
# GPU_BENCH=0 skips the benchmark; BENCH_TIMEOUT, PARITY_TIMEOUT (0: skip) and PARITY_ARGS as below.
# BENCH=pipeline runs bench/gpu_pipeline.py (the decode regimes) instead of bench/experts.py, e.g.
#   BENCH=pipeline PARITY_TIMEOUT=0 bash bench/gpu.sh --layers 16 --regimes hit,ram,cold --floors \
#     --routings uniform,trace:tests/data/routing/qwen3-30b-a3b.jsonl --variants default,default_tl
# (its --ckpt-dir /root/ckpt and --out $OUT are added here; its tables go to stdout and $OUT).
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())"
python3 -m pip list 2>/dev/null | grep -i -E "^(matplotlib|numpy|pluggy|tqdm) " || true
df -h /root | tail -1
start=$(date +%s)
if [ "${GPU_BENCH:-1}" = 1 ]; then
  if [ "${BENCH:-experts}" = pipeline ]; then
    timeout ${BENCH_TIMEOUT:-540} python3 bench/gpu_pipeline.py --ckpt-dir /root/ckpt \
      --out "$OUT" "$@" 2> "$OUT/bench.log" || echo "gpu_pipeline.py: exit $? (log: bench.log)"
    grep -E "WARNING|NOT EXACT|Error" "$OUT/bench.log" | tail -20 || true
  else
    timeout ${BENCH_TIMEOUT:-420} python3 bench/experts.py --device-kind gpu --ckpt-dir /root/ckpt \
      --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" || true
  fi
  echo "bench: $(( $(date +%s) - start )) s"
fi
# PARITY_ARGS: e.g. "--cases 2 --direct on"; PARITY_TIMEOUT=0 skips the parity check
if [ "${PARITY_TIMEOUT:-120}" != 0 ]; then
  timeout ${PARITY_TIMEOUT:-120} python3 bench/cuda_parity.py --out "$OUT/cuda_parity.json" \
    ${PARITY_ARGS:-} 2>&1 | tail -40
fi
echo "total: $(( $(date +%s) - start )) s"
