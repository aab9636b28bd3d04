"""The fixtures of this folder live in ``tests.integration.stores`` (one module, one import path)."""

from tests.integration.stores import meta, short_heartbeat, stores  # noqa: F401 - fixtures registered here
