#!/usr/bin/env bash
# The pool's image, built from the repository's Dockerfile (the one users build with docker) and run.
#
# No registry is needed: the Dockerfile's base (ARG BASE, a Debian bookworm) is made here from Debian's
# packages with mmdebstrap and imported into buildah's storage; buildah builds the Dockerfile without a
# daemon (chroot isolation; overlay storage where the kernel mounts one, else vfs), apt and pip inside
# the build reaching their mirrors as in a docker build. Then, in a container of the image, as its user
# (uid 1000): tests/package/image_check.py (/dev/shm, the entrypoint's command, pyzmq, a MetaService
# with kv_events_enable whose events a ZeroMQ subscriber receives), the demo (examples/demo_pool.py: a
# MetaService and three LocalServices, every read checked byte for byte) and the smoke test of the
# installed package (tests/package/smoke_installed.py: the `memcache` command, the native copy loop).
#
# Runs as root (mmdebstrap's root mode, the overlay probe); installs mmdebstrap and buildah with apt-get
# when they are missing. Keeps the base (a tarball, made again each ISO week or when its mmdebstrap
# command changes) and buildah's storage with its cache of layers under
# ${MEMCACHE_IMAGE_CACHE:-$HOME/.cache/memcache/images}: a second run rebuilds only what the sources
# changed. Exits non-zero on any failure; removes its containers.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${MEMCACHE_IMAGE_CACHE:-$HOME/.cache/memcache/images}
image=memcache-python:0.1.0
t0=$SECONDS
step() { echo "-- $* ($((SECONDS - t0)) s)"; }

if ! command -v mmdebstrap >/dev/null || ! command -v buildah >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "mmdebstrap and buildah are needed (Debian: apt-get install mmdebstrap buildah)" >&2; exit 1
  fi
  step "installing mmdebstrap and buildah"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap buildah || { apt-get update -qq && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap buildah; }; } >/dev/null
fi

mkdir -p "$cache"
# one run at a time per cache (a second waits): a run prunes and, on a new base, empties the storage
exec 9>"$cache/lock"
flock 9
work=$(mktemp -d)
containers=()
cleanup() {
  for c in ${containers[@]+"${containers[@]}"}; do bh rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# buildah with its own storage under the cache and chroot isolation (no runtime, no namespaces to set
# up beyond a chroot). Its storage driver: overlay where the kernel mounts an overlay here (layers
# shared, not copied: a cached build takes seconds), else vfs (every layer and container a full copy
# of its tree, which needs nothing of the kernel); MEMCACHE_IMAGE_STORAGE_DRIVER chooses.
driver=${MEMCACHE_IMAGE_STORAGE_DRIVER:-}
if [ -z "$driver" ]; then
  driver=vfs
  probe="$cache/overlay-probe"
  rm -rf "$probe" && mkdir -p "$probe"/{lower,upper,work,merged}
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" \
       2>/dev/null; then
    umount "$probe/merged" && driver=overlay
  fi
  rm -rf "$probe"
fi
bh() { buildah --root "$cache/storage-$driver" --runroot "$cache/run-$driver" --storage-driver "$driver" "$@"; }
export BUILDAH_ISOLATION=chroot
echo "buildah storage: $driver, under $cache"

# ---- the base: Debian bookworm, minbase, with merged /usr and debian:bookworm-slim's path excludes.
# Certificate authorities this host adds to Debian's (/usr/local/share/ca-certificates: a proxy's, say)
# go into the base where an organisation's own base image carries its own: ca-certificates, which the
# Dockerfile installs, puts them in the bundle that pip checks PyPI's certificate against.
mirror=${MEMCACHE_DEBIAN_MIRROR:-http://deb.debian.org}
debstrap=(mmdebstrap --quiet --variant=minbase --format=tar --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
for opt in 'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' 'path-exclude=/usr/share/doc/*' \
           'path-include=/usr/share/doc/*/copyright' 'path-exclude=/usr/share/locale/*' \
           'path-include=/usr/share/locale/locale.alias'; do
  debstrap+=(--dpkgopt="$opt")
done
local_cas=(/usr/local/share/ca-certificates/*.crt)
if [ -e "${local_cas[0]}" ]; then
  debstrap+=(--customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"'
             --customize-hook="cp $(printf '%q ' "${local_cas[@]}")\"\$1/usr/local/share/ca-certificates/\"")
else
  local_cas=()
fi
debstrap+=(bookworm)
sources=("deb $mirror/debian bookworm main" "deb $mirror/debian bookworm-updates main"
         "deb $mirror/debian-security bookworm-security main")
key=$(date -u +%G-w%V)-$({ printf '%s\n' "${debstrap[@]}" "${sources[@]}"; cat ${local_cas[@]+"${local_cas[@]}"}; } \
  | sha256sum | cut -c1-8)
base_tar="$cache/bookworm-$key.tar"
base="localhost/memcache-base:bookworm-$key"
if [ ! -f "$base_tar" ]; then
  step "making the base with mmdebstrap ($base_tar)"
  rm -f "$cache"/bookworm-*.tar
  "${debstrap[@]}" "$base_tar.part" "${sources[@]}" > "$work/mmdebstrap.log" 2>&1 \
    || { cat "$work/mmdebstrap.log"; exit 1; }
  mv "$base_tar.part" "$base_tar"
fi
if ! bh inspect --type image "$base" >/dev/null 2>&1; then
  step "importing the base into buildah's storage as $base"
  # a new base: the layers cached on the old one will never be used again
  bh rm --all >/dev/null 2>&1 || true
  bh rmi --all --force >/dev/null 2>&1 || true
  c=$(bh from scratch); containers+=("$c")
  bh add --quiet "$c" "$base_tar" /
  bh config --cmd '["bash"]' --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
  bh commit --quiet --rm "$c" "$base" >/dev/null
  containers=()
fi

# ---- the build. Its stages' layers are cached (--layers): the first stage's result is tagged as well,
# so that pruning what this build left untagged keeps them, and an unchanged tree rebuilds nothing.
step "buildah bud (the Dockerfile, target pool, FROM $base)"
bud() { bh bud --layers --pull=never --isolation chroot --build-arg "BASE=$base" -f "$repo/Dockerfile" "$@" "$repo"; }
{ bud --target wheel -t memcache-python-wheel:ci && bud --target pool -t "$image"; } > "$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
echo "  $(grep -c -- '--> Using cache' "$work/build.log") of $(grep '] STEP ' "$work/build.log" | grep -vc ': FROM ') steps from the layer cache"
bh rmi --prune >/dev/null 2>&1 || true   # what earlier builds left untagged
bh images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -F "$image" || true

# ---- the image, run: a container of it, as its own user, with this checkout's example and checks
# mounted read-only (nothing of the checkout is installed: what runs is what the image holds)
c=$(bh from --pull=never --quiet "$image"); containers+=("$c")
run() { bh run --isolation chroot -v "$repo/examples:/check/examples:ro" -v "$repo/tests/package:/check/package:ro" \
  "$c" -- "$@"; }
step "in the image: image_check.py (user, /dev/shm, entrypoint, KV events)"
entrypoint=$(bh inspect --format '{{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.User}}' "$c")
run python3 /check/package/image_check.py --entrypoint-and-user "$entrypoint"
step "in the image: the demo (a MetaService, three LocalServices, byte-exact reads)"
run python3 /check/examples/demo_pool.py --blocks 4 > "$work/demo.log" 2>&1 || { cat "$work/demo.log"; exit 1; }
grep -v '^  \[rank' "$work/demo.log" | tail -n 3
step "in the image: smoke test of the installed package (native copy loop)"
run python3 /check/package/smoke_installed.py --loop native --checkout /check
step "image check passed"
