#!/usr/bin/env bash
# The benchmark, then the CUDA parity check, on the H200 device machine in one call; results: $OUT.
# Run after the wheels' first device call (bench/README.md), with carry [".dev/b"]:
#   bash bench/gpu.sh [experts.py args...]   # e.g. prefill.md's H200 run; none: peak RSS
#   BENCH=pipeline bash bench/gpu.sh [gpu_pipeline.py args...]   # the decode regimes instead
# Both get --ckpt-dir /root/ckpt --out $OUT. GPU_BENCH=0 skips the benchmark, PARITY_TIMEOUT=0 the
# parity check; BENCH_TIMEOUT; PARITY_ARGS: cuda_parity.py's, e.g. "--cases 2 --direct on".
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())"
start=$(date +%s)
if [ "${GPU_BENCH:-1}" = 1 ]; then
  if [ "${BENCH:-experts}" = pipeline ]; then
    timeout ${BENCH_TIMEOUT:-540} python3 bench/gpu_pipeline.py --ckpt-dir /root/ckpt \
      --out "$OUT" "$@" 2> "$OUT/bench.log" || echo "gpu_pipeline.py: exit $? (log: bench.log)"
    grep -E "WARNING|NOT EXACT|Error" "$OUT/bench.log" | tail -20 || true
  else
    experts() {
      timeout ${BENCH_TIMEOUT:-420} python3 bench/experts.py --device-kind gpu \
        --ckpt-dir /root/ckpt --out "$OUT" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\[" || true
    }
    experts "$@"
  fi
  echo "bench: $(( $(date +%s) - start )) s"
fi
if [ "${PARITY_TIMEOUT:-120}" != 0 ]; then
  timeout ${PARITY_TIMEOUT:-120} python3 bench/cuda_parity.py --out "$OUT/cuda_parity.json" \
    ${PARITY_ARGS:-} 2>&1 | tail -40
fi
echo "total: $(( $(date +%s) - start )) s"
