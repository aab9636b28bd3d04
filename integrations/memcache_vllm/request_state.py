"""What the scheduler side (``scheduler.py``) keeps per request: its last pool lookup, reused a
while, and what of it was handed to saves."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# A request that waits (no free blocks yet) is asked about every step; its answer is reused this
# long, so a waiting request costs one existence call, not one per step.
LOOKUP_REUSE_S = 1.0


@dataclass
class Lookup:
    start_block: int
    hit_blocks: int
    at: float = field(default_factory=time.monotonic)


@dataclass
class SaveTracker:
    block_ids: list[int] = field(default_factory=list)
    next_block: int = 0
    """Blocks below this are computed elsewhere (local or pool hit) or already handed to a save."""
    has_saves: bool = False
    """Saves were issued since the request's last preemption (its free must wait for them)."""
    issued: dict[int, str] = field(default_factory=dict)
    """Block index -> block name of every block handed to a save (removed again if it turns out
    to have been computed over a block that failed to load)."""
