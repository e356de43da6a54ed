#!/usr/bin/env bash
# The compatibility run: a second virtual environment (.venv-oldest) with the oldest mlx-lm release we
# support, the package installed as users get it, and the tests marked `core` (stock mlx-lm unchanged,
# the version guard, parity for one architecture per family, the CLIs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OLDEST=$(sed -n 's/.*"mlx-lm>=\([0-9.]*\),.*/\1/p' pyproject.toml)
if [ ! -x .venv-oldest/bin/python ]; then
  "$PY" -m venv .venv-oldest
fi
.venv-oldest/bin/python -m pip install -q --upgrade pip
rm -rf build  # setuptools builds in the tree: a stale build/ would install old files
.venv-oldest/bin/python -m pip install -q '.[cpu,test]' "mlx-lm==$OLDEST"
.venv-oldest/bin/python -c "import mlx_lm; print('mlx-lm', mlx_lm.__version__)"
exec .venv-oldest/bin/python -m pytest -q -m "core and not slow" "$@"
