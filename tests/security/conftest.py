"""The adversarial suite runs on the integration fixtures (``tests.integration.stores``); its raw-socket
helpers are in ``tests.security.wire``."""

from tests.integration.stores import meta, short_heartbeat, stores  # noqa: F401 - fixtures registered here
