#!/usr/bin/env bash
# Create (or reuse) the virtual environment that runs the vLLM integration tests.
#
# The venv lives outside the repository, at
#   ${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}/vllm-<hash of requirements>
# and is reused while tests/engines/vllm/requirements.txt is unchanged. The
# current checkout is installed into it (editable, no deps) on every run.
# The venv path is printed on the last line of stdout.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$REPO/tests/engines/vllm/requirements.txt"
PYTHON="${PYTHON:-python3.11}"
HASH="$(sha256sum "$REQ" | cut -c1-12)"
ROOT="${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}"
VENV="$ROOT/vllm-$HASH"

log() { echo "[vllm_env] $*" >&2; }

if [ ! -f "$VENV/.complete" ]; then
    log "building $VENV"
    rm -rf "$VENV"
    mkdir -p "$ROOT"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q -r "$REQ" >&2
    # PyPI's torchvision/torchaudio/torchcodec builds are CUDA builds that break
    # transformers' model imports beside the CPU torch; triton is unused on CPU.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >&2 || true
    "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$VENV/.complete"
else
    log "reusing $VENV"
fi

# The core's own dependencies (small) and the current checkout.
"$VENV/bin/python" -m pip install -q msgspec numpy xxhash >&2
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if "$VENV/bin/python" -m pip install -q --no-deps -e "$REPO" >&2; then
    rm -f "$SITE/memcache_repo_src.pth"
else
    log "editable install of the repo failed; putting the checkout on the path instead"
    echo "$REPO" > "$SITE/memcache_repo_src.pth"
fi
# The connector package must be importable in vLLM's spawned processes, whether
# or not the project's packaging lists it.
echo "$REPO/integrations" > "$SITE/memcache_vllm_src.pth"

echo "$VENV"
