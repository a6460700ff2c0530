#!/usr/bin/env bash
# Install one vLLM release for kvcheck's `vllm@VERSION` target, CPU only.
#
#   scripts/install-vllm.sh 0.33.0
#
# What it does (idempotent; a second run is a no-op):
#   1. checks that VERSION is one kvcheck supports (impl/vllm/compat.py);
#   2. creates .venv if missing and installs the pinned dependencies of vLLM's
#      core (requirements-vllm.txt: torch 2.13.0 CPU, transformers, pydantic, ...)
#      into it, shared by every installed release; skipped when unchanged;
#   3. installs `vllm==VERSION` WITHOUT its dependencies into .vllm/VERSION
#      (`pip install --no-deps --target`), chosen at run time by PYTHONPATH;
#   4. checks that the scheduler imports.
# Uses `--find-links /opt/wheels` when that directory exists (a local torch).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

VERSION=${1:-}
if [ -z "$VERSION" ] || [ "$VERSION" = "-h" ] || [ "$VERSION" = "--help" ]; then
    echo "usage: scripts/install-vllm.sh VERSION   (e.g. 0.25.1, 0.26.0, 0.33.0)" >&2
    exit 2
fi

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    for p in python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1; then PYTHON=$p; break; fi
    done
fi
[ -n "$PYTHON" ] || { echo "install-vllm: no python3 found" >&2; exit 1; }

# 1. Supported release? (impl/vllm/compat.py needs neither vLLM nor torch.)
if ! problem=$("$PYTHON" -c '
import sys
sys.path.insert(0, ".")
from impl.vllm.compat import release_problem
p = release_problem(sys.argv[1])
print(p or "")
sys.exit(1 if p else 0)
' "$VERSION"); then
    echo "install-vllm: $problem" >&2
    exit 2
fi

FIND_LINKS=()
if [ -d /opt/wheels ]; then FIND_LINKS=(--find-links /opt/wheels); fi

# 2. The shared virtual environment and the core's dependencies.
if [ ! -x .venv/bin/python ]; then
    echo "install-vllm: creating .venv"
    "$PYTHON" -m venv .venv
fi
REQ_SUM=$(sha256sum requirements-vllm.txt | cut -c1-16)
STAMP=.venv/.kvcheck-vllm-deps-$REQ_SUM
if [ ! -e "$STAMP" ]; then
    echo "install-vllm: installing vLLM's core dependencies (requirements-vllm.txt)"
    .venv/bin/pip install --quiet "${FIND_LINKS[@]}" -r requirements-vllm.txt
    rm -f .venv/.kvcheck-vllm-deps-*
    touch "$STAMP"
fi

# 3. vLLM itself, without dependencies, in its own folder.
DEST=.vllm/$VERSION
if [ -f "$DEST/vllm/__init__.py" ] && [ -d "$DEST/vllm-$VERSION.dist-info" ]; then
    echo "install-vllm: vllm $VERSION already installed in $DEST"
    exit 0
fi
mkdir -p .vllm
TMP=.vllm/.partial-$VERSION-$$
trap 'rm -rf "$TMP"' EXIT
echo "install-vllm: installing vllm==$VERSION into $DEST (no dependencies; ~300 MB download)"
.venv/bin/pip install --quiet --no-deps --no-compile "${FIND_LINKS[@]}" \
    --target "$TMP" "vllm==$VERSION"
if [ ! -d "$TMP/vllm-$VERSION.dist-info" ]; then
    echo "install-vllm: pip did not install vllm $VERSION" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$TMP" "$DEST"

# 4. The scheduler must import (the first import takes a few seconds).
if ! HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR PYTHONPATH="$DEST" .venv/bin/python -c \
    'import vllm.v1.core.sched.async_scheduler, vllm.v1.core.kv_cache_manager' 2>/tmp/kvcheck-vllm-import.$$; then
    echo "install-vllm: vllm $VERSION installed but its scheduler does not import:" >&2
    tail -5 /tmp/kvcheck-vllm-import.$$ >&2
    rm -f /tmp/kvcheck-vllm-import.$$
    exit 1
fi
rm -f /tmp/kvcheck-vllm-import.$$
echo "install-vllm: vllm $VERSION ready (use --target vllm@$VERSION)"
