"""The fixtures of this folder shared by several of its modules, and those that live elsewhere."""

import pytest

from memcache_core.local.segment import create_segment
from memcache_core.memory import Mapping
from tests.loops import data_server_loop  # noqa: F401 - each data-server test once per loop


@pytest.fixture
def pair():
    """A fresh 1 MiB segment as its owner maps it, and as a writer of the same host maps it again."""
    owner = create_segment(1 << 20)
    peer = Mapping(owner.path, owner.size, create=False)
    try:
        yield owner, peer
    finally:
        peer.close()
        owner.close()
