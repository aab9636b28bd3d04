"""The data model of the object table: an object (``Obj``), a segment with its allocator, LRU list and
journal of removed objects (``Segment``), and the table's ``Counters``."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import msgspec

from ..protocol import JournalEntry, Location, ObjectReport, SegmentInfo
from .allocator import Allocator

MAX_JOURNAL = 1_000_000


class Obj(msgspec.Struct, eq=False, gc=False):
    """One object: a million of them fill a table, so every byte counts (benchmarks/bench_meta_memory.py).
    Not tracked by the garbage collector (it never holds a reference cycle: strings, numbers and
    locations only), which saves 16 bytes each and keeps full collections from walking them all."""

    key: str
    size: int
    generation: int
    locations: list[Location]
    owner: int                      # client that allocated it
    checksum: int = 0               # payload XXH3-64 from the writer (0: none)
    committed: bool = False
    pending_deadline: float = 0.0
    lease_until: float = 0.0
    replicas: int = 1               # replicas the put asked for
    under: bool = False             # committed with fewer locations than ``replicas`` (counted)
    disk: tuple[int, int] | None = None   # (segment id of the provider holding a disk record, its generation)
    disk_offered: float = 0.0       # offered to that provider's disk writer; not again before this time


class Segment:
    def __init__(self, info: SegmentInfo, allocator: Allocator, alloc_after: float = 0.0) -> None:
        self.info = info
        self.allocator = allocator
        self.lru: OrderedDict[str, Obj] = OrderedDict()  # committed objects here, least recent first
        self.journal: list[JournalEntry] = []
        self.journal_seq = 0
        self.alloc_after = alloc_after  # recovered segments wait out writers of the previous MetaService

    def record_removed(self, report: ObjectReport) -> None:
        """Tell the owner (on its next heartbeat) that this object is gone, so it clears the header."""
        self.journal_seq += 1
        self.journal.append(JournalEntry(self.journal_seq, False, report))
        if len(self.journal) > MAX_JOURNAL:
            del self.journal[: len(self.journal) - MAX_JOURNAL]

    def journal_since(self, ack: int) -> list[JournalEntry]:
        if self.journal and self.journal[0].seq <= ack:
            keep = next((i for i, e in enumerate(self.journal) if e.seq > ack), len(self.journal))
            del self.journal[:keep]
        return list(self.journal)

@dataclasses.dataclass
class Counters:
    allocs: int = 0
    commits: int = 0
    lookups: int = 0
    hits: int = 0
    exists: int = 0
    removes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    alloc_failures: int = 0
    pending_reclaimed: int = 0
    integrity_failures: int = 0
    evictions_to_disk: int = 0      # evictions that kept the object on its disk tier
    disk_drops: int = 0             # disk-only objects gone for good (their tier dropped the record)
    disk_hits: int = 0              # lookups that found an object on disk only
    promotions: int = 0             # disk-only objects brought back into DRAM

