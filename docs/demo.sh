#!/usr/bin/env bash
# The demo, from nothing: sets up .venv (the package installed non-editable, the way users get it),
# builds a small random-weight MoE checkpoint locally (no model hub needed), then generates with
# stock mlx-lm and with --streaming-experts, and shows both texts, peak memory and the stats line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=.venv/demo-model
PROMPT="Tell me about streaming experts"
BUDGET=0.1 # GB of experts kept in memory: a fifth of the demo model's 0.47 GB

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Linux needs an mlx backend extra; macOS wheels carry Metal
if [ "$(uname -s)" = Darwin ]; then EXTRA=""; else EXTRA="[cpu]"; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q ".$EXTRA"

if [ ! -f "$MODEL/config.json" ]; then
  echo "Building the demo checkpoint in $MODEL (Qwen3-MoE layout, 8 layers x 64 experts, 4-bit,"
  echo "random weights, ~0.5 GB) ..."
  .venv/bin/python -m mlx_lm_streaming.synthetic "$MODEL" --arch qwen3_moe --layers 8 \
    --hidden 1024 --moe-intermediate 512 --experts 64 --top-k 4
fi
echo
.venv/bin/mlx_lm_streaming plan "$MODEL" --expert-cache-gb "$BUDGET"

generate() {
  .venv/bin/mlx_lm.generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 32 --temp 0 "$@"
}
text() { # the generated text: what mlx_lm.generate prints between its ========== lines
  awk '/^==========$/ {n++; next} n == 1' <<<"$1"
}

echo
echo "== stock mlx-lm: every expert in memory"
stock=$(generate)
echo "$stock"
echo
echo "== mlx-lm --streaming-experts --expert-cache-gb $BUDGET --streaming-stats"
streamed=$(generate --streaming-experts --expert-cache-gb "$BUDGET" --streaming-stats 2>&1)
echo "$streamed"
echo
if [ "$(text "$stock")" = "$(text "$streamed")" ]; then
  echo "Same text as stock mlx-lm (the weights are random, so the text is not meant to read well)."
else
  echo "ERROR: the streamed text differs from stock mlx-lm" >&2
  exit 1
fi
