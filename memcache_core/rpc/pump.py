"""The native frame pump under ``FrameServer`` (``rpc/frameloop.c``, the ``_frameloop`` extension).

Once a plain-TCP connection has passed the pool's handshake (or at accept, with auth off), the
server hands it over (``Pumped.adopt``): from then on C waits on it (epoll, together with the
server's selector), reads it, cuts and checks its frames (the session's MAC and counters go on from
where the handshake left them), and seals and sends the replies, keeping what the socket does not
take within the server's bounds; Python calls the handler for each frame, a batch per wake-up (one
call returns the frames, one takes the replies). TLS connections and every handshake stay in
Python. ``frame_loop`` (MetaConfig) picks: ``auto`` (native where built), ``native`` (fails at start
where not built), ``python``.

A self-test at load compares the extension's MAC with hashlib's; where it fails, or the extension
was not built (no C compiler at install), ``auto`` serves with the Python loop.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import os
import socket
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .. import nativelib
from ..auth import Session
from ..errors import ConfigError
from .framing import FRAME_HEAD

logger = logging.getLogger(__name__)

FRAME_LOOPS = ("auto", "native", "python")
OVERHEAD = FRAME_HEAD.size + Session.size   # bytes a reply's frame adds to its body


def _load() -> ModuleType | None:
    try:   # (by name: an extension module, built or not, is no import edge of the package)
        native = importlib.import_module(__package__ + "._frameloop")
    except ImportError:
        logger.info("native frame loop not built (no C compiler or Python headers at install?): frame_loop "
                    "auto serves the control plane with the Python loop (docs/configuration.md)")
        return None
    try:
        _self_test(native)
    except AssertionError as e:
        logger.warning("native frame loop not usable (%s): the control plane runs the Python loop", e)
        return None
    return native


def _self_test(mod: Any) -> None:
    """The extension's keyed BLAKE2b-16 against hashlib's, for keys and lengths across block edges."""
    for klen, dlen, seq in ((32, 0, 0), (32, 12, 1), (64, 116, 2 ** 63 + 5), (1, 120, 7), (32, 1000, 3)):
        key, data = bytes(range(klen)), bytes((i * 7) & 0xFF for i in range(dlen))
        want = hashlib.blake2b(seq.to_bytes(8, "little") + data, key=key, digest_size=16).digest()
        if mod.mac(key, seq, data) != want:
            raise AssertionError(f"self-test: the MAC of {dlen} bytes under a {klen}-byte key differs from hashlib's")


def resolve(frame_loop: str) -> ModuleType | None:
    """The extension for the setting ``frame_loop``, or None for the Python loop."""
    if frame_loop not in FRAME_LOOPS:
        raise ConfigError(f"frame_loop: expected 'auto', 'native' or 'python', got {frame_loop!r}")
    if frame_loop == "python":
        return None
    mod = load()
    if mod is None and frame_loop == "native":
        raise ConfigError("frame_loop: native, but the native frame loop (memcache_core.rpc._frameloop) is not "
                          "built or failed its self-test (the log says which): install with a C compiler, or "
                          "set frame_loop: auto or python")
    return mod


class Pumped:
    """A FrameServer's connections in the native pump: their sources, and the handler's batches."""

    def __init__(self, mod: Any, selector_fd: int, handler: Callable[[bytes], bytes], max_frame: int,
                 max_reply: int, released: Callable[[str], None]) -> None:
        self.pump = mod.Pump(selector_fd, max_frame, max_reply)
        self.max_reply = max_reply
        self.handler = handler
        self.released = released              # called with the source of each connection closed in C
        self.sources: dict[int, str] = {}     # connection id -> source address

    def adopt(self, conn: socket.socket, source: str, session: Session, unread: bytes, unsent: bytes,
              pending: int, max_pending: int) -> None:
        """Take ``conn`` over (its descriptor is C's from here), with bytes read after its handshake and
        bytes not yet sent; frames among ``unread`` are answered at once."""
        send_key, recv_key, sent, received = session.native_state()
        fd = conn.detach()
        try:
            cid = self.pump.adopt(fd, send_key, recv_key, sent, received, unread, unsent)
        except BaseException:
            os.close(fd)
            self.released(source)
            raise
        self.sources[cid] = source
        if unread and (frames := self.pump.take_input(cid)):
            self.answer(frames, pending, max_pending)

    def poll(self, timeout_s: float, buffered: int, max_buffered: int, pending: int,
             max_pending: int) -> tuple[int, bool]:
        """Wait up to ``timeout_s``, answer the frames that came: (frames answered, whether the Python
        selector has something ready). ``buffered``/``pending``: the Python side's share of the bounds."""
        wait_ms = min(math.ceil(max(0.0, timeout_s) * 1000), 1 << 30)
        frames, closed, python_ready = self.pump.poll(wait_ms, buffered, max_buffered)
        if closed:
            self._reap(closed)
        if frames:
            self.answer(frames, pending, max_pending)
        return len(frames), python_ready

    def _reap(self, closed: list[int]) -> None:
        for cid in closed:
            source = self.sources.pop(cid, None)
            if source is not None:
                self.released(source)

    def answer(self, frames: list[tuple[int, int, bytes]], pending: int, max_pending: int) -> None:
        """Call the handler for each frame, and hand the replies to C to seal and send. As in the
        Python loop, the replies of one batch stop at the bounds on unsent replies (a 64 KiB read can
        hold thousands of small requests for large replies): a connection whose replies, with those
        already waiting for it, would pass ``max_reply``, or that would take all connections past
        ``max_pending``, is closed and its replies dropped, before the rest are built."""
        handler, pump = self.handler, self.pump
        replies = []
        total = 0
        waiting = pump.stats()[2]
        room = max_pending - pending - waiting
        calm = min(room, self.max_reply - waiting)   # below it no connection can pass either bound
        held: dict[int, int] = {}     # past it: connection id -> its reply bytes built in this batch
        dropped: set[int] = set()
        for cid, rid, body in frames:
            if dropped and cid in dropped:
                continue
            reply = handler(body)
            replies.append((cid, rid, reply))
            total += len(reply) + OVERHEAD
            if total <= calm:
                continue
            if cid not in held:   # (once per connection: then counted as they come)
                held[cid] = sum(len(r[2]) + OVERHEAD for r in replies[:-1] if r[0] == cid)
            built = held[cid] = held[cid] + len(reply) + OVERHEAD
            if total > room or built + pump.waiting(cid) > self.max_reply:
                logger.warning("closing a connection that does not read its replies (%d bytes waiting for it, "
                               "%d for all connections)", built + pump.waiting(cid), max_pending - room + total)
                dropped.add(cid)
                pump.close_id(cid)
                replies = [r for r in replies if r[0] != cid]
                total -= built
        if replies:
            self.pump.send(replies, pending, max_pending)

    def sweep(self, idle_timeout_s: float) -> None:
        self.pump.sweep(idle_timeout_s)

    @property
    def connections(self) -> int:
        return len(self.sources)

    def counts(self) -> tuple[int, int]:
        """(unfinished input bytes, unsent reply bytes) held in C."""
        _, buffered, pending = self.pump.stats()
        return buffered, pending

    def close(self) -> None:
        self.pump.close()
        self.sources.clear()


load = nativelib.once(_load)
"""The ``_frameloop`` extension, self-tested; None where it is not built or not usable."""
