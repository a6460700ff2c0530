#!/usr/bin/env bash
# Install SGLang for kvcheck's `sglang@VERSION` target, CPU only.
#
#   scripts/install-sglang.sh 0.5.23
#
# What it does (idempotent; a second run is a no-op):
#   1. checks that VERSION is the one kvcheck supports (impl/sglang/compat.py);
#   2. needs the shared .venv with vLLM's core dependencies (torch 2.13.0 CPU,
#      triton, apache-tvm-ffi, transformers: requirements-vllm.txt), installing
#      them if missing;
#   3. installs `sglang==VERSION` and the few packages of requirements-sglang.txt
#      WITHOUT their dependencies into .sglang/VERSION (`pip install --no-deps
#      --target`; no GPU packages), chosen at run time by PYTHONPATH;
#   4. checks that the scheduler-side objects import (with impl/sglang/shims.py).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

VERSION=${1:-}
if [ -z "$VERSION" ] || [ "$VERSION" = "-h" ] || [ "$VERSION" = "--help" ]; then
    echo "usage: scripts/install-sglang.sh VERSION   (e.g. 0.5.23)" >&2
    exit 2
fi

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    for p in python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1; then PYTHON=$p; break; fi
    done
fi
[ -n "$PYTHON" ] || { echo "install-sglang: no python3 found" >&2; exit 1; }

# 1. Supported release?
if ! problem=$("$PYTHON" -c '
import sys
sys.path.insert(0, ".")
from impl.sglang.compat import release_problem
p = release_problem(sys.argv[1])
print(p or "")
sys.exit(1 if p else 0)
' "$VERSION"); then
    echo "install-sglang: $problem" >&2
    exit 2
fi

FIND_LINKS=()
if [ -d /opt/wheels ]; then FIND_LINKS=(--find-links /opt/wheels); fi

# 2. The shared environment (torch, triton, tvm-ffi, transformers, ...).
if [ ! -x .venv/bin/python ]; then
    echo "install-sglang: creating .venv"
    "$PYTHON" -m venv .venv
fi
REQ_SUM=$(sha256sum requirements-vllm.txt | cut -c1-16)
STAMP=.venv/.kvcheck-vllm-deps-$REQ_SUM
if [ ! -e "$STAMP" ]; then
    echo "install-sglang: installing the shared core dependencies (requirements-vllm.txt)"
    .venv/bin/pip install --quiet "${FIND_LINKS[@]}" -r requirements-vllm.txt
    rm -f .venv/.kvcheck-vllm-deps-*
    touch "$STAMP"
fi

# 3. sglang and its missing pure-Python imports, without dependencies, in one folder.
DEST=.sglang/$VERSION
DEPS_SUM=$(sha256sum requirements-sglang.txt | cut -c1-16)
if [ -f "$DEST/sglang/__init__.py" ] && [ -d "$DEST/sglang-$VERSION.dist-info" ] \
        && [ -e "$DEST/.deps-$DEPS_SUM" ]; then
    echo "install-sglang: sglang $VERSION already installed in $DEST"
    exit 0
fi
mkdir -p .sglang
TMP=.sglang/.partial-$VERSION-$$
trap 'rm -rf "$TMP"' EXIT
echo "install-sglang: installing sglang==$VERSION into $DEST (no dependencies; ~40 MB download)"
.venv/bin/pip install --quiet --no-deps --no-compile "${FIND_LINKS[@]}" \
    --target "$TMP" "sglang==$VERSION" -r requirements-sglang.txt
if [ ! -d "$TMP/sglang-$VERSION.dist-info" ]; then
    echo "install-sglang: pip did not install sglang $VERSION" >&2
    exit 1
fi
touch "$TMP/.deps-$DEPS_SUM"
rm -rf "$DEST"
mv "$TMP" "$DEST"

# 4. The scheduler-side objects must import.
if ! PYTHONPATH="$DEST:$ROOT" .venv/bin/python -c \
    'from impl.sglang.shims import install; install(); import sglang.srt.managers.schedule_batch, sglang.srt.managers.schedule_policy, sglang.srt.mem_cache.swa_memory_pool, sglang.srt.mem_cache.unified_radix_cache, sglang.srt.mem_cache.radix_cache' \
        2>/tmp/kvcheck-sglang-import.$$; then
    echo "install-sglang: sglang $VERSION installed but its scheduler objects do not import:" >&2
    tail -5 /tmp/kvcheck-sglang-import.$$ >&2
    rm -f /tmp/kvcheck-sglang-import.$$
    exit 1
fi
rm -f /tmp/kvcheck-sglang-import.$$
echo "install-sglang: sglang $VERSION ready (use --target sglang@$VERSION)"
