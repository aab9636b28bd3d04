"""The fixtures of this folder that live elsewhere."""

from tests.loops import data_server_loop  # noqa: F401 - each data-server test once per loop
