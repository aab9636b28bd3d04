"""Property-based fuzzing of the control-plane decoder and handlers, the data-server framing after a
valid handshake, and the admin HTTP routes. Budgeted for CI: the whole file runs in about a minute.

Examples are derandomized in CI (``CI=true``) and a ten times longer random hunt is opt-in
(``MEMCACHE_FUZZ=explore``): ``tests/hypothesis_profiles.py``.

Each property ends with an honest client doing its normal work and checking the answer, so "the
server survived" means it still serves correctly, not merely that it did not crash.
"""

from __future__ import annotations

import http.client
import os
import secrets
import socket
import struct
import tempfile
import urllib.parse

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memcache_core import protocol as p
from memcache_core.auth import admin_token, client_handshake
from memcache_core.config import MetaConfig
from memcache_core.memory import Mapping
from memcache_core.meta.http import POST_ONLY, AdminServer
from memcache_core.meta.server import answer
from memcache_core.meta.service import MetaServiceCore
from memcache_core.rpc import expect
from memcache_core.transfer.tcp import TcpClient
from memcache_core.transfer.tcp_server import DataServer
from tests.hypothesis_profiles import examples
from tests.loops import DATA_SERVER_LOOPS

pytestmark = pytest.mark.integration

FUZZ = settings(max_examples=examples(1000), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# ---- the control plane, in-process --------------------------------------------------------------

EXTREME = st.sampled_from([0, 1, -1, 2**31 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)])
INTS = st.one_of(EXTREME, st.integers(-(2**63), 2**64 - 1))
TEXT = st.one_of(st.text(max_size=300), st.sampled_from(["", "/", "\0", "/dev/shm/memcache-1-ab", "/etc/passwd",
                                                         "0.0.0.0:1", "127.0.0.1:9", "a" * 257]))
LEAF = st.one_of(INTS, TEXT, st.binary(max_size=64), st.none(), st.booleans(), st.floats())
VALUE = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=8),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=20)
TAGS = ["Join", "Leave", "Heartbeat", "Alloc", "Commit", "Abort", "OwnerGone", "Lookup", "Exist", "Validate", "Remove",
        "RemoveAll", "RemovePrefix", "Corrupt", "GetSegments", "ConfigPut", "ConfigGet", "DrainNext", "DrainDone",
        "RepairNext", "RepairDone", "Confirmed", "Unknown"]
FIELDS = {
    "client_id": INTS, "token": st.one_of(st.binary(max_size=32), VALUE), "pid": INTS, "host_id": TEXT,
    "keys": st.lists(TEXT, max_size=20), "sizes": st.lists(INTS, max_size=20),
    "generations": st.lists(INTS, max_size=20), "checksums": st.lists(INTS, max_size=20),
    "replicas": INTS, "preferred": st.lists(INTS, max_size=12), "segment_ids": st.lists(INTS, max_size=12),
    "segment": st.one_of(st.none(), VALUE, st.fixed_dictionaries({
        "segment_id": INTS, "size": INTS, "host_id": TEXT, "shm_path": TEXT, "data_addr": TEXT, "tag": TEXT,
        "nixl": st.one_of(st.binary(max_size=64), VALUE)})),
    "objects": st.lists(st.tuples(TEXT, INTS, INTS, INTS, INTS).map(list), max_size=10),
    "key": TEXT, "value": st.one_of(st.binary(max_size=256), VALUE), "prefix": TEXT, "lease": VALUE,
    "journal_ack": INTS, "timeout_ms": INTS, "ok": st.lists(VALUE, max_size=20),
    "segment_id": INTS, "shm_path": st.one_of(TEXT, VALUE),
}


@st.composite
def requests(draw) -> bytes:
    msg = {"type": draw(st.sampled_from(TAGS))}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=8)):
        msg[name] = draw(FIELDS[name])
    return msgspec.msgpack.encode(msg)


@pytest.fixture(scope="module")
def core() -> MetaServiceCore:
    return MetaServiceCore(MetaConfig(meta_service_url="tcp://127.0.0.1:1", config_store_url="tcp://127.0.0.1:2",
                                      metrics_url="http://127.0.0.1:3"))


def _call(core: MetaServiceCore, req: p.Request) -> p.Reply:
    reply = p.reply_decoder.decode(answer(core, p.request_encoder.encode(req)))
    assert not isinstance(reply, p.Error), reply
    return reply


def _honest_cycle(core: MetaServiceCore) -> None:
    """Join (with a segment), Alloc, Commit and Lookup: each answer is what an honest member expects."""
    seg = p.SegmentInfo(0, 1 << 24, "honest", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}", "127.0.0.1:9")
    j = _call(core, p.Join(0, "honest", os.getpid(), seg))
    assert isinstance(j, p.Joined)
    key = f"honest-{secrets.token_hex(6)}"
    a = _call(core, p.Alloc(j.client_id, j.token, [key], [4096], 1, [j.client_id]))
    assert isinstance(a, p.AllocReply) and a.results[0].code == 0
    assert a.results[0].locations[0].segment_id == j.client_id
    assert _call(core, p.Commit(j.client_id, j.token, [key], [a.results[0].generation])) == p.Codes([0])
    found = _call(core, p.Lookup([key]))
    assert isinstance(found, p.LookupReply) and found.results[0] is not None
    assert (found.results[0].size, found.results[0].generation) == (4096, a.results[0].generation)
    assert _call(core, p.Leave(j.client_id, j.token)) == p.Ok()


def test_segment_nixl_descriptor_is_bounded_and_handed_to_members(core):
    """A segment's NIXL descriptor (agent metadata: a capability) is opaque to the MetaService, bounded
    in size (the error names the field) and given back with the segment table, unchanged."""
    path = f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}"
    big = p.SegmentInfo(0, 1 << 24, "h", path, "127.0.0.1:9", nixl=b"\1" * ((64 << 10) + 1))
    reply = p.reply_decoder.decode(answer(core, p.request_encoder.encode(p.Join(0, "h", os.getpid(), big))))
    assert isinstance(reply, p.Error) and "segment.nixl" in reply.message
    blob = secrets.token_bytes(600)
    j = _call(core, p.Join(0, "h", os.getpid(), p.SegmentInfo(0, 1 << 24, "h", path, "127.0.0.1:9", nixl=blob)))
    assert isinstance(j, p.Joined)
    segs = _call(core, p.GetSegments([j.client_id]))
    assert isinstance(segs, p.Segments) and [s.nixl for s in segs.segments] == [blob]
    assert _call(core, p.Leave(j.client_id, j.token)) == p.Ok()


U64 = st.one_of(EXTREME.filter(lambda v: v >= 0), st.integers(0, 2**64 - 1))
I64 = st.one_of(EXTREME.filter(lambda v: v < 2**63), st.integers(-(2**63), 2**63 - 1))
KEYS = st.lists(TEXT, max_size=12)
SEGMENTS = st.builds(p.SegmentInfo, I64, I64, TEXT, TEXT, TEXT, TEXT)
REPORTS = st.lists(st.builds(p.ObjectReport, TEXT, I64, I64, U64, U64), max_size=8)
TYPED = st.one_of(
    st.builds(p.Join, I64, TEXT, I64, st.one_of(st.none(), SEGMENTS), REPORTS, st.binary(max_size=32)),
    st.builds(p.Leave, I64, st.binary(max_size=32)),
    st.builds(p.Heartbeat, I64, st.binary(max_size=32), I64),
    st.builds(p.Alloc, I64, st.binary(max_size=32), KEYS, st.lists(I64, max_size=12), I64, st.lists(I64, max_size=12)),
    st.builds(p.Commit, I64, st.binary(max_size=32), KEYS, st.lists(U64, max_size=12), st.lists(U64, max_size=12)),
    st.builds(p.Abort, I64, st.binary(max_size=32), KEYS, st.lists(U64, max_size=12)),
    st.builds(p.OwnerGone, I64, st.binary(max_size=32), I64, TEXT),
    st.builds(p.Corrupt, I64, st.binary(max_size=32), KEYS, st.lists(U64, max_size=12)),
    st.builds(p.Lookup, KEYS, st.booleans()), st.builds(p.Exist, KEYS),
    st.builds(p.Validate, KEYS, st.lists(U64, max_size=12)), st.builds(p.Remove, KEYS),
    st.builds(p.RemovePrefix, TEXT), st.builds(p.GetSegments, st.lists(I64, max_size=12)),
    st.builds(p.ConfigPut, TEXT, st.binary(max_size=256)), st.builds(p.ConfigGet, TEXT),
    st.builds(p.DrainNext, I64, st.binary(max_size=32), I64),
    st.builds(p.DrainDone, I64, st.binary(max_size=32), KEYS, st.lists(U64, max_size=12), st.lists(U64, max_size=12),
              st.lists(st.booleans(), max_size=12)),
    st.builds(p.RepairNext, I64, st.binary(max_size=32)),
    st.builds(p.Confirmed, I64, st.lists(st.tuples(I64, I64, I64), max_size=12)),
    st.builds(p.RepairDone, I64, st.binary(max_size=32), KEYS, st.lists(U64, max_size=12), st.lists(U64, max_size=12),
              st.lists(st.booleans(), max_size=12)),
)


@FUZZ
@given(req=TYPED, as_member=st.booleans())
def test_control_plane_handles_typed_requests_with_extreme_values(core, req, as_member):
    """Property: well-typed requests with extreme integers, odd strings and mismatched list lengths,
    also sent as a real member (its id and token, so they reach the member handlers), get a decodable
    ``Reply``; the core keeps serving an honest Join/Alloc/Commit/Lookup correctly."""
    if as_member and hasattr(req, "token"):
        member = _member(core)
        req = msgspec.structs.replace(req, client_id=member.client_id, token=member.token)
    out = answer(core, p.request_encoder.encode(req))
    assert isinstance(p.reply_decoder.decode(out), p.Reply.__args__)  # type: ignore[attr-defined]
    _honest_cycle(core)


_MEMBER: list[p.Joined] = []


def _member(core: MetaServiceCore) -> p.Joined:
    """A member that fuzzed requests may act as (re-joined when a fuzzed Leave dropped it)."""
    if not _MEMBER or _MEMBER[0].client_id not in core.members:
        seg = p.SegmentInfo(0, 1 << 24, "fuzz", f"/dev/shm/memcache-{os.getpid()}-{secrets.token_hex(6)}",
                            "127.0.0.1:9")
        _MEMBER[:] = [expect(_call(core, p.Join(0, "fuzz", os.getpid(), seg)), p.Joined)]
    return _MEMBER[0]


@FUZZ
@given(payload=st.one_of(st.binary(max_size=512), requests(),
                         requests().flatmap(lambda b: st.tuples(st.just(b), st.integers(0, max(0, len(b) - 1)),
                                                                st.integers(0, 255))
                                            .map(lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]))))
def test_control_plane_answers_every_payload_with_a_reply_and_keeps_working(core, payload):
    """Property: for any payload (random bytes, request-shaped maps with extreme integers, long strings
    and lists, or such a map with one byte changed) the handler answers a decodable ``Reply`` and the
    core keeps serving an honest Join/Alloc/Commit/Lookup correctly."""
    out = answer(core, payload)
    assert isinstance(p.reply_decoder.decode(out), p.Reply.__args__)  # type: ignore[attr-defined]
    _honest_cycle(core)


# ---- the data server, after a valid handshake ---------------------------------------------------

SECRET = secrets.token_bytes(32)
HONEST = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module", params=DATA_SERVER_LOOPS)   # the C read loop and the Python one
def data_server(tmp_path_factory, request):
    d = tempfile.mkdtemp(prefix="memcache-fuzz-", dir="/dev/shm")
    m = Mapping(os.path.join(d, f"memcache-{os.getpid()}-{secrets.token_hex(8)}"), 4 << 20, create=True)
    m.view(0, len(HONEST))[:] = HONEST
    server = DataServer(m, "127.0.0.1", 0, SECRET, loop=request.param)
    host, port = server.addr.rsplit(":", 1)
    yield m, (host, int(port))
    server.close()
    m.close()
    os.rmdir(d)


def _head(op: int, ranges: list[tuple[int, int]]) -> bytes:
    return b"MCD2" + struct.pack("<BIQ", op, len(ranges), 0) + b"".join(
        struct.pack("<QQ", off % 2**64, n % 2**64) for off, n in ranges)


# (bytes the insider seals with its session's MAC, bytes sent after them unsealed)
DATA_FRAMES = st.one_of(
    st.binary(max_size=256).filter(lambda b: not b.startswith(b"MCD2\x02")).map(lambda b: (b"", b)),
    st.tuples(st.sampled_from([0, 1, 3, 255]), st.lists(st.tuples(INTS, INTS), max_size=6), st.binary(max_size=64))
    .map(lambda t: (_head(t[0], t[1]), t[2])),
    # writes only beyond the honest bytes: an authenticated peer may write, the honest data is elsewhere
    st.tuples(st.lists(st.tuples(st.integers(1 << 20, 4 << 20), st.integers(0, 1 << 12)), max_size=4),
              st.binary(max_size=4096)).map(lambda t: (_head(2, t[0]), t[1])),
    st.tuples(st.integers(0, 2**32 - 1)).map(lambda t: (b"", b"MCD2\x01" + struct.pack("<IQ", t[0], 0))),
)


@FUZZ
@given(frames=st.lists(DATA_FRAMES, min_size=1, max_size=3))
def test_data_server_framing_after_the_handshake(data_server, frames):
    """Property: an authenticated peer sending any bytes (garbage, malformed or oversized range lists,
    out-of-segment ranges, truncated frames) never stops the server or corrupts other bytes: an
    honest client then reads the honest region byte-exact."""
    mapping, addr = data_server
    with socket.create_connection(addr, timeout=5) as s:
        session = client_handshake(s, SECRET)
        s.settimeout(0.5)
        try:
            for head, rest in frames:
                s.sendall(head + (session.seal(head) if head else b"") + rest)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
        except OSError:
            pass
    dst = np.zeros(len(HONEST), np.uint8)
    client = TcpClient(5.0, SECRET)
    try:
        client.read(f"{addr[0]}:{addr[1]}", [(0, [(dst.ctypes.data, len(HONEST))])])
    finally:
        client.close()
    assert dst.tobytes() == HONEST


# ---- the admin HTTP server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def admin(core):
    server = AdminServer(core, "http://127.0.0.1:0", SECRET)
    server.start()
    yield server.httpd.server_address[1]
    server.stop()


PATHS = st.one_of(st.sampled_from(["/health", "/metrics", "/metrics/summary", "/get_all_keys", "/get_all_segments",
                                   "/query_key", "/batch_query_keys", "/query_segment", "/api/v1/capacity/usage",
                                   "/api/v1/segments/status", "/role", "/ha_status", "/leader", "/metadata",
                                   "/memory/evict", "/api/v1/drain_jobs/query", "/drains", "/drain/1", "/drain/x", "//", "//health", "///health?x=1", "/..",
                                   "/%00"]),
                  st.text(max_size=64).map(lambda t: "/" + t))
QUERIES = st.dictionaries(st.sampled_from(["key", "keys", "segment", "x", ""]),
                          st.one_of(st.text(max_size=64), st.sampled_from(["-1", "9" * 40, "1e308", ",,,"])),
                          max_size=3)


@settings(max_examples=examples(600), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=PATHS, query=QUERIES, with_token=st.booleans())
def test_admin_routes_answer_200_401_404_or_405(admin, path, query, with_token):
    """Property: any path and query gets 200, 404 (405 for a POST-only route) with the token, or 401
    (without it, but /health and the redirect of /),
    never a server error or a hang, and /health keeps answering."""
    target = urllib.parse.quote(path, safe="/%") + ("?" + urllib.parse.urlencode(query) if query else "")
    headers = {"Authorization": f"Bearer {admin_token(SECRET)}"} if with_token else {}
    c = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
    try:
        c.request("GET", target, headers=headers)
        r = c.getresponse()
        r.read()
        # The server (http.server) folds leading slashes before routing: //health is /health.
        served = urllib.parse.urlparse("/" + target.lstrip("/")).path
        if served == "/health":
            assert r.status == 200
        elif served == "/":   # a fixed redirect to /status (which asks for the token), it tells nothing
            assert r.status == 302 and r.getheader("Location") == "/status"
        elif with_token and served in POST_ONLY:   # memcache_hybrid's answer to a GET of a POST route
            assert r.status == 405, (target, r.status)
        elif with_token:
            assert r.status in (200, 404), (target, r.status)
        else:
            assert r.status == 401, (target, r.status)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
    finally:
        c.close()
