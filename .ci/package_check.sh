#!/usr/bin/env bash
# The package as a user installs it (docs/operations.md, "Install"). Builds the sdist and the wheel
# with `python -m build` (the wheel fresh on every run), checks the sdist carries the native loops'
# sources (the copy loop, the data server's loop, the MetaService's frame loop, the BLAKE2b header),
# installs the wheel (not -e) into an environment of its own and, from a folder outside the checkout,
# runs the demo and a smoke test (tests/package/smoke_installed.py) with it. Then the same from a
# wheel built out of the sdist with no C compiler: it installs and runs on the Python loops.
#
# The environment (its dependencies: the core's and the cli extra) is reused while pyproject.toml and
# this script are unchanged, under ${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}/wheel-<hash>.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${MEMCACHE_VENV_ROOT:-$HOME/.cache/memcache/venvs}
hash=$(cat "$repo/pyproject.toml" "$repo/.ci/package_check.sh" | sha256sum | cut -c1-12)
venv="$root/wheel-$hash"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pipq() { { "$venv/bin/pip" "$@" 2>&1; } | { grep -v "WARNING: Location" || true; } >&2; }

if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "creating $venv" >&2
  rm -rf "$venv"
  mkdir -p "$root"
  "${MEMCACHE_PYTHON:-python3}" -m venv "$venv"
  pipq install -q --upgrade pip build
fi

echo "-- python -m build (sdist, then the wheel from it)"
"$venv/bin/python" -m build --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/memcache_python-*.tar.gz)
wheel=$(ls "$work"/dist/memcache_python-*.whl)
echo "built $(basename "$sdist") and $(basename "$wheel")"
# (listings go to files first: grep -q closing a pipe early would fail the pipeline under pipefail)
tar tzf "$sdist" > "$work/sdist.txt"
for src in transfer/copyloop.c transfer/dataloop.c rpc/frameloop.c native/blake2b.h; do
  grep -q "/memcache_core/$src\$" "$work/sdist.txt" || { echo "the sdist lacks $src" >&2; exit 1; }
done
listing() { "$venv/bin/python" -m zipfile -l "$1" > "$work/listing.txt"; cat "$work/listing.txt"; }
loop=python
if "$venv/bin/python" -c "import sysconfig, shutil, sys; sys.exit(not shutil.which(sysconfig.get_config_var('CC').split()[0]))"; then
  loop=native   # a compiler was there: the wheel must carry the loop
  for lib in _copyloop _dataloop; do
    listing "$wheel" | grep -c "memcache_core/transfer/$lib" >/dev/null \
      || { echo "a C compiler is here but the wheel has no $lib" >&2; cat "$work/build.log"; exit 1; }
  done
  if [ -f "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")/Python.h" ]; then
    grep -c 'memcache_core/rpc/_frameloop' "$work/listing.txt" >/dev/null \
      || { echo "a C compiler and Python.h are here but the wheel has no native frame loop" >&2; exit 1; }
  fi
fi

if [ ! -f "$venv/.complete" ]; then
  pipq install -q "$wheel[cli]"          # the dependencies, once
  touch "$venv/.complete"
fi
pipq install -q --force-reinstall --no-deps "$wheel"
"$venv/bin/pip" check >&2

# Outside the checkout, with nothing of it on the path: what runs is what the wheel installed.
cp "$repo/examples/demo_pool.py" "$repo/tests/package/smoke_installed.py" "$work/"
cd "$work"
run() { env -u PYTHONPATH "$venv/bin/python" "$@"; }
echo "-- the demo, from the installed wheel"
run demo_pool.py --blocks 4 > "$work/demo.log" 2>&1 || { cat "$work/demo.log"; exit 1; }
grep -v '^  \[rank' "$work/demo.log" | tail -n 3
echo "-- smoke test, from the installed wheel"
run smoke_installed.py --loop "$loop" --checkout "$repo"

echo "-- a wheel built from the sdist without a C compiler"
tar xzf "$sdist" -C "$work"
CC=/bin/false "$venv/bin/python" -m build --wheel --outdir "$work/nocc" "$work/$(basename "$sdist" .tar.gz)" > "$work/nocc.log" 2>&1 \
  || { sed 's/^/  /' "$work/nocc.log"; exit 1; }
nocc=$(ls "$work"/nocc/memcache_python-*.whl)
if listing "$nocc" | grep -Ec '_copyloop|_dataloop|_frameloop' >/dev/null; then
  echo "CC=/bin/false still built a native loop" >&2; exit 1
fi
pipq install -q --force-reinstall --no-deps "$nocc"
run smoke_installed.py --loop python --checkout "$repo"
pipq install -q --force-reinstall --no-deps "$wheel"   # leave the full wheel installed
echo "package check passed"
