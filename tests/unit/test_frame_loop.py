"""The control plane's two frame loops (``frame_loop``: the native pump, rpc/pump.py + frameloop.c, and
the Python selector loop) answer alike, byte for byte, over real sockets: each test runs on both and
compares the bytes received with the frames the Python reference (``seal_frame`` under the server's
own session, rebuilt from the handshake's nonces) makes of the handler's replies."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import time
from collections.abc import Iterator

import pytest

from memcache_core.auth import MAGIC, NO_SESSION, NONCE, Session
from memcache_core.rpc import FRAME_HEAD, MAX_FRAME, MAX_PENDING_REPLY, FrameServer, seal_frame
from memcache_core.testing import polling, wait_for

SECRET = b"f" * 32


def _mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    """The handshake's proofs (auth.py)."""
    return hmac.new(secret, role + nonce_s + nonce_c, hashlib.sha256).digest()


def _answer(body: bytes) -> bytes:
    """Deterministic and length-changing: a reply is not its request's size."""
    return body[::-1] + hashlib.sha256(body).digest()[: len(body) % 7]


@contextlib.contextmanager
def served(frame_loop: str, secret: bytes | None = SECRET, **kw: object) -> Iterator[FrameServer]:
    with polling(FrameServer([("127.0.0.1", 0)], _answer, secret, frame_loop=frame_loop, **kw),  # type: ignore[arg-type]
                 0.02) as server:
        assert server.native == (frame_loop == "native")
        yield server


class Peer:
    """A raw client: the handshake by hand (so the test knows the server's session), then bytes."""

    def __init__(self, server: FrameServer, secret: bytes | None = SECRET, extra: bytes = b"") -> None:
        self.sock = socket.create_connection(server.listeners[0].getsockname(), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if secret is None:
            self.client = self.server = NO_SESSION
            if extra:
                self.sock.sendall(extra)
            return
        hello = self._exact(len(MAGIC) + NONCE)
        nonce_s, nonce_c = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        self.client = Session(secret, nonce_s, nonce_c, client=True)
        self.server = Session(secret, nonce_s, nonce_c, client=False)   # what the server seals with
        self.sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c) + extra)
        assert self._exact(32) == _mac(secret, b"server", nonce_s, nonce_c)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, f"closed after {len(buf)} of {n} bytes"
            buf += chunk
        return buf

    def request(self, rid: int, body: bytes) -> bytes:
        return seal_frame(rid, body, self.client)

    def expected(self, *requests: tuple[int, bytes]) -> bytes:
        return b"".join(seal_frame(rid, _answer(body), self.server) for rid, body in requests)

    def rest(self, timeout_s: float = 10) -> bytes:
        """Every byte until the server closes."""
        self.sock.settimeout(timeout_s)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(1 << 16):
                got += chunk
        return got

    def close(self) -> None:
        self.sock.close()


BODIES = [(1, b"abc"), (2, b""), (3, b"x" * 200), (4, bytes(range(256)) * 400), (5, b"q" * 129)]


@pytest.mark.parametrize("secret", [SECRET, None], ids=["auth", "auth_off"])
def test_frames_split_byte_by_byte_and_many_in_one_segment_are_answered_alike(frame_loop, secret):
    with served(frame_loop, secret) as server:
        peer = Peer(server, secret)
        try:
            for b in peer.request(*BODIES[0]) + peer.request(*BODIES[1]):   # one byte per segment
                peer.sock.sendall(bytes([b]))
                time.sleep(0.0005)
            assert peer._exact(len(want := peer.expected(*BODIES[:2]))) == want
            peer.sock.sendall(b"".join(peer.request(*r) for r in BODIES[2:] * 20))   # one segment, many frames
            assert peer._exact(len(want := peer.expected(*BODIES[2:] * 20))) == want
        finally:
            peer.close()


def test_frames_sent_with_the_handshake_proof_keep_the_session_counters_in_step(frame_loop):
    """The handshake (Python) and the frames behind it in the same segment (C, once handed over):
    the MACs' sequence numbers go on from where the handshake left them, both ways."""
    with served(frame_loop) as server:
        sock = socket.create_connection(server.listeners[0].getsockname(), timeout=10)
        hello = sock.recv(len(MAGIC) + NONCE)
        nonce_s, nonce_c = hello[len(MAGIC):], secrets.token_bytes(NONCE)
        client = Session(SECRET, nonce_s, nonce_c, client=True)
        server_side = Session(SECRET, nonce_s, nonce_c, client=False)
        first = b"".join(seal_frame(rid, body, client) for rid, body in BODIES[:3])
        sock.sendall(nonce_c + _mac(SECRET, b"client", nonce_s, nonce_c) + first)
        want = _mac(SECRET, b"server", nonce_s, nonce_c) + b"".join(
            seal_frame(rid, _answer(body), server_side) for rid, body in BODIES[:3])
        got = b""
        while len(got) < len(want):
            got += sock.recv(len(want) - len(got))
        assert got == want
        sock.sendall(b"".join(seal_frame(rid, body, client) for rid, body in BODIES[3:]))
        want = b"".join(seal_frame(rid, _answer(body), server_side) for rid, body in BODIES[3:])
        got = b""
        while len(got) < len(want):
            got += sock.recv(len(want) - len(got))
        assert got == want
        sock.close()


def test_a_frame_failing_its_mac_closes_the_connection_and_nothing_of_that_read_is_answered(frame_loop):
    with served(frame_loop) as server:
        peer = Peer(server)
        peer.sock.sendall(peer.request(1, b"good"))
        assert peer._exact(len(want := peer.expected((1, b"good")))) == want
        bad = bytearray(peer.request(3, b"altered"))
        bad[FRAME_HEAD.size] ^= 1
        peer.sock.sendall(peer.request(2, b"fine") + bytes(bad) + peer.request(4, b"after"))
        assert peer.rest() == b""
        peer.close()
        wait_for(lambda: server.connections == 0 and server.buffered_input == 0, 5, "the connection to be closed")


def test_a_frame_announcing_more_than_max_frame_closes_the_connection_unanswered(frame_loop):
    with served(frame_loop) as server:
        peer = Peer(server)
        peer.sock.sendall(peer.request(1, b"ok") + FRAME_HEAD.pack(MAX_FRAME + 1, 2) + b"x" * 100)
        assert peer.rest() == b""
        peer.close()
        wait_for(lambda: server.buffered_input == 0, 5, "no input bytes counted for a closed connection")


def test_a_peer_that_never_reads_is_disconnected_at_the_bound_and_others_are_served(frame_loop):
    """Each request asks for ~1 MiB of reply; the peer never reads: it is cut off once more than
    ``MAX_PENDING_REPLY`` would wait for it (or, with a lower server-wide bound, at that one), the
    reply bytes held go back to 0, and a client that reads is served meanwhile."""
    big = b"r" * (1 << 20)
    for server_wide in (None, 8 << 20):
        with served(frame_loop) as server:
            if server_wide:
                server.max_pending_replies = server_wide
            peer = Peer(server)
            peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            limit = server_wide or MAX_PENDING_REPLY
            peak = 0
            try:
                for rid in range(limit // len(big) + 40):
                    peer.sock.sendall(peer.request(rid, big))
                    peak = max(peak, server.pending_replies)
            except OSError:
                pass
            wait_for(lambda: server.connections == 0, 10, "the peer that never reads to be disconnected")
            assert peak <= limit and server.pending_replies == 0
            honest = Peer(server)
            honest.sock.sendall(honest.request(1, b"hello"))
            assert honest._exact(len(want := honest.expected((1, b"hello")))) == want
            honest.close()
            peer.close()


def test_an_idle_connection_is_closed_and_a_talking_one_is_not(frame_loop):
    with served(frame_loop, idle_timeout_s=1.0) as server:
        idle, talking = Peer(server), Peer(server)
        deadline = time.monotonic() + 2.6
        rid = 0
        while time.monotonic() < deadline:
            rid += 1
            talking.sock.sendall(talking.request(rid, b"ping"))
            assert talking._exact(len(want := talking.expected((rid, b"ping")))) == want
            time.sleep(0.2)
        assert idle.rest(5) == b""
        talking.sock.sendall(talking.request(rid + 1, b"still"))
        assert talking._exact(len(want := talking.expected((rid + 1, b"still")))) == want
        idle.close()
        talking.close()


def test_a_tls_server_keeps_every_connection_in_python(frame_loop):
    """TLS connections stay in the Python loop whatever ``frame_loop`` says (the pump reads plain TCP)."""
    import ssl
    server = FrameServer([("127.0.0.1", 0)], _answer, SECRET, tls=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
                         frame_loop=frame_loop)
    try:
        assert not server.native
    finally:
        server.close()
