#!/usr/bin/env bash
# Make .venv-pylate: PyLate, the reference library for ColBERT models, apart from batchembed's own
# .venv (PyLate pins sentence-transformers 5.3; .venv has a later one), for
# tests/test_representations.py. Idempotent. Usage: scripts/setup_references.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if .venv-pylate/bin/python -c "import pylate.models" 2>/dev/null; then
  exit 0
fi
echo "setup: creating .venv-pylate (PyLate; first time: a few minutes)"
if [ -L .venv-pylate ] && [ ! -e .venv-pylate ]; then rm .venv-pylate; fi  # a link to a folder that is gone
[ -x .venv-pylate/bin/python ] || "$PY" -m venv .venv-pylate
quiet() { grep -v -e "^WARNING: Location 'file:" -e "pylate .* requires" -e "dependency conflicts" || true; }
.venv-pylate/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
# the CPU torch batchembed's .venv has; PyLate's own pins (fast-plaid, a CUDA torch) are for its indexes,
# which the reference does not use
.venv-pylate/bin/python -m pip install -q torch==2.13.0 "sentence-transformers==5.3.0" "transformers==5.3.0" \
  datasets pandas ujson 2>&1 | quiet
.venv-pylate/bin/python -m pip install -q --no-deps "pylate==1.6.0" 2>&1 | quiet
.venv-pylate/bin/python -c "import pylate.models; print('setup: ok, pylate', __import__('pylate').__version__)"
