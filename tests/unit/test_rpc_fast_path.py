"""The control plane's short paths, over real sockets: small frames go out in one send on a blocking
socket with kernel timeouts, large ones with a timeout over the whole send; a silent MetaService
still costs a clear error within the call's timeout; the decoder itself refuses bad keys."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.config import MetaConfig
from memcache_core.meta import server, service
from memcache_core.rpc import SMALL_FRAME, FrameServer, RpcClient
from memcache_core.testing import free_port, polling

SECRET = b"s" * 32


def _answer(body: bytes) -> bytes:
    """Flags saying which keys end in an even digit: a reply that depends on every key sent."""
    req = p.request_decoder.decode(body)
    assert isinstance(req, p.Exist)
    return p.request_encoder.encode(p.Flags([int(k[-1]) % 2 == 0 for k in req.keys]))


@pytest.mark.parametrize("n_keys", [1, 1000, p.MAX_KEYS])   # the largest a request may carry
def test_small_and_large_frames_round_trip_on_an_authenticated_connection(n_keys, frame_loop):
    port = free_port()
    keys = [f"{'k' * 40}/{i}" for i in range(n_keys)]
    with polling(FrameServer([("127.0.0.1", port)], _answer, secret=SECRET, frame_loop=frame_loop)):
        client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=10, secret=SECRET)
        try:
            for _ in range(3):   # the connection is reused: its buffer and socket mode stay right
                reply = client.call(p.Exist(keys))
                assert isinstance(reply, p.Flags)
                assert reply.flags == [i % 2 == 0 for i in range(n_keys)]
        finally:
            client.close()
    assert (len(msgspec.msgpack.encode(keys)) > SMALL_FRAME) == (n_keys == p.MAX_KEYS)


def test_a_silent_metaservice_fails_within_the_timeout():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = RpcClient(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.3)
        try:
            t = time.monotonic()
            with pytest.raises(errors.MetaServiceUnavailable, match="no answer within"):
                client.call(p.Exist(["k"]))
            assert time.monotonic() - t < 2.0
        finally:
            client.close()


@pytest.mark.parametrize("keys, why", [([""], "length >= 1"), (["x" * 256], "length <= 255")])
def test_the_metaservice_refuses_bad_keys_with_invalid_param(keys, why):
    core = service.MetaServiceCore(MetaConfig())
    for req in (p.Exist(keys), p.Lookup(keys)):
        reply = p.reply_decoder.decode(server.answer(core, p.request_encoder.encode(req)))
        assert isinstance(reply, p.Error)
        assert reply.code == errors.INVALID_PARAM and why in reply.message and "$.keys[0]" in reply.message
