"""The test harness itself, where other test runs on the same host can get in its way."""

from __future__ import annotations

import socket

import pytest

from memcache_core.testing import MetaServiceProcess

pytestmark = pytest.mark.integration


def test_a_port_taken_before_the_first_start_is_replaced_and_a_restart_keeps_the_ports(tmp_path):
    """Scenario: between ``free_port()`` and the MetaService's first start another process (another
    test run on this host) binds one of its ports. The first start takes other free ports instead of
    failing the test; a later restart keeps the ports it started on (clients know them by then)."""
    m = MetaServiceProcess(str(tmp_path))
    taken = m.config_store_url
    with socket.socket() as s:
        s.bind(("127.0.0.1", int(taken.rsplit(":", 1)[1])))
        s.listen()
        try:
            m.start()
            assert m.healthy() and m.config_store_url != taken
            urls = (m.meta_service_url, m.config_store_url, m.metrics_url)
            m.stop()
            m.start()
            assert m.healthy() and (m.meta_service_url, m.config_store_url, m.metrics_url) == urls
        finally:
            m.stop()
