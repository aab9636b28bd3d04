#!/usr/bin/env bash
# Creates (or reuses) the core's test environment and prints its path on the last line.
# Reused while pyproject.toml is unchanged; the checkout itself is installed editable every time.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}
hash=$(cat "$repo/pyproject.toml" "$repo/.ci/core_env.sh" | sha256sum | cut -c1-12)
venv="$root/core-$hash"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "creating $venv" >&2
  rm -rf "$venv"
  mkdir -p "$root"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -e "$repo[test,lint,ha,cli,events,bench]" >&2
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps -e "$repo" >&2
# The nixl extra, without its dependencies (a CUDA torch the data plane never imports): docs/nixl.md.
if ! "$venv/bin/python" -c "import nixl" >/dev/null 2>&1; then
  "$venv/bin/pip" install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1" >&2
fi
echo "$venv"
