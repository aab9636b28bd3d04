"""Selects the Hypothesis profile for this run (``tests/hypothesis_profiles.py``): derandomized in CI."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("hypothesis") is not None:   # the engine environments may not have it
    from hypothesis import settings

    from tests.hypothesis_profiles import profile

    settings.load_profile(profile())
