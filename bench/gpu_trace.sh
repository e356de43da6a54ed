#!/usr/bin/env bash
# Cold decode against the disk's limit on the H200 (bench/gpu_pipeline.py), then the CUDA parity check
# with direct reads on and off, in one device call (docs/benchmarks/README.md, "H200").
#
# Before it, from the project root here: ../shared/tools/mlx-cuda-wheels.sh, then one device call
#   carry [".dev/a"]: mkdir -p /root/stash && cp .dev/a/* /root/stash/
# then this, in a second call on the same warm machine:
#   carry [".dev/b"]: bash bench/gpu_trace.sh [gpu_pipeline args...]
# BENCH_TIMEOUT, PARITY_TIMEOUT (0: skip).
set -u
source "$(dirname "$0")/gpu_env.sh"
start=$(date +%s)
timeout ${BENCH_TIMEOUT:-300} python3 bench/gpu_pipeline.py --ckpt-dir /root/ckpt --out "$OUT" \
  --layers 16 --rounds 3 --block 6 --probe-mb 512 --regimes cold --variants default "$@" 2>&1 \
  | tee "$OUT/gpu_pipeline.log" | grep -v '^{' | grep -v '^|'
grep '^|\|^###\|disk GB/s' "$OUT/gpu_pipeline.log" | tail -40
echo "bench: $(( $(date +%s) - start )) s"
if [ "${PARITY_TIMEOUT:-320}" != 0 ]; then
  timeout ${PARITY_TIMEOUT:-320} python3 bench/cuda_parity.py --out "$OUT/cuda_parity.json" --cases 1 \
    --prompt-by-token --direct on,off --overrides '{"hidden": 256, "moe_intermediate": 128}' 2>&1 | tail -30
fi
echo "total: $(( $(date +%s) - start )) s"
