#!/usr/bin/env bash
# Create (or reuse) the SGLang engine test environment and install this clone into it.
#
# The venv lives outside the repo at
#   ${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}/sglang-<hash of the requirements files>
# and is rebuilt only when the requirements change. The repository itself is installed with
# `pip install --no-deps -e` on every run, so the clone being tested is what runs.
# CPU-only scaffolding for stock SGLang (tests/engines/sglang/cpu_support) is put on the
# venv's path with a .pth file; it is test/example support, never part of the backend.
#
# Progress goes to stderr; the last line of stdout is the venv path.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ_DIR="$REPO/tests/engines/sglang"
PYTHON="${MEMCACHE_PYTHON:-python3.11}"
VENV_ROOT="${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}"
HASH="$(cat "$REQ_DIR/requirements.txt" "$REQ_DIR/requirements-nodeps.txt" | sha256sum | cut -c1-12)"
VENV="$VENV_ROOT/sglang-$HASH"

# pip, quieter: this machine's extra index paths print a warning per package.
pipq() { { "$VENV/bin/pip" "$@" 2>&1; } | { grep -v "WARNING: Location" || true; } >&2; }

mkdir -p "$VENV_ROOT"
exec 9>"$VENV_ROOT/.sglang-$HASH.lock"
flock 9

if [[ ! -f "$VENV/.complete" ]]; then
    echo "creating SGLang venv $VENV (a few minutes)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pipq install -q --upgrade pip setuptools wheel
    pipq install -q -r "$REQ_DIR/requirements.txt"
    pipq install -q --no-deps -r "$REQ_DIR/requirements-nodeps.txt"
    touch "$VENV/.complete"
fi

# The core's own (small) dependencies: the checkout below is installed without its dependencies.
pipq install -q msgspec numpy xxhash

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# CPU scaffolding (torchvision stand-in, sgl_kernel stub, CPU host-pool plugin).
echo "$REQ_DIR/cpu_support" > "$SITE/memcache_sglang_cpu_support.pth"

if [[ -f "$REPO/pyproject.toml" ]]; then
    pipq install -qq --no-deps --no-build-isolation -e "$REPO"
else
    echo "warning: $REPO/pyproject.toml missing; repo not installed into the venv" >&2
fi
echo "$VENV"
