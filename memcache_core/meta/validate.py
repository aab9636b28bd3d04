"""Everything a peer says is checked here before the MetaService acts on it.

Bounds keep every value encodable in a reply (msgpack integers are at most 64-bit) and every
structure the table builds from a request proportional to what the peer is allowed to hold.
A violation raises ``InvalidParameter`` (the caller answers with an error reply; the server goes on).
"""

from __future__ import annotations

import re

from .. import protocol as p
from ..config import WILDCARD_HOSTS
from ..errors import InvalidParameter, check_key, check_keys
from ..layout import footprint
from .generations import MAX_CARRIED

MAX_U63 = (1 << 63) - 1
MAX_U64 = (1 << 64) - 1
MAX_SEGMENT_BYTES = 1 << 48
MAX_OBJECT_BYTES = 1 << 40
MAX_BATCH = p.MAX_KEYS
MAX_REPORTS = 1 << 20        # disk records in a Join or DiskSync, journal positions in a Confirmed
MAX_REPLICAS = 8
MAX_TEXT = 256
MAX_NIXL_BYTES = 64 << 10    # a NIXL agent's metadata is about 0.5 KiB
SEGMENT_NAME = re.compile(r"^/(?:[A-Za-z0-9._-]+/)*memcache-\d+-[0-9a-f]{1,32}$")


def _int(name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise InvalidParameter(f"{name}: {v} is outside [{lo}, {hi}]")


def _text(name: str, v: str) -> None:
    if len(v) > MAX_TEXT:
        raise InvalidParameter(f"{name}: longer than {MAX_TEXT} characters")


def batch(keys: list[str], *others: list) -> None:
    if len(keys) > MAX_BATCH:
        raise InvalidParameter(f"a batch of {len(keys)} keys; at most {MAX_BATCH}")
    for o in others:
        if len(o) != len(keys):
            raise InvalidParameter("a batch's lists differ in length")
    check_keys(keys)


def arena_commit(req: p.ArenaCommit) -> None:
    batch(req.keys, req.offsets, req.sizes, req.checksums)
    _int("arena", req.arena, 0, MAX_U63)
    for off, size, checksum in zip(req.offsets, req.sizes, req.checksums, strict=True):
        _int("offset", off, 0, MAX_SEGMENT_BYTES)
        _int("size", size, 1, MAX_OBJECT_BYTES)
        _int("checksum", checksum, 0, MAX_U64)


def segment(info: p.SegmentInfo) -> None:
    _int("segment.size", info.size, 1 << 12, MAX_SEGMENT_BYTES)
    _text("segment.host_id", info.host_id)
    _text("segment.tag", info.tag)
    if len(info.nixl) > MAX_NIXL_BYTES:
        raise InvalidParameter(f"segment.nixl: {len(info.nixl)} bytes; at most {MAX_NIXL_BYTES}")
    if not SEGMENT_NAME.match(info.shm_path) or "/../" in info.shm_path:
        raise InvalidParameter(f"segment.shm_path: {info.shm_path!r} is not a segment file path")
    for name, addr in (("data_addr", info.data_addr), ("metrics_addr", info.metrics_addr or "x:1")):
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or host in WILDCARD_HOSTS or len(addr) > 300:
            raise InvalidParameter(f"segment.{name}: {addr!r} is not a reachable host:port")


def join(req: p.Join) -> None:
    _int("client_id", req.client_id, 0, MAX_U63)
    _int("pid", req.pid, 0, (1 << 32) - 1)
    _text("host_id", req.host_id)
    _int("generation_ceiling", req.generation_ceiling, 0, MAX_CARRIED)
    if req.segment is None:
        if req.objects or req.disk_objects or req.held:
            raise InvalidParameter(f"{'a held segment' if req.held else 'objects'} reported without a segment")
        return
    segment(req.segment)
    reports(req.objects, req.segment.size)
    disk_reports(req.disk_objects)


def reports(objects: list[p.ObjectReport], segment_size: int) -> None:
    """Objects a member says its segment (of ``segment_size`` bytes) holds (a ``Join``, a ``Report``)."""
    if len(objects) > min(p.MAX_KEYS, segment_size // footprint(1)):
        raise InvalidParameter(f"{len(objects)} objects reported in one request; at most {p.MAX_KEYS}, and no "
                               f"more than the segment can hold")
    for r in objects:
        check_key(r.key)
        _int("object.generation", r.generation, 1, MAX_U63)
        _int("object.checksum", r.checksum, 0, MAX_U64)
        _int("object.size", r.size, 1, MAX_OBJECT_BYTES)
        _int("object.offset", r.offset, 0, segment_size - footprint(r.size))


def moved(reports: list[p.SegmentBytes]) -> None:
    """A heartbeat's shared-memory byte counts: a bounded list of non-negative sums."""
    if len(reports) > MAX_BATCH:
        raise InvalidParameter(f"{len(reports)} segments' byte counts in one heartbeat; at most {MAX_BATCH}")
    for r in reports:
        _int("moved.segment_id", r.segment_id, 0, MAX_U63)
        _int("moved.read", r.read, 0, MAX_U63)
        _int("moved.written", r.written, 0, MAX_U63)


def disk_reports(reports: list[p.ObjectReport]) -> None:
    """Records a provider says its disk tier holds: bounded like DRAM objects."""
    if len(reports) > MAX_REPORTS:
        raise InvalidParameter(f"{len(reports)} disk records reported; at most {MAX_REPORTS} per message")
    for r in reports:
        check_key(r.key)
        _int("disk_object.generation", r.generation, 1, MAX_U63)
        _int("disk_object.checksum", r.checksum, 0, MAX_U64)
        _int("disk_object.size", r.size, 1, MAX_OBJECT_BYTES)


def disk_sync(req: p.DiskSync) -> None:
    if req.policy not in ("on_evict", "write_through"):
        raise InvalidParameter(f"disk policy: {req.policy!r} is not on_evict or write_through")
    for name, v in (("capacity", req.capacity), ("used", req.used), ("room", req.room)):
        _int(f"disk.{name}", v, 0, MAX_SEGMENT_BYTES)
    if len(req.counters) > 64:
        raise InvalidParameter("disk counters: at most 64")
    for k, v in req.counters.items():
        _text("disk counter", k)
        _int(f"disk counter {k}", v, 0, MAX_U63)
    disk_reports(req.added)
    disk_reports(req.dropped)


def alloc(req: p.Alloc) -> None:
    batch(req.keys, req.sizes)
    _int("replicas", req.replicas, 1, MAX_REPLICAS)
    if len(req.preferred) > MAX_REPLICAS:
        raise InvalidParameter(f"preferred: at most {MAX_REPLICAS} ids")
    for s in req.sizes:
        _int("size", s, 1, MAX_OBJECT_BYTES)


def corrupt(req: p.Corrupt) -> None:
    batch(req.keys, req.generations, *([req.segments] if req.segments else []))
    for sid in req.segments:
        _int("segment", sid, 0, MAX_U63)


def generations(gens: list[int]) -> None:
    for g in gens:
        _int("generation", g, 0, MAX_U63)


def checksums(sums: list[int]) -> None:
    for c in sums:
        _int("checksum", c, 0, MAX_U64)


def timeout_ms(v: int) -> None:
    _int("timeout_ms", v, 0, 86_400_000)


def grant(req: p.Grant) -> None:
    batch(req.keys, req.generations, req.segments, req.starts, req.ends)
    generations(req.generations)
    for sid, lo, hi in zip(req.segments, req.starts, req.ends, strict=True):
        _int("segment", sid, 0, MAX_U63)
        _int("start", lo, 0, MAX_OBJECT_BYTES)
        _int("end", hi, 0, MAX_OBJECT_BYTES)


def confirmed(journal: list[tuple[int, int, int]]) -> None:
    if len(journal) > MAX_REPORTS:
        raise InvalidParameter(f"{len(journal)} journal positions asked about; at most {MAX_REPORTS}")
    for sid, serial, seq in journal:
        _int("segment_id", sid, 0, MAX_U63)
        _int("serial", serial, 0, MAX_U63)
        _int("seq", seq, 0, MAX_U63)
