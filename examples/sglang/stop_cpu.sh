#!/usr/bin/env bash
# Stop what examples/sglang/serve_cpu.sh started on PORT. Usage: examples/sglang/stop_cpu.sh --port PORT
exec python3 "$(dirname "${BASH_SOURCE[0]}")/serve_cpu.py" stop "$@"
