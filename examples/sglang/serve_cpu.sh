#!/usr/bin/env bash
# Start a MetaService and a real SGLang server (CPU, npu_memcache L3 backend) on 127.0.0.1:PORT.
# Usage: examples/sglang/serve_cpu.sh --port PORT [--meta-config F] [--extra-config JSON] [-- sglang flags]
exec python3 "$(dirname "${BASH_SOURCE[0]}")/serve_cpu.py" start "$@"
