"""What a provider's disk tier counts (``disk.py``): writes, reads, their bytes and failures, records
dropped for room and promotions; the MetaService shows them per tier (``meta/stats.py``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DiskCounters:
    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    writes_skipped: int = 0      # offers refused because the queue was full
    writes_stale: int = 0        # the DRAM copy changed before it was written
    reads: int = 0
    read_bytes: int = 0
    read_errors: int = 0
    integrity_failures: int = 0
    lru_drops: int = 0           # records dropped for good to make room
    promotions: int = 0
