#!/usr/bin/env bash
# A benchmark, then the CUDA parity check, on the H200 device machine in one call; results: $OUT.
# Run after the wheels' first device call (bench/README.md), with carry [".dev/b"]:
#   bash bench/gpu.sh [prefill.py args...]                       # e.g. prefill.md's H200 run
#   BENCH=memory bash bench/gpu.sh [memory.py args...]            # peak RSS
#   BENCH=pipeline bash bench/gpu.sh [gpu_pipeline.py args...]    # the decode regimes
#   BENCH=pipeline PARITY_TIMEOUT=320 PARITY_ARGS='--cases 1 --prompt-by-token --direct on,off
#     --overrides {"hidden":256,"moe_intermediate":128}' bash bench/gpu.sh --layers 16 --rounds 3
#     --block 6 --probe-mb 512 --regimes cold       # cold decode, then parity direct on and off
# Each gets --ckpt-dir /root/ckpt --out $OUT (prefill and memory: --device-kind gpu too).
# GPU_BENCH=0 skips the benchmark, PARITY_TIMEOUT=0 the parity check; BENCH_TIMEOUT; PARITY_ARGS:
# cuda_parity.py's, e.g. "--cases 2 --direct on".
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.cuda.is_available())"
start=$(date +%s)
if [ "${GPU_BENCH:-1}" = 1 ]; then
  case "${BENCH:-prefill}" in
    pipeline) script=bench/gpu_pipeline.py; more=() ;;
    *) script=bench/${BENCH:-prefill}.py; more=(--device-kind gpu) ;;
  esac
  timeout ${BENCH_TIMEOUT:-540} python3 "$script" "${more[@]}" --ckpt-dir /root/ckpt --out "$OUT" \
    "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\[' || true
  grep -E "WARNING|NOT EXACT|Error" "$OUT/bench.log" | tail -20 || true
  echo "bench: $(( $(date +%s) - start )) s"
fi
if [ "${PARITY_TIMEOUT:-120}" != 0 ]; then
  timeout ${PARITY_TIMEOUT:-120} python3 bench/cuda_parity.py --out "$OUT/cuda_parity.json" \
    ${PARITY_ARGS:-} 2>&1 | tail -40
fi
echo "total: $(( $(date +%s) - start )) s"
