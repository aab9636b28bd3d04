"""Unit tests of three small mechanisms the rest leans on: control-plane framing (also over a real
socket, split and pipelined), the registry of buffers pointer calls may touch, and how a batch of
copies is split over threads."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from memcache_core.auth import Session, client_handshake, recv_exact
from memcache_core.errors import InvalidParameter
from memcache_core.local.buffers import BufferRegistry
from memcache_core.protocol import SegmentInfo
from memcache_core.rpc import FRAME_HEAD, MAX_FRAME, FrameServer, seal_frame, take_frame
from memcache_core.testing import polling
from memcache_core.transfer.engine import CopyOp, split_by_bytes

SECRET = b"s" * 32


# ---- framing ------------------------------------------------------------------------------------

def frame(rid: int, body: bytes) -> bytes:
    return FRAME_HEAD.pack(len(body), rid) + body


def test_take_frame_waits_for_a_whole_frame_and_keeps_the_rest():
    buf = bytearray(frame(7, b"hello")[:5])
    assert take_frame(buf) is None                      # half a header
    buf = bytearray(frame(7, b"hello")[:-1])
    assert take_frame(buf) is None and len(buf) == FRAME_HEAD.size + 4   # body one byte short: untouched
    buf = bytearray(frame(7, b"hello") + frame(8, b"") + frame(9, b"x")[:3])
    assert take_frame(buf) == (7, b"hello")
    assert take_frame(buf) == (8, b"")
    assert take_frame(buf) is None and bytes(buf) == frame(9, b"x")[:3]


def test_a_header_announcing_too_much_is_refused_before_anything_is_buffered():
    with pytest.raises(ValueError, match="frame of"):
        take_frame(bytearray(FRAME_HEAD.pack(MAX_FRAME + 1, 1)))


def _pair() -> tuple[Session, Session]:
    nonce_s, nonce_c = b"s" * 32, b"c" * 32
    return Session(SECRET, nonce_s, nonce_c, client=True), Session(SECRET, nonce_s, nonce_c, client=False)


def test_sealed_frames_pass_in_order_and_an_altered_reordered_or_foreign_one_is_refused():
    client, server = _pair()
    buf = bytearray(seal_frame(1, b"hello", client) + seal_frame(2, b"", client))
    assert take_frame(buf, server) == (1, b"hello") and take_frame(buf, server) == (2, b"") and not buf
    first, second = seal_frame(3, b"a", client), seal_frame(4, b"b", client)
    with pytest.raises(ValueError, match="MAC"):
        take_frame(bytearray(second + first), server)              # reordered (or the first dropped)
    client, server = _pair()
    altered = bytearray(seal_frame(5, b"remove k", client))
    altered[FRAME_HEAD.size] ^= 1
    with pytest.raises(ValueError, match="MAC"):
        take_frame(altered, server)
    client, server = _pair()
    with pytest.raises(ValueError, match="MAC"):                 # the server's own direction: not a request
        take_frame(bytearray(seal_frame(6, b"x", server)), _pair()[1])
    with pytest.raises(ValueError, match="MAC"):                 # no MAC at all (a relay's own frame)
        take_frame(bytearray(frame(7, b"x") + bytes(16)), _pair()[1])


@pytest.fixture
def echo_server(frame_loop):
    """A real FrameServer whose handler answers each body reversed, polled on a thread (each frame loop)."""
    with polling(FrameServer([("127.0.0.1", 0)], lambda body: body[::-1], SECRET, frame_loop=frame_loop)) as server:
        yield server.listeners[0].getsockname()


def _reply(s: socket.socket, session: Session) -> tuple[int, bytes]:
    head = recv_exact(s, FRAME_HEAD.size)
    n, _ = FRAME_HEAD.unpack(head)
    got = take_frame(bytearray(head + recv_exact(s, n + session.size)), session)
    assert got is not None
    return got


def test_frames_sent_a_byte_at_a_time_and_pipelined_are_answered_in_order(echo_server):
    with socket.create_connection(echo_server, timeout=5) as s:
        session = client_handshake(s, SECRET)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for b in seal_frame(1, b"abc", session):
            s.sendall(bytes([b]))
        assert _reply(s, session) == (1, b"cba")
        s.sendall(seal_frame(2, b"xy", session) + seal_frame(3, b"", session) + seal_frame(4, b"z" * 100_000, session))
        assert [_reply(s, session) for _ in range(3)] == [(2, b"yx"), (3, b""), (4, b"z" * 100_000)]


def test_a_frame_before_the_handshake_gets_no_answer_and_the_connection_is_closed(echo_server):
    with socket.create_connection(echo_server, timeout=5) as s:
        s.sendall(b"\0" * 64 + frame(1, b"abc"))   # garbage where the handshake's answer belongs
        s.settimeout(10)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        assert frame(1, b"cba") not in got


# ---- registered buffers -------------------------------------------------------------------------

def test_a_range_must_lie_inside_one_registered_buffer():
    r = BufferRegistry()
    r.register(0x1000, 0x100)
    r.register(0x1100, 0x100)                       # adjacent, but a separate buffer
    r.register(0x1000, 0x100)                       # the same buffer twice is harmless
    r.check(0x1000, 0x100)
    r.check(0x10ff, 1)
    for ptr, size in ((0x10ff, 2), (0xfff, 1), (0x1200, 1), (0x1000, 0x200)):
        with pytest.raises(InvalidParameter):
            r.check(ptr, size)
    r.unregister(0x1000, 0x100)
    with pytest.raises(InvalidParameter):
        r.check(0x1000, 1)
    r.check(0x1100, 0x100)
    with pytest.raises(InvalidParameter, match="was not registered"):
        r.unregister(0x1000, 0x100)


@pytest.mark.parametrize("ptr,size", [(True, 8), (0x1000, 1.5), ("0x1000", 8), (0, 8), (0x1000, -1)])
def test_bad_pointers_and_sizes_are_refused(ptr, size):
    with pytest.raises(InvalidParameter):
        BufferRegistry().register(ptr, size)


def test_a_whole_list_of_pieces_is_checked_as_each_piece_is():
    """``pieces``: the fast pass (plain ints inside one buffer) and the piece-by-piece pass agree."""
    r = BufferRegistry()
    r.register(0x1000, 0x100)
    r.register(0x1100, 0x100)
    assert r.pieces([0x1000, 0x10f0], [0x10, 0x10]) == [(0x1000, 0x10), (0x10f0, 0x10)]
    assert r.pieces([0x10f0, 0x1100], [0x10, 0x100]) == [(0x10f0, 0x10), (0x1100, 0x100)]  # two buffers
    assert r.pieces([np.int64(0x1000)], [np.uint32(8)]) == [(0x1000, 8)]  # type: ignore[list-item]
    bad: list[tuple[list[Any], list[Any]]] = [([0x1000, 0x10f8], [0x10, 0x10]), ([0x1000], [0]), ([0x1000, 0x1010], [8, -8]),
           ([0x1000], [True]), ([0x1000], [1.0]), ([0x1000], []), ([], []), ([0xfff], [1])]
    for ptrs, sizes in bad:
        with pytest.raises(InvalidParameter):
            r.pieces(ptrs, sizes)


# ---- splitting a batch over threads --------------------------------------------------------------

SEG = SegmentInfo(1, 1 << 30, "host", "/dev/shm/memcache-1-00", "127.0.0.1:1")


@given(st.lists(st.integers(1, 1 << 24), max_size=64), st.integers(1, 8))
def test_a_batch_splits_in_order_into_at_most_n_nonempty_parts_of_about_equal_bytes(sizes, n):
    ops = [CopyOp(SEG, 0, [], size) for size in sizes]
    parts = split_by_bytes(ops, n)
    assert [op for part in parts for op in part] == ops          # every op once, in order
    assert len(parts) <= n
    if ops:
        assert all(parts), "an empty part"
    if len(ops) > 1 and n > 1:
        share = sum(sizes) / n
        assert all(sum(op.nbytes for op in part) <= share + max(sizes) for part in parts)
