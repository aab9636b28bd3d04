"""The UCX defaults of the NIXL transport: ours where the environment sets nothing, the environment's
where it does (the backend's ``engine_config``; this process's environment is never written)."""

from __future__ import annotations

import ctypes.util
import os
import re
import subprocess
import sys

import pytest

from memcache_core.transfer import nixl_agent
from memcache_core.transfer.nixl import available


def test_defaults_apply_where_the_environment_sets_nothing(monkeypatch):
    for key in nixl_agent.UCX_DEFAULTS:
        monkeypatch.delenv(f"UCX_{key}", raising=False)
    assert nixl_agent.engine_config() == "TCP_TX_SEG_SIZE=64k,TCP_RX_SEG_SIZE=64k"
    assert nixl_agent.ucx_settings()["TCP_TX_SEG_SIZE"] == "64k"
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "128k")   # either one set: the pair is the user's
    assert nixl_agent.engine_config() == ""
    settings = nixl_agent.ucx_settings()
    assert settings["TCP_RX_SEG_SIZE"] == "128k" and "TCP_TX_SEG_SIZE" not in settings


def _tx_segment(env: dict[str, str]) -> int:
    """The largest message UCX's tcp transport sends in one segment in an agent made by the transport
    (UCX's own protocol table, printed with UCX_PROTO_INFO)."""
    code = ("from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging\n"
            "own_nixl_logging()\nmake_agent('defaults', False)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_PROTO_INFO": "y"} | env)
    assert run.returncode == 0, run.stderr[-2000:]
    table = run.stderr.split("ucp_am_send*(fast-completion)", 1)[1]
    found = re.search(r"\|\s+0\.\.(\d+)\s+\|\s+short", table)
    assert found, table[:2000]
    return int(found.group(1))


@pytest.mark.skipif(not available(), reason="nixl is not installed")
def test_ucx_runs_with_our_segments_unless_the_environment_says_otherwise():
    assert 60_000 < _tx_segment({}) <= 64 << 10
    assert 120_000 < _tx_segment({"UCX_TCP_TX_SEG_SIZE": "128k", "UCX_TCP_RX_SEG_SIZE": "128k"}) <= 128 << 10
    assert _tx_segment({"UCX_TCP_RX_SEG_SIZE": "64k"}) <= 8 << 10   # UCX's own send segment


@pytest.mark.skipif(not available(), reason="nixl is not installed")
@pytest.mark.parametrize("run_no", range(3))
def test_settings_ucx_refuses_are_a_clear_error(run_no):
    """Scenario: UCX refuses the settings (a receive segment smaller than the send segment). The process
    gets a clear InvalidParameter naming them and goes on (it prints after the error, and exits 0):
    the backend was refused in the probe process, never made half-way in this one. Run several
    times: the crash it replaces came and went with timing."""
    code = ("from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging\n"
            "from memcache_core.errors import InvalidParameter\n"
            "own_nixl_logging()\n"
            "try:\n    make_agent('refused', False)\nexcept InvalidParameter as e:\n    print(e)\n"
            "print('still here')\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "256k",
                                      "UCX_TCP_RX_SEG_SIZE": "8k"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "UCX refused its settings" in run.stdout and "UCX_TCP_RX_SEG_SIZE=8k" in run.stdout, run.stdout
    assert run.stdout.rstrip().endswith("still here")


EXIT_CODE = """
import sys
import numpy as np
from memcache_core.local.segment import create_segment
from memcache_core.protocol import SegmentInfo
from memcache_core.transfer.nixl import NixlTransport

seg = create_segment(8 << 20)
t = NixlTransport(seg, 30.0)          # a provider: a serving agent with its progress thread, and our own
buf = (np.arange(1 << 20) % 251).astype(np.uint8)
out = np.zeros_like(buf)
assert t.register(buf.ctypes.data, buf.nbytes) and t.register(out.ctypes.data, out.nbytes)
info = SegmentInfo(1, seg.size, "h", seg.path, "127.0.0.1:1", "", t.descriptor)
t.write(info, [(4096, [(buf.ctypes.data, buf.nbytes)])], [], lambda: [])
t.read(info, [[(4096, [(out.ctypes.data, out.nbytes)])]])
assert np.array_equal(buf, out)
print("done", flush=True)
if sys.argv[1] == "close":
    t.close()
"""


@pytest.mark.skipif(not available(), reason="nixl is not installed")
@pytest.mark.parametrize("ending", ["close", "left open"] * 2)
def test_a_process_that_used_nixl_exits_cleanly(ending):
    """Scenario: a process serves its segment through NIXL and moves bytes through it (a WRITE, then a
    READ of the same bytes), then ends, with the transport closed or left open for the interpreter's
    exit. It exits with status 0 every time (a SIGSEGV at exit was seen: teardown is now explicit and
    ordered, at exit too)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", EXIT_CODE, ending], capture_output=True, text=True, timeout=120,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    assert run.stdout.strip() == "done" and run.returncode == 0, (run.returncode, run.stderr[-2000:])


# The host's rdma-core: libefa (Debian's ibverbs-providers) is what UCX's efa module links; it brings the
# host's libibverbs and libnl beside the copies in NIXL's wheel (nixl_agent.py, "UCX's process-wide options").
HOST_EFA = ctypes.util.find_library("efa")
HOST_RDMA = re.compile(r"/lib(efa\.so\.1|ibverbs\.so\.1|nl-3\.so\.200|nl-route-3\.so\.200)\b")

MAPS = """
from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging
own_nixl_logging()
agent = make_agent('maps', True)
print(sorted({line.split()[-1] for line in open('/proc/self/maps') if '.so' in line}))
"""


@pytest.mark.skipif(not available(), reason="nixl is not installed")
@pytest.mark.skipif(HOST_EFA is None, reason="no host libefa (Debian: ibverbs-providers): UCX's efa module "
                                             "cannot load here, so nothing can bring the host's rdma-core in")
def test_no_host_rdma_library_is_loaded_beside_the_wheels():
    """Scenario: a host with Debian's libibverbs1, ibverbs-providers, libnl-3-200 and libnl-route-3-200.
    A process that made an agent maps none of the host's rdma-core or libnl: UCX's modules run on the
    copies in NIXL's wheel (two copies of libnl-route in one process crashed it at exit)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", MAPS], capture_output=True, text=True, timeout=120,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "libucs" in run.stdout   # UCX was loaded (the check below means something)
    assert not HOST_RDMA.search(run.stdout), run.stdout


OPT_IN = """
from memcache_core.errors import InvalidParameter
from memcache_core.transfer.nixl_agent import make_agent, own_nixl_logging
own_nixl_logging()
try:
    make_agent('all-modules', True)
except InvalidParameter as e:
    print(e)
print("still here", flush=True)
"""


@pytest.mark.skipif(not available(), reason="nixl is not installed")
@pytest.mark.skipif(HOST_EFA is None, reason="no host libefa (Debian: ibverbs-providers): UCX's efa module "
                                             "cannot load here")
@pytest.mark.parametrize("run_no", range(2))
def test_settings_that_crash_a_process_at_exit_are_refused(run_no):
    """Scenario: the environment lets every UCX module in (``UCX_MODULES=*``) on a host where the efa
    module loads the host's libibverbs and libnl beside the wheel's: a process that makes the backend
    dies with SIGSEGV at exit. The probe process dies so instead: this process gets a clear
    InvalidParameter naming the signal and the settings, never makes the backend, and exits 0."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    run = subprocess.run([sys.executable, "-c", OPT_IN], capture_output=True, text=True, timeout=120,
                         env=clean | {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_MODULES": "*"})
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "SIGSEGV at exit" in run.stdout and "UCX_MODULES=*" in run.stdout, run.stdout
    assert run.stdout.rstrip().endswith("still here")
