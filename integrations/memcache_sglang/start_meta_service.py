"""Start a MemCache MetaService from a JSON file, as SGLang's built-in backend documents:

    python -m memcache_sglang.start_meta_service --config_path metaservice_config.json

Same as ``memcache meta-service --config_path F``. JSON keys are the MetaConfig fields
(``meta_service_url``, ``config_store_url``, ``metrics_url``, ``log_level``,
``evict_threshold_high``, ``evict_threshold_low``, ...); unknown keys are warned about.
Exit codes follow the built-in launcher: 1 bad config, setup's code when setup fails, 2 on an
exception while serving, 0 on Ctrl-C or a clean stop.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

logger = logging.getLogger("memcache_sglang.start_meta_service")


def load_config(config_path: str) -> dict[str, Any]:
    with open(config_path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"config file must contain a JSON object: {config_path}")
    return data


def launch_meta_service(config_path: str) -> int:
    from memcache_core import MetaConfig, MetaService

    try:
        data = load_config(config_path)
    except (OSError, ValueError) as exc:
        logger.error("cannot load MetaService config %s: %s", config_path, exc)
        return 1
    cfg = MetaConfig()
    unknown = []
    for key, value in data.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
        else:
            unknown.append(key)
    if unknown:
        logger.warning("ignoring unknown MetaConfig keys: %s", unknown)
    try:
        rc = MetaService.setup(cfg)
        if isinstance(rc, int) and rc != 0:
            logger.error("MetaService.setup failed, rc=%s", rc)
            return rc
        logger.info("MetaService configured from %s", config_path)
        rc = MetaService.main()
        return rc if isinstance(rc, int) else 0
    except KeyboardInterrupt:
        return 0
    except Exception:
        logger.exception("MetaService failed")
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Launch a MemCache MetaService from a JSON config.")
    parser.add_argument("--config_path", "--config-path", required=True, help="MetaService JSON config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")
    return launch_meta_service(args.config_path)


if __name__ == "__main__":
    sys.exit(main())
