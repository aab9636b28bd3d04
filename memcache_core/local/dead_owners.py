"""Telling the MetaService that a segment's owner on this host is dead (``OwnerGone``): what a writer
finds after its commit, and what a LocalService finds once joined (``membership.py``)."""

from __future__ import annotations

import logging

from .. import protocol as p
from ..errors import MemCacheError
from ..rpc import RpcClient, expect
from .session import Session

logger = logging.getLogger(__name__)


def report_dead_owners(rpc: RpcClient, s: Session, gone: list[p.SegmentInfo]) -> None:
    """Report each of ``gone``; the MetaService drops its member at once (a report that does not reach
    it is logged: it finds out when the heartbeats stop)."""
    for seg in gone:
        logger.warning("the owner of segment %d (%s) is dead: puts copied there fail, and the MetaService "
                       "is told", seg.segment_id, seg.shm_path)
        try:
            expect(rpc.call(p.OwnerGone(s.client_id, s.token, seg.segment_id, seg.shm_path)), p.Ok)
        except MemCacheError as e:
            logger.warning("could not tell the MetaService that segment %d's owner is dead (%s); it "
                           "finds out when the heartbeats stop", seg.segment_id, e)
