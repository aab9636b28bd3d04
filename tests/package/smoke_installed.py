"""A smoke test of an installed ``memcache-python``, run by ``.ci/package_check.sh`` with the Python of an
environment the wheel was installed into, from a folder outside the checkout.

It checks that the package is the installed one (not a checkout on the path), then drives the
installed ``memcache`` command: ``memcache meta-service`` starts and answers /health, two LocalServices
move 4 MiB through shared memory byte-exact with the copy loop and data-server loop the wheel should
have (``--loop native``: the C loops were built and are used; ``--loop python``: a wheel built without
a compiler, whose ``auto`` falls back and whose ``native`` is refused naming the key), and ``memcache status --json`` and
``memcache token`` answer. Exit 0 when all holds; an AssertionError (exit 1) names what did not.

    python smoke_installed.py --loop native|python --checkout DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Literal


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=("native", "python"), required=True, help="the copy loop the wheel has")
    ap.add_argument("--checkout", required=True, help="the source tree, which must not be what is imported")
    args = ap.parse_args()

    import memcache_core
    from memcache_core import DistributedObjectStore, LocalConfig
    from memcache_core.auth import admin_token, load_secret
    from memcache_core.rpc import pump  # the frame loop: built where the copy loop is and Python.h was found
    from memcache_core.testing import free_port, wait_for
    from memcache_core.transfer import native
    where = os.path.realpath(memcache_core.__file__)
    assert not where.startswith(os.path.realpath(args.checkout) + os.sep), f"memcache_core imported from the checkout: {where}"
    assert "site-packages" in where, where
    command = os.path.join(os.path.dirname(sys.executable), "memcache")
    assert os.access(command, os.X_OK), f"the wheel installed no memcache command at {command}"
    print(f"memcache_core from {os.path.dirname(where)}; command {command}")
    assert (native.load() is not None) == (args.loop == "native"), f"native.load(): {native.load()}, expected {args.loop}"
    assert args.loop == "native" or pump.load() is None, "a wheel built without a compiler has a native frame loop"
    print(f"frame loop: {'native' if pump.load() is not None else 'python'}")

    with tempfile.TemporaryDirectory() as tmp:
        ports = {k: free_port() for k in ("control", "store", "admin")}
        meta = {"meta_service_url": f"tcp://127.0.0.1:{ports['control']}",
                "config_store_url": f"tcp://127.0.0.1:{ports['store']}",
                "metrics_url": f"http://127.0.0.1:{ports['admin']}"}
        path = os.path.join(tmp, "meta.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        log = open(os.path.join(tmp, "meta.log"), "wb")  # noqa: SIM115 - the child's
        proc = subprocess.Popen([command, "meta-service", "--config_path", path], stdout=log, stderr=subprocess.STDOUT)
        stores: list[DistributedObjectStore] = []
        try:
            def healthy() -> bool:
                assert proc.poll() is None, f"memcache meta-service exited with {proc.returncode}"
                try:
                    with urllib.request.urlopen(meta["metrics_url"] + "/health", timeout=2) as r:
                        return bool(json.loads(r.read()).get("success"))
                except OSError:
                    return False
            wait_for(healthy, 30, "memcache meta-service to answer /health")

            def config(loop: Literal["auto", "native", "python"]) -> LocalConfig:
                return LocalConfig(meta_service_url=meta["meta_service_url"], config_store_url=meta["config_store_url"],
                                   protocol="host_shm", dram_size="64MB", shm_copy_loop=loop, data_server_loop=loop)
            for _ in range(2):
                s = DistributedObjectStore()
                assert s.setup(config(args.loop)) == 0 and s.init(0, True) == 0, "a LocalService did not start"
                stores.append(s)
            value = os.urandom(4 << 20)
            t = time.perf_counter()
            assert stores[0].put("smoke/0", value) == 0
            assert stores[1].get("smoke/0") == value, "the read is not the bytes written"
            print(f"4 MiB put and read back byte-exact through shared memory ({args.loop} loop) "
                  f"in {1e3 * (time.perf_counter() - t):.1f} ms")
            if args.loop == "python":   # no C loop in this wheel: asking for it names the key
                print("shm_copy_loop and data_server_loop 'native' without the C loops must be refused (the next "
                      "line says so):")
                refused = DistributedObjectStore()
                assert refused.setup(config("native")) != 0 or refused.init(0, True) != 0, "shm_copy_loop native accepted"

            out = subprocess.run([command, "status", "--json", "--url", meta["metrics_url"]], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["objects"] == 1, out.stdout
            out = subprocess.run([command, "token"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and out.stdout.strip() == admin_token(load_secret("")), out.stderr
            print("memcache status --json and memcache token answer")
        finally:
            for s in stores:
                s.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            log.close()
    print(f"smoke test of the installed package ({args.loop} copy loop): ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
