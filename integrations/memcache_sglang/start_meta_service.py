"""Start a MemCache MetaService from a JSON file, as SGLang's built-in backend documents:

    python -m memcache_sglang.start_meta_service --config_path metaservice_config.json

The same launcher as ``memcache meta-service --config_path F`` and ``python -m
memcache_core.meta_service``: JSON keys are the MetaConfig fields (unknown keys are warned about,
a bad value is refused naming its key), logging follows ``log_level``/``log_path`` and the rotation
keys. Exit status 0 after SIGTERM/SIGINT, 1 on a bad config or a MetaService that cannot start.
"""

from __future__ import annotations

import sys

from memcache_core.meta_service import main

if __name__ == "__main__":
    sys.exit(main())
