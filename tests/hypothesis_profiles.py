"""Hypothesis settings profiles, one per way the property tests are run (selected in ``tests/conftest.py``).

* ``ci`` (when ``CI=true``; ``.ci/run`` sets it): derandomized, so a run explores the same examples
  every time and a red run is a real regression, not a draw; no example database.
* ``explore`` (``MEMCACHE_FUZZ=explore``, opt-in): random examples, ten times the budget of each
  property (``examples``), for a longer hunt; a failure prints the seed to replay it.
* ``dev`` (otherwise): Hypothesis' defaults, random examples, no example database.
"""

from __future__ import annotations

import os

from hypothesis import settings

EXPLORE_SCALE = 10

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", database=None, print_blob=True)
settings.register_profile("dev", database=None)


def profile() -> str:
    """The profile named by the environment (``MEMCACHE_FUZZ`` first, then ``CI``)."""
    if os.environ.get("MEMCACHE_FUZZ", "") == "explore":
        return "explore"
    return "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"


def examples(n: int) -> int:
    """A property's example budget: ``n``, or ten times that in the ``explore`` profile."""
    return n * EXPLORE_SCALE if profile() == "explore" else n
