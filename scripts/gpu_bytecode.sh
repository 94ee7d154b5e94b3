#!/usr/bin/env bash
# Compile the GPU bundle (~/site) and the image's packages that lack bytecode (torch, sympy, ...),
# as `pip install` does: ../shared/gpu unpacks wheels without it, and the lent image has none for
# some of its own packages (batchembed/embed/bytecode.py warns about that). Prints two lines: the
# packages found without bytecode, and the seconds the compile took (which no benchmark counts).
# Once per machine: ~/.batchembed-bytecode marks it done, and later calls say so and return.
#   bash scripts/gpu_bytecode.sh
set -uo pipefail
export PYTHONPATH=~/site:$PWD
MARK=~/.batchembed-bytecode
[ -f "$MARK" ] && { echo "bytecode compiled earlier on this machine ($MARK)"; exit 0; }
{ read -r lacking; read -r folders; } < <(python3 -c "from batchembed.embed import bytecode; m = bytecode.missing()
print(' '.join(sorted(m))); print(' '.join(sorted({str(f.parent) for f in m.values()})))")
t0=$(date +%s.%N)
python3 -m compileall -q -j 0 ~/site $folders > /dev/null 2>&1 || true
echo "without bytecode at the start: ${lacking:-none}; PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}"
echo "bytecode of ~/site $folders compiled first, as pip install does: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (not counted)"
touch "$MARK"
