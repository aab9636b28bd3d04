#!/usr/bin/env bash
# Sets up the core's environment (when missing) and runs the pool demo.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(bash .ci/core_env.sh | tail -n 1)
exec "$venv/bin/python" examples/demo_pool.py "$@"
