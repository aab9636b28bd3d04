#!/usr/bin/env python3
"""Start (and stop) a real SGLang server on this CPU with the ``npu_memcache`` HiCache L3 backend.

    python examples/sglang/serve_cpu.py start --port 30000      # or examples/sglang/serve_cpu.sh
    python examples/sglang/serve_cpu.py stop --port 30000       # or examples/sglang/stop_cpu.sh

``start`` creates the SGLang environment if missing (``.ci/sglang_env.sh``), makes the tiny model
if missing (``examples/make_tiny_model.py``), starts a MemCache MetaService
(``python -m memcache_sglang.start_meta_service``) unless ``--meta-config`` names a running one,
then SGLang on 127.0.0.1:PORT with ``--hicache-storage-backend npu_memcache``, page size 128 and
write-through, and returns once the server answers ``/health``. Its state (PIDs, URLs, logs) is
kept in ``${MEMCACHE_CACHE_DIR:-~/.cache/memcache}/run/sglang-PORT/``; ``stop`` terminates exactly
the processes recorded there. This is the command line over :mod:`memcache_sglang.testing`, which
the engine tests and the TTFT benchmark use directly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Run from a checkout by any python3, before the SGLang environment (and an install) exists.
sys.path[:0] = [str(REPO), str(REPO / "integrations")]
from memcache_sglang.testing import (  # noqa: E402
    CACHE,
    MetaHandle,
    ServerHandle,
    ensure_model,
    port_is_free,
    start_meta,
    start_server,
)


def venv_python() -> str:
    """The SGLang environment's python (created by .ci/sglang_env.sh when missing)."""
    out = subprocess.run(["bash", str(REPO / ".ci" / "sglang_env.sh")], check=True, stdout=subprocess.PIPE,
                         text=True).stdout.strip().splitlines()
    return str(Path(out[-1]) / "bin" / "python")


def _state_dir(port: int) -> Path:
    return CACHE / "run" / f"sglang-{port}"


def cmd_start(args: argparse.Namespace) -> int:
    python = args.python or venv_python()
    state_dir = _state_dir(args.port)
    if (state_dir / "state.json").exists():
        print(f"a server is already recorded on port {args.port}; run stop first", file=sys.stderr)
        return 1
    if not port_is_free(args.port):
        print(f"port {args.port} is busy", file=sys.stderr)
        return 1
    model = args.model or ensure_model(python)
    meta = (MetaHandle.from_config(args.meta_config, python) if args.meta_config
            else start_meta(state_dir, python, detached=True))   # both outlive this command
    try:
        server = start_server(args.port, meta, python=python, model=model,
                              log_path=state_dir / "server.log",
                              extra_config=json.loads(args.extra_config) if args.extra_config else None,
                              extra_args=args.sglang_args, detached=True)
    except BaseException:
        meta.stop()
        raise
    state = {"server": asdict(server), "meta": asdict(meta), "owns_meta": not args.meta_config}
    (state_dir / "state.json").write_text(json.dumps(state, indent=1))
    print(f"SGLang ready at {server.url} (model {model}); MetaService config {meta.config_path}")
    print(f"logs: {server.log_path}; stop with: {sys.argv[0]} stop --port {args.port}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args.port)
    try:
        state = json.loads((state_dir / "state.json").read_text())
    except OSError:
        print(f"no server recorded on port {args.port}", file=sys.stderr)
        return 1
    ServerHandle(**state["server"]).stop()
    if state["owns_meta"]:
        MetaHandle(**state["meta"]).stop()
    shutil.rmtree(state_dir, ignore_errors=True)
    print(f"stopped the server on port {args.port}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a MetaService (unless --meta-config) and SGLang")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--model", help="model directory (default: the tiny model, made if missing)")
    s.add_argument("--meta-config", help="join the pool of a running MetaService (its JSON config)")
    s.add_argument("--extra-config", help="JSON merged into the backend's extra config")
    s.add_argument("--python", help="python of an SGLang environment (default: .ci/sglang_env.sh)")
    s.add_argument("sglang_args", nargs="*", help="more SGLang flags, after --")
    t = sub.add_parser("stop", help="stop what start recorded for this port")
    t.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    return cmd_start(args) if args.cmd == "start" else cmd_stop(args)


if __name__ == "__main__":
    sys.exit(main())
