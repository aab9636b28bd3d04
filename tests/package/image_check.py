"""What the pool's image must hold beyond the package itself, run inside a container of the image by
``.ci/image.sh`` (as the image's own user, with the image's environment).

It checks that the process runs as the image's user (uid 1000, not root); that ``/dev/shm`` is there
and writable by it (the providers' segments live there); that the entrypoint's command is the one the
image installed; that pyzmq is installed at its pinned version; and that ``memcache meta-service``
with ``kv_events_enable`` starts and publishes: a LocalService joins, puts a key, and a ZeroMQ SUB
socket receives its ``BlockStored`` (and, after a remove, its ``BlockRemoved``). Exit 0 when all
holds; an AssertionError (exit 1) names what did not.

    python image_check.py --entrypoint-and-user "[memcache] 1000:1000"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request

import msgspec


def decode(payload: bytes) -> list[tuple[str, list[str], str | None]]:
    """A batch of KV events, ``[ts, events, dp rank]`` as vLLM 0.32 encodes it, read as raw msgpack."""
    return [(ev["type"], [h.decode() for h in ev.get("block_hashes", [])], ev.get("medium"))
            for ev in msgspec.msgpack.decode(payload)[1]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entrypoint-and-user", required=True,
                    help="the image's configured entrypoint and user, as `buildah inspect` prints them")
    args = ap.parse_args()

    entrypoint, user = args.entrypoint_and_user.split()
    assert entrypoint == "[memcache]" and user == "1000:1000", args.entrypoint_and_user
    assert (os.getuid(), os.getgid()) == (1000, 1000), f"running as {os.getuid()}:{os.getgid()}, not the image's user"
    assert os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK), "/dev/shm missing or not writable"
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="image-check-") as shm:
        shm.write(b"x" * 4096)
        shm.flush()
    command = shutil.which("memcache")
    assert command == os.path.join(sys.prefix, "bin", "memcache"), f"`memcache` on PATH is {command}, not {sys.prefix}'s"
    try:
        import zmq
    except ImportError as e:
        raise AssertionError(f"pyzmq is not installed (the events extra): kv_events_enable cannot start ({e})") from e

    from memcache_core import DistributedObjectStore, LocalConfig
    from memcache_core.testing import free_port, wait_for
    from memcache_core.testing_kv_events import KVEventSubscriber
    pinned = {"pyzmq": "27.3.0"}   # constraints.txt
    assert zmq.pyzmq_version() == pinned["pyzmq"], zmq.pyzmq_version()
    print(f"uid 1000, /dev/shm writable, entrypoint {command}, pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()})")

    with tempfile.TemporaryDirectory() as tmp:
        port = {k: free_port() for k in ("control", "store", "admin", "events", "replay")}
        meta = {"meta_service_url": f"tcp://127.0.0.1:{port['control']}",
                "config_store_url": f"tcp://127.0.0.1:{port['store']}",
                "metrics_url": f"http://127.0.0.1:{port['admin']}",
                "kv_events_enable": True, "kv_events_endpoint": f"tcp://127.0.0.1:{port['events']}",
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{port['replay']}", "kv_events_model_name": "m"}
        path = os.path.join(tmp, "meta.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        log_path = os.path.join(tmp, "meta.log")
        log = open(log_path, "wb")  # noqa: SIM115 - the child's
        proc = subprocess.Popen([command, "meta-service", "--config_path", path], stdout=log, stderr=subprocess.STDOUT)
        store = DistributedObjectStore()
        try:
            def healthy() -> bool:
                if proc.poll() is not None:
                    with open(log_path, encoding="utf-8", errors="replace") as f:
                        raise AssertionError(f"memcache meta-service exited with {proc.returncode}:\n{f.read()}")
                try:
                    with urllib.request.urlopen(str(meta["metrics_url"]) + "/health", timeout=2) as r:
                        return bool(json.loads(r.read()).get("success"))
                except OSError:
                    return False
            wait_for(healthy, 30, "memcache meta-service (kv_events_enable) to answer /health")
            sub = KVEventSubscriber(str(meta["kv_events_endpoint"]), decode)
            cfg = LocalConfig(meta_service_url=str(meta["meta_service_url"]), config_store_url=str(meta["config_store_url"]),
                              protocol="host_shm", dram_size="16MB")
            assert store.setup(cfg) == 0 and store.init(0, True) == 0, "a LocalService did not join"
            sub.wait_until_subscribed(lambda k: store.put(k, b"p"))
            assert store.put("image/block-1", b"x" * 1000) == 0 and store.remove("image/block-1") == 0

            def published() -> bool:
                sub.poll()
                return "image/block-1" in sub.keys("BlockRemoved")
            wait_for(published, 10, "BlockRemoved of image/block-1")
            assert "image/block-1" in sub.keys("BlockStored"), sub.events
            print(f"memcache meta-service with kv_events_enable: {len(sub.events)} events received over ZeroMQ, "
                  "BlockStored and BlockRemoved of the key put and removed")
        finally:
            store.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            log.close()
    print("image check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
