"""The client side of HA fencing, over real sockets: replies of an older leader term are refused,
"not the leader" moves a URL-list client on to the next MetaService at once."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from memcache_core import errors
from memcache_core import protocol as p
from memcache_core.rpc import FrameServer, RpcClient, expect
from memcache_core.testing import free_port, polling


class Server:
    """A FrameServer answering Exist with a fixed term (or NOT_LEADER)."""

    def __init__(self, frame_loop: str = "auto") -> None:
        self.port = free_port()
        self.term = 0
        self.leader = True
        self.calls = 0
        self.srv = FrameServer([("127.0.0.1", self.port)], self.answer, frame_loop=frame_loop)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def answer(self, body: bytes) -> bytes:
        self.calls += 1
        if not self.leader:
            return p.request_encoder.encode(p.Error(errors.NOT_LEADER, "standby", term=self.term))
        return p.request_encoder.encode(p.Flags([True], term=self.term))


@pytest.fixture
def servers(frame_loop: str) -> Iterator[list[Server]]:
    """Two servers, polled on threads (each frame loop)."""
    made = [Server(frame_loop), Server(frame_loop)]
    with contextlib.ExitStack() as stack:
        for s in made:
            stack.enter_context(polling(s.srv))
        yield made


def test_a_reply_of_an_older_term_is_refused(servers):
    s = servers[0]
    rpc = RpcClient(s.url, 2.0)
    try:
        s.term = 7
        assert expect(rpc.call(p.Exist(["k"])), p.Flags).flags == [True]
        assert rpc.max_term == 7
        s.term = 5   # a deposed leader whose answers still arrive
        with pytest.raises(errors.NotLeader, match="older than term 7"):
            rpc.call(p.Exist(["k"]))
        s.term = 9
        assert expect(rpc.call(p.Exist(["k"])), p.Flags).flags == [True] and rpc.max_term == 9
    finally:
        rpc.close()


def test_a_list_client_moves_past_a_standby_at_once(servers):
    standby, leader = servers
    standby.leader, leader.term = False, 3
    rpc = RpcClient(f"{standby.url},{leader.url}", 2.0)
    try:
        # one call: refused by the standby, then the leader
        assert expect(rpc.call(p.Exist(["k"])), p.Flags).flags == [True]
        assert (standby.calls, leader.calls, rpc.url) == (1, 1, leader.url)
        leader.leader, standby.leader, standby.term = False, True, 4   # roles swap
        assert expect(rpc.call(p.Exist(["k"])), p.Flags).flags == [True] and rpc.url == standby.url
    finally:
        rpc.close()


def test_a_single_url_client_reports_not_leader(servers):
    s = servers[0]
    s.leader = False
    rpc = RpcClient(s.url, 2.0)
    try:
        with pytest.raises(errors.NotLeader) as e:
            rpc.call(p.Exist(["k"]))
        assert e.value.code == errors.NOT_LEADER == -3120
    finally:
        rpc.close()


class SlowServer(Server):
    """Answers after ``delay_s``: a live MetaService starved of CPU."""

    delay_s = 0.0

    def answer(self, body: bytes) -> bytes:
        time.sleep(self.delay_s)
        return super().answer(body)


@pytest.fixture
def slow() -> Iterator[SlowServer]:
    s = SlowServer()
    with polling(s.srv):
        yield s


def test_a_short_probe_without_an_answer_does_not_make_other_calls_fail_at_once(slow):
    """A heartbeat (a probe with a timeout shorter than the client's) that times out says the
    MetaService is slow, not down: the next call waits for its answer instead of failing with -3017.
    Negative control: a call that waited its whole client timeout does mark it down."""
    rpc = RpcClient(slow.url, 5.0)
    try:
        slow.delay_s = 0.6
        with pytest.raises(errors.MetaServiceUnavailable):
            rpc.call(p.Exist(["k"]), timeout_s=0.2, probe=True)
        assert not rpc.down
        assert expect(rpc.call(p.Exist(["k"])), p.Flags).flags == [True]   # waited, answered
    finally:
        rpc.close()
    rpc = RpcClient(slow.url, 0.2)
    try:
        with pytest.raises(errors.MetaServiceUnavailable):
            rpc.call(p.Exist(["k"]))
        assert rpc.down
        with pytest.raises(errors.MetaServiceUnavailable, match="unreachable"):
            rpc.call(p.Exist(["k"]))   # at once: it is known down
    finally:
        rpc.close()
