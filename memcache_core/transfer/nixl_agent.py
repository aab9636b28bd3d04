"""Making NIXL agents (UCX backend) for ``nixl.py``: the UCX defaults, the progress thread's poll timeout,
nixl's logging, and a probe of the backend in a child process.

The probe. A UCX backend that UCX refuses (``uct_iface_open ... Invalid parameter``) leaves the agent
half made, and tearing it down has been seen to crash the process with SIGSEGV instead of raising:
a native crash of an optional transport must not take down the process that hosts the pool. So the
first agent of a process (per UCX settings) is made in a child process first (``probe``, about a
second, once): a refusal there is an ``InvalidParameter`` here, naming the settings; a child that
crashes is one too, naming the signal; only settings the child accepted are used in this process.

UCX defaults. NIXL's UCX backend takes UCX settings in its ``engine_config`` parameter and applies each
one only where the environment does not set that ``UCX_`` variable, so the user's environment always
wins and this process's environment is left as it was (an engine's own UCX users see nothing of ours).
The defaults are for UCX's **tcp** transport and change nothing on the others: its segments (the most
one send or receive buffer holds, 8 KiB by default) are raised to ``TCP_SEG``, which cut the CPU a
READ costs per GB by ~3x on the development machine (the owner answers an emulated READ in
segment-sized messages; benchmarks/README.md, "NIXL alone"). Where the environment sets either
segment size, neither default applies: UCX refuses a receive segment smaller than the send segment.

UCX's process-wide options. Two settings are not a backend's: UCX reads them from the environment
once, when its library loads (at the first backend), so they are put into the environment, each only
where it is unset (``UCX_PROCESS_DEFAULTS``). ``LOG_FILE``: UCX logs to stdout otherwise, which belongs
to the application. ``MODULES``: the UCX in NIXL's wheel carries its own copies of rdma-core
(libibverbs, libmlx5) and libnl, and all its InfiniBand modules use them but one: ``efa`` (AWS's Elastic Fabric
Adapter) links the host's ``libefa.so.1``, which brings the host's libibverbs and libnl into the
process beside the wheel's copies. The host's libnl-route then binds its symbols to the wheel's copy
(another version, other structure layouts), and its destructor crashes the process at exit
(``rtnl_tc_unregister``, SIGSEGV), every process that made a backend, on any host with Debian's
``ibverbs-providers`` (or another rdma-core with libefa) installed. ``^efa`` keeps that one module
out; InfiniBand and RoCE (the ``ib`` and ``mlx5`` modules, on the wheel's own libraries) are unchanged.

The probe exits like any process does (its agent torn down, the interpreter's exit, the libraries'
destructors), so settings whose libraries crash a process at exit (an environment that lets ``efa``
in on such a host) are refused here, with the signal named, instead of killing this process at exit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from ..errors import InvalidParameter

logger = logging.getLogger(__name__)

PROGRESS_POLL_US = 1000       # the progress thread's poll timeout: 1 ms, the least above 0 (a busy poll)
TCP_SEG = "64k"
UCX_DEFAULTS = {"TCP_TX_SEG_SIZE": TCP_SEG, "TCP_RX_SEG_SIZE": TCP_SEG}
# UCX's global options, read from the environment when its library loads; set where unset (docstring)
UCX_PROCESS_DEFAULTS = {"LOG_FILE": "stderr", "MODULES": "^efa"}

PROBE_TIMEOUT_S = 60.0
PROBE_REFUSED = 3             # the probe's exit status when UCX refused the settings (its message on stdout)

_make_lock = threading.Lock()
_probe_lock = threading.Lock()
_probed: dict[str, str | None] = {}   # settings -> why the probe failed (None: it made the backend)


def ucx_settings() -> dict[str, str]:
    """The UCX settings the agents run with (beyond UCX's own defaults): ours, or the environment's."""
    out = dict(item.split("=", 1) for item in engine_config().split(",") if item)
    out.update((k[4:], v) for k, v in os.environ.items() if k.startswith("UCX_"))
    return out


def engine_config() -> str:
    """The backend's ``engine_config``: our defaults, none of them where the environment sets either
    segment size (UCX refuses a receive segment smaller than the send segment: the two go together)."""
    if any(f"UCX_{k}" in os.environ for k in UCX_DEFAULTS):
        return ""
    return ",".join(f"{k}={v}" for k, v in UCX_DEFAULTS.items())


def ucx_environment() -> None:
    """UCX's process-wide options (``UCX_PROCESS_DEFAULTS``), where the environment does not set them:
    before UCX's library loads, which reads them then and only then (module docstring)."""
    for key, value in UCX_PROCESS_DEFAULTS.items():
        os.environ.setdefault(f"UCX_{key}", value)


def own_nixl_logging() -> None:
    """nixl configures its logger on import to print INFO lines (agent names) on stdout, which belongs
    to the application: send its warnings and errors through the application's logging instead. UCX
    too prints to stdout unless told otherwise (``UCX_LOG_FILE``, in ``ucx_environment``)."""
    ucx_environment()
    import nixl  # noqa: F401 - configures the "nixl" logger

    log = logging.getLogger("nixl")
    for h in list(log.handlers):
        log.removeHandler(h)
    log.setLevel(logging.WARNING)
    log.propagate = True


def make_agent(name: str, progress: bool, params: dict[str, str] | None = None) -> Any:
    """A NIXL agent (UCX backend, thread-safe) with our UCX defaults (``params`` adds backend parameters),
    once a child process made one with the same settings (``probe``). Settings UCX refuses, or that
    crash the child, are an ``InvalidParameter``."""
    probe(params or {})
    return _make(name, progress, params)


def probe(params: dict[str, str]) -> None:
    """Make the UCX backend in a child process first, once per process and settings (module docstring)."""
    ucx_environment()
    key = json.dumps([sorted(ucx_settings().items()), sorted(params.items())])
    with _probe_lock:
        if key not in _probed:
            _probed[key] = _run_probe(params)
    if _probed[key] is not None:
        raise InvalidParameter(_probed[key])


def _run_probe(params: dict[str, str]) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    code = "from memcache_core.transfer.nixl_agent import _probe_child; _probe_child()"
    ucx = " ".join(f"UCX_{k}={v}" for k, v in sorted(ucx_settings().items()) if k != "LOG_FILE")
    try:
        run = subprocess.run([sys.executable, "-c", code, json.dumps(params)], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        return (f"transfer_engine: 'nixl': making NIXL's UCX backend ({ucx}) did not finish within "
                f"{PROBE_TIMEOUT_S:g} s in a probe process")
    made = run.stdout.strip() == "ok"
    if run.returncode == 0 and made:
        return None
    if run.returncode == PROBE_REFUSED and run.stdout.strip():
        return run.stdout.strip()
    how = f"crashed with {_signal_name(-run.returncode)}" if run.returncode < 0 else \
        f"exited with status {run.returncode}"
    what = "making NIXL's UCX backend"
    if made:   # the backend was made, and the process died on its way out
        what, how = "a process that made NIXL's UCX backend", f"{how} at exit"
    tail = " | ".join(run.stderr.strip().splitlines()[-3:])
    logger.error("NIXL probe process %s; its last lines: %s", how, tail)
    return (f"transfer_engine: 'nixl': {what} with these settings ({ucx}) {how} in a "
            f"probe process, so it is not made in this one; check the UCX_ variables (UCX_MODULES: "
            f"'{UCX_PROCESS_DEFAULTS['MODULES']}' keeps out the module that loads the host's RDMA "
            f"libraries beside the wheel's; docs/nixl.md), or use transfer_engine 'builtin'")


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _probe_child() -> None:
    """The probe process: make the backend and say ``ok``, then tear it down and end like any process
    (the interpreter's exit, the libraries' destructors: a crash there is the parent's answer too).
    A backend UCX refused is half made: say why and leave without any teardown (which can crash)."""
    params = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    own_nixl_logging()
    try:
        agent = _make(f"memcache-probe-{os.getpid()}", False, params)
    except InvalidParameter as e:
        print(e, flush=True)
        os._exit(PROBE_REFUSED)
    print("ok", flush=True)
    del agent


def _make(name: str, progress: bool, params: dict[str, str] | None = None) -> Any:
    """The agent. With ``progress``, its progress thread polls with a ``PROGRESS_POLL_US`` timeout:
    NIXL's C++ config has the knob (``pthrDelay``) but the Python wrapper hard-codes 0, so the wrapper
    is handed a config class that keeps our value while it builds the agent.
    ``tests/integration/test_nixl.py`` measures an idle provider's CPU and fails when this stops working."""
    import nixl._api as api
    from nixl import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    real = api.nixlBind.nixlAgentConfig

    class _Config(real):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            real.__setattr__(self, key, PROGRESS_POLL_US if key == "pthrDelay" else value)

    conf = nixl_agent_config(enable_prog_thread=progress, backends=[],
                             sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    with _make_lock:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            agent = nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = real
    if "UCX" not in agent.plugin_list:
        raise InvalidParameter("transfer_engine: 'nixl' found no UCX backend in the nixl package")
    backend = {"engine_config": engine_config()} if engine_config() else {}
    try:
        agent.create_backend("UCX", backend | dict(params or {}))
    except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
        ucx = " ".join(f"UCX_{k}={v}" for k, v in sorted(ucx_settings().items()) if k != "LOG_FILE")
        raise InvalidParameter(f"transfer_engine: 'nixl': UCX refused its settings ({ucx}): {e}; note that "
                               "UCX_TCP_RX_SEG_SIZE may not be smaller than UCX_TCP_TX_SEG_SIZE") from e
    return agent
