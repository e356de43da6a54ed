#!/usr/bin/env bash
# Sets up a virtual environment (.venv), installs the package with its CPU and test extras (not
# editable: the startup hook must be installed the way users get it), and runs the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
rm -rf build  # setuptools builds in the tree: a stale build/ would install old files
.venv/bin/python -m pip install -q '.[cpu,test]'
exec .venv/bin/python -m pytest -q "$@"
