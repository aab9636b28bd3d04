"""``MetaService`` with memcache_hybrid's static API, and ``python -m memcache_core.meta_service``.

    MetaService.setup(MetaConfig(...)); MetaService.main()   # blocks until SIGTERM / SIGINT

Without ``setup``, ``main`` reads the JSON file named by ``MMC_META_CONFIG_PATH`` (or the defaults).
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import errors
from .config import MetaConfig, load_file, meta_config_from_env
from .errors import MemCacheError
from .logs import configure_logging

logger = logging.getLogger(__name__)


class MetaService:
    _config: MetaConfig | None = None

    @staticmethod
    def setup(config: MetaConfig) -> int:
        try:
            config.validate()
        except MemCacheError as e:
            logger.error("invalid MetaService config: %s", e)
            return e.code
        MetaService._config = config
        return errors.SUCCESS

    @staticmethod
    def main() -> int:
        from .meta.server import serve
        try:
            config = MetaService._config or meta_config_from_env()
        except MemCacheError as e:
            logger.error("invalid MetaService config: %s", e)
            return e.code
        try:
            serve(config)
        except OSError as e:
            logger.error("MetaService cannot start: %s", e)
            return errors.SERVICE_NOT_STARTED
        except MemCacheError as e:   # e.g. ha_enable without the etcd client installed
            logger.error("MetaService cannot start: %s", e)
            return e.code
        return errors.SUCCESS


def run_from_file(path: str) -> int:
    """Load ``path``, configure logging, serve; returns a process exit status."""
    try:
        config = load_file(MetaConfig, path)
    except MemCacheError as e:
        configure_logging("info")
        logging.getLogger("memcache_core").error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 1
    configure_logging(config.log_level, "" if config.log_output_target in ("stdout", "stderr") else config.log_path,
                      "meta_service",
                      config.log_rotation_file_size, config.log_rotation_file_count,
                      stdout=config.log_output_target == "stdout")
    if MetaService.setup(config) != 0:
        return 1
    return 0 if MetaService.main() == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memcache_core.meta_service",
                                 description="Run the MemCache MetaService.")
    ap.add_argument("--config_path", "--config-path", required=True, help="MetaService JSON config file")
    args = ap.parse_args(argv)
    return run_from_file(args.config_path)


if __name__ == "__main__":
    sys.exit(main())
