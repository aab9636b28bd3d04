"""Real SGLang servers on this CPU with the ``npu_memcache`` backend, and the MetaService they join.

For the SGLang engine tests, ``benchmarks/bench_sglang_ttft.py`` and ``examples/sglang/serve_cpu.py``
(the command line over this module), as :mod:`memcache_core.testing` is for the core's:
:func:`start_meta` starts a MetaService (``python -m memcache_sglang.start_meta_service``) on free
ports, :func:`start_server` an SGLang server joined to its pool (page 128, write-through, the
``layer_first`` host layout, ``--device cpu``) that is ready once *its* process answers ``/health``;
the handles stop exactly the process groups they started and tell, for a failure report, whether a
server is alive or died and the tail of its log. What they start dies with the process that started
it (``memcache_core.testing.die_with_parent``: a killed test run leaves no server behind) unless
started ``detached``, as the command line's servers are, which outlive it. :func:`ensure_model` makes the tiny local model
with ``examples/make_tiny_model.py``, so it needs a checkout of this repository.

Imports only the standard library (and :mod:`memcache_core.testing`), so the command line runs
under any Python before the SGLang environment exists; the processes it starts run the ``python``
they are given.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memcache_core.testing import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]   # the checkout (the package is installed editable)
CACHE = Path(os.environ.get("MEMCACHE_CACHE_DIR") or Path.home() / ".cache" / "memcache")
SERVER_READY_TIMEOUT_S = 300.0
META_READY_TIMEOUT_S = 60.0


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class PortTaken(RuntimeError):
    """Another process took the port between ``free_port()`` and the server's bind."""


def listens_on(pgid: int, port: int) -> bool | None:
    """Whether a process of group ``pgid`` (a server we started) listens on ``port``; None when
    psutil is missing. A /health answer alone can come from whoever else holds the port."""
    try:
        import psutil
    except ImportError:
        return None
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return os.getpgid(conn.pid) == pgid
            except ProcessLookupError:
                return False
    return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def terminate(pid: int | None, timeout_s: float = 30.0) -> int | None:
    """SIGTERM the process group we started (``start_new_session``), then SIGKILL after a deadline.

    Returns the leader's exit status when this process reaped it (it is our child), else None.
    """
    if not pid:
        return None
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                reaped, status = os.waitpid(pid, os.WNOHANG)
                if reaped == pid:
                    return os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # not our child: poll for its exit
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return None
            time.sleep(0.1)
    return None


def ensure_model(python: str, model_args: list[str] | None = None) -> str:
    """The directory of the tiny local model (``model_args`` pick its shape), made when missing."""
    script = REPO / "examples" / "make_tiny_model.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the tiny model is made from a checkout of this "
                                "repository")
    cmd = [python, str(script), *(model_args or [])]
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]


@dataclass
class MetaHandle:
    """A MetaService started by us (restartable on the same ports), or one we only point at."""

    config_path: str
    meta_service_url: str
    config_store_url: str
    metrics_url: str
    python: str = sys.executable
    log_path: str = ""
    pid: int | None = None
    launcher: str = "memcache_sglang.start_meta_service"  # any module taking --config_path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, path: str, python: str = sys.executable) -> MetaHandle:
        cfg = json.loads(Path(path).read_text())
        return cls(path, cfg["meta_service_url"], cfg["config_store_url"], cfg["metrics_url"], python)

    def start(self, timeout_s: float = META_READY_TIMEOUT_S, detached: bool = False) -> MetaHandle:
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen([self.python, "-m", self.launcher, "--config_path", self.config_path],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                start_new_session=True, preexec_fn=None if detached else die_with_parent())
        log.close()
        self.pid = proc.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.pid = None
                raise RuntimeError(f"MetaService exited with {proc.returncode}; see {self.log_path}")
            if http_ok(self.metrics_url + "/health"):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"MetaService not healthy within {timeout_s:.0f}s; see {self.log_path}")

    def admin(self, path: str) -> Any:
        """GET an admin route of the MetaService with the pool's admin token."""
        from memcache_core.auth import admin_token, load_secret
        secret_path = json.loads(Path(self.config_path).read_text()).get("auth_secret_path", "")
        req = urllib.request.Request(self.metrics_url + path,
                                     headers={"Authorization": f"Bearer {admin_token(load_secret(secret_path))}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.pid is None:
            return
        if sig == signal.SIGKILL:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        terminate(self.pid, timeout_s=10.0)
        self.pid = None

    def backend_config(self, **extra: Any) -> dict[str, Any]:
        """The ``--hicache-storage-backend-extra-config`` of a server joining this pool."""
        return {"meta_service_url": self.meta_service_url, "config_store_url": self.config_store_url,
                "metrics_url": self.metrics_url, "log_level": "info", "world_size": 256,
                "protocol": "host_shm", "dram_size": "512MB", "prefetch_threshold": 1, **extra}


def start_meta(run_dir: str | Path, python: str = sys.executable, launcher: str | None = None,
               env: dict[str, str] | None = None, detached: bool = False, **meta_config: Any) -> MetaHandle:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"meta_service_url": f"tcp://127.0.0.1:{free_port()}",
           "config_store_url": f"tcp://127.0.0.1:{free_port()}",
           "metrics_url": f"http://127.0.0.1:{free_port()}", "log_level": "info", **meta_config}
    path = run_dir / "metaservice_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    meta = MetaHandle(str(path), cfg["meta_service_url"], cfg["config_store_url"], cfg["metrics_url"],
                      python, str(run_dir / "meta.log"), env=dict(env or {}))
    if launcher:
        meta.launcher = launcher
    return meta.start(detached=detached)


def log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ServerHandle:
    port: int
    pid: int
    log_path: str
    model: str
    extra_config: dict[str, Any] = field(default_factory=dict)
    returncode: int | None = None  # set once the process is seen to have exited
    stopped: bool = False  # stopped through stop(), not died on its own

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exit_status(self) -> int | None:
        """None while the server process runs; its exit status (or -signal) once it has exited."""
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not our child (started by another process): probe it
            try:
                os.kill(self.pid, 0)
                return None
            except ProcessLookupError:
                self.returncode = -1
                return self.returncode
        if pid == 0:
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def describe(self, lines: int = 40) -> str:
        """Alive or dead (with its exit status), and the tail of its log: what a failure report needs."""
        status = self.exit_status()
        if self.stopped:
            state = f"stopped by the caller (exit status {status})"
        else:
            state = "running" if status is None else f"EXITED with status {status}"
        return (f"SGLang server on port {self.port} (pid {self.pid}): {state}; last {lines} lines of "
                f"{self.log_path}:\n{log_tail(self.log_path, lines)}")

    def stop(self) -> None:
        if self.exit_status() is None:  # else: it died on its own; keep that status
            self.stopped = True
        # The whole process group: scheduler children may outlive the main process.
        status = terminate(self.pid)
        if self.returncode is None:
            self.returncode = status
        deadline = time.monotonic() + 30
        while not port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)  # SGLang's socket lingers a few seconds after exit


def sglang_command(python: str, model: str, port: int, extra_config: dict[str, Any],
                   extra_args: list[str] | None = None) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--sleep-on-idle", "--page-size", "128", "--mem-fraction-static", "0.3",
            "--max-total-tokens", "12800", "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-write-policy", "write_through", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "npu_memcache",
            "--hicache-storage-backend-extra-config", json.dumps(extra_config), *(extra_args or [])]


def start_server(port: int, meta: MetaHandle, *, python: str = sys.executable, model: str | None = None,
                 log_path: str | Path | None = None, extra_config: dict[str, Any] | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = SERVER_READY_TIMEOUT_S, detached: bool = False) -> ServerHandle:
    """Start SGLang on 127.0.0.1:port joined to ``meta``'s pool; return once /health answers."""
    model = model or ensure_model(python)
    cfg = meta.backend_config(**(extra_config or {}))
    log_path = Path(log_path or CACHE / "run" / f"sglang-{port}" / "server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Stopping the server (SIGTERM to its process group) reads to SGLang as a crashed scheduler: its
    # crash diagnostics (py-spy and CUDA core dumps, neither of use on the CPU) first sleep 5 s.
    child_env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1",
                 "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", **(env or {})}
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(sglang_command(python, model, port, cfg, extra_args), stdout=log,
                            stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                            preexec_fn=None if detached else die_with_parent())
    log.close()
    server = ServerHandle(port, proc.pid, str(log_path), model, cfg)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.returncode = proc.returncode
            raise RuntimeError(f"SGLang exited during start-up. {server.describe()}")
        if "address already in use" in log_tail(log_path, 20):
            server.stop()
            raise PortTaken(f"port {port} was taken before SGLang bound it. {server.describe()}")
        # Ready only when *our* server answers: the port may be held by another process.
        if http_ok(f"{server.url}/health", timeout=5) and listens_on(proc.pid, port) is not False:
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"SGLang not ready within {timeout_s:.0f}s. {server.describe()}")
