#!/usr/bin/env bash
# The demo, from nothing: sets up .venv (the package installed non-editable, the way users get it),
# then generates with stock mlx-lm and with --streaming-experts from the small trained MoE committed in
# docs/demo-model/ (Qwen3-MoE classes, 4 layers x 8 experts, top-2, 4-bit, 4.6 MB; trained by
# docs/train_demo_model.py on the docstrings of Python's standard library, PSF License; no model hub
# needed), and shows both texts, peak memory and the stats line (learned routing: a real hit rate).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=docs/demo-model
PROMPT="The"
BUDGET=0.002 # decimal GB (10^9 bytes) of experts kept in memory: about half of the 8 experts of each layer (0.0039 GB in all)

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Linux needs an mlx backend extra; macOS wheels carry Metal
if [ "$(uname -s)" = Darwin ]; then EXTRA=""; else EXTRA="[cpu]"; fi
.venv/bin/python -m pip install -q --upgrade pip
rm -rf build  # setuptools builds in the tree: a stale build/ would install old files
.venv/bin/python -m pip install -q ".$EXTRA"

echo
.venv/bin/mlx_lm_streaming plan "$MODEL" --expert-cache-gb "$BUDGET"

generate() {
  .venv/bin/mlx_lm.generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 64 --temp 0 "$@"
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
  echo "Same text as stock mlx-lm, with half of the experts in memory: evicted ones were read again."
  echo "To run these commands yourself: source .venv/bin/activate"
else
  echo "ERROR: the streamed text differs from stock mlx-lm" >&2
  exit 1
fi
