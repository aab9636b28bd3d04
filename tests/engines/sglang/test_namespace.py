"""What keeps servers apart in one pool: the namespace names the bytes, not the served model name.

A writer server (the tiny model, copied to a path of its own, ``--served-model-name tiny``) stores a
prompt's pages and stays up for the whole module (its pages live in its own segment). Servers that
compute other KV bytes for the same tokens must not hit those pages, each under the same served
name, in this order (the tests share the writer):

* another checkpoint (same architecture, other weights);
* the same checkpoint at the same path with a rope override (``--json-model-override-args``);
* the writer itself after ``/update_weights_from_disk`` to the other checkpoint (with a
  ``weight_version``), then after an update back to its path that names no version;
* another checkpoint copied over the files of the writer's path while it runs (same path), last:
  the writer's path then holds other weights than it serves.

The rope server is then killed to check that the harness reports a dead server as such.

Each of them restores its own pages from L3 with the output it computed itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    ADMIN,
    ADMIN_KEY,
    FULL_PAGES,
    ServerDied,
    flush,
    generate,
    generate_from_storage,
    pool_keys,
    prompt,
    request,
    start,
    wait_for_new_keys,
)
from memcache_sglang import testing as harness

from memcache_core.testing import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

SERVED = ["--served-model-name", "tiny"]
IDS = prompt(41)
ROPE = {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}


@pytest.fixture(scope="module")
def model_b() -> str:
    """Same architecture and config as the default tiny model, other random weights."""
    return harness.ensure_model(sys.executable, ["--seed", "1"])


@pytest.fixture(scope="module")
def writer_path(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The writer's checkpoint: a copy of the tiny model that the last test overwrites."""
    path = tmp_path_factory.mktemp("writer_checkpoint") / "model"
    shutil.copytree(model, path)
    return path


@pytest.fixture(scope="module")
def writer(meta: harness.MetaHandle, writer_path: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[harness.ServerHandle, dict]]:
    server = start(meta, str(writer_path), tmp_path_factory.mktemp("ns"), "writer",
                   extra_args=[*SERVED, "--admin-api-key", ADMIN_KEY])
    try:
        before = pool_keys(meta)
        cold = generate(server, IDS)
        assert cold["storage"] == cold["device"] == 0, cold
        wait_for_new_keys(meta, before, FULL_PAGES)
        yield server, cold
    finally:
        server.stop()


def assert_separate_then_restores(server: harness.ServerHandle, meta: harness.MetaHandle) -> dict:
    """The writer's pages are no hit for ``server``; its own pages restore with its own output."""
    before = pool_keys(meta)
    own = generate(server, IDS)
    assert own["storage"] == 0 and own["device"] == 0 and own["host"] == 0, \
        f"hit pages of another model or configuration: {own}"
    wait_for_new_keys(meta, before, FULL_PAGES)
    flush(server)
    restored = generate_from_storage(server, IDS)
    assert restored["text"] == own["text"]
    return own


def test_same_served_name_other_checkpoint(writer: tuple, meta: harness.MetaHandle, model_b: str,
                                          tmp_path: Path) -> None:
    """Scenario: two checkpoints served under one name -> separate namespaces."""
    _, written = writer
    server = start(meta, model_b, tmp_path, "other_checkpoint", extra_args=SERVED)
    try:
        own = assert_separate_then_restores(server, meta)
        assert own["text"] != written["text"], "the two checkpoints compute the same output: no test"
    finally:
        server.stop()


def test_rope_override(writer: tuple, meta: harness.MetaHandle, writer_path: Path, tmp_path: Path) -> None:
    """Scenario: same checkpoint (the writer's path) and served name, --json-model-override-args
    with another rope theta -> a separate namespace."""
    server = start(meta, str(writer_path), tmp_path, "rope",
                   extra_args=[*SERVED, "--json-model-override-args", json.dumps(ROPE)])
    try:
        assert_separate_then_restores(server, meta)
        assert_harness_tells_a_dead_server(server)
    finally:
        server.stop()


def assert_harness_tells_a_dead_server(server: harness.ServerHandle) -> None:
    """The harness's side: a request to a server that died fails as ServerDied, with its exit
    status and log tail, rather than as a connection error (or a retried keep-alive race)."""
    os.kill(server.pid, signal.SIGKILL)
    wait_for(lambda: server.exit_status() is not None, 30, "the killed server's exit status", interval_s=0.1)
    with pytest.raises(ServerDied, match=r"EXITED with status -9(.|\n)*last 40 lines"):
        flush(server)


def update_weights(server: harness.ServerHandle, body: dict) -> None:
    r = request(server, "POST", "/update_weights_from_disk", idempotent=False, timeout=120,
                headers=ADMIN, json=body)
    assert r.status_code == 200 and r.json()["success"], r.text


def test_weight_update_moves_the_namespace(writer: tuple, meta: harness.MetaHandle, writer_path: Path,
                                           model_b: str) -> None:
    """Scenario: the writer's weights are replaced through /update_weights_from_disk (SGLang flushes
    its device and host caches, never L3) -> its own old pages are no hit; the new weights' pages
    restore. An update without a weight_version gives the server a namespace of its own."""
    server, written = writer
    update_weights(server, {"model_path": model_b, "weight_version": "b1"})
    after = assert_separate_then_restores(server, meta)
    assert after["text"] != written["text"]

    update_weights(server, {"model_path": str(writer_path)})  # back to the first weights, no version
    back = assert_separate_then_restores(server, meta)
    assert back["text"] == written["text"]
    log = Path(server.log_path).read_text()
    assert "weights updated without a weight_version" in log
    assert "weights='b1+unnamed-" in log


def test_other_weights_swapped_in_at_the_same_path(writer: tuple, meta: harness.MetaHandle, model_b: str,
                                                   writer_path: Path, tmp_path: Path) -> None:
    """Scenario (issue 21, item 3): the writer serves the checkpoint at its path and stored the
    prompt's pages (it stays up: they stay in its segment). Another checkpoint of the same shape is
    copied over the files at that path (same names, sizes and safetensors headers; new
    modification times). A server started at that path must not hit the old pages, and restores
    its own."""
    _, written = writer
    for src in Path(model_b).iterdir():
        if src.is_file():
            shutil.copyfile(src, writer_path / src.name)
    server = start(meta, str(writer_path), tmp_path, "swap_new", extra_args=SERVED)
    try:
        before = pool_keys(meta)
        own = generate(server, IDS)
        assert own["storage"] == own["device"] == own["host"] == 0, \
            f"hit pages of the weights that were at this path before: {own}"
        assert own["text"] != written["text"], "the two checkpoints compute the same output: no test"
        wait_for_new_keys(meta, before, FULL_PAGES)
        flush(server)
        assert generate_from_storage(server, IDS)["text"] == own["text"]
    finally:
        server.stop()
