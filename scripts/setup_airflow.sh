#!/usr/bin/env bash
# Make .venv-airflow: Airflow 3 and its standard provider, apart from batchembed's own .venv (their
# pins differ), for tests/test_airflow_dag.py. Idempotent. Usage: scripts/setup_airflow.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if .venv-airflow/bin/python -c "import airflow.sdk, airflow.providers.standard" 2>/dev/null; then
  exit 0
fi
echo "setup: creating .venv-airflow (Airflow 3; first time: a few minutes)"
if [ -L .venv-airflow ] && [ ! -e .venv-airflow ]; then rm .venv-airflow; fi  # a link to a folder that is gone
[ -x .venv-airflow/bin/python ] || "$PY" -m venv .venv-airflow
.venv-airflow/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location 'file:" || true
.venv-airflow/bin/python -m pip install -q "apache-airflow>=3,<4" apache-airflow-providers-standard 2>&1 \
  | grep -v "^WARNING: Location 'file:" || true
.venv-airflow/bin/python -c "import airflow; print('setup: ok, airflow', airflow.__version__)"
