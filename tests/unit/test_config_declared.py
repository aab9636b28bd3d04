"""Declared settings (``config_check.py``): every declared field is held to its annotation with a
message that names the key and what it takes, and docs/configuration.md's ranges and choices are the
declared ones."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from msgspec import inspect

from memcache_core.config import LocalConfig, MetaConfig, apply_dict, env_overrides
from memcache_core.config_check import declarations
from memcache_core.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
DECLARED = [(cls, key, hint) for cls in (MetaConfig, LocalConfig) for key, hint in declarations(cls)]


def fresh(cls: type) -> Any:
    return LocalConfig(protocol="host_shm") if cls is LocalConfig else MetaConfig()


@pytest.mark.parametrize(("cls", "key", "hint"), DECLARED, ids=lambda v: v if isinstance(v, str) else None)
def test_every_declared_key_refuses_a_wrong_value_by_name(cls, key, hint):
    with pytest.raises(ConfigError, match=rf"^{key}: expected .+, got \[\]$"):
        apply_dict(fresh(cls), {key: []})


@pytest.mark.parametrize(("cls", "key", "value", "message"), [
    (MetaConfig, "lease_ttl_ms", 5, "lease_ttl_ms: expected a number in [10, 3600000], got 5"),
    (MetaConfig, "lease_ttl_ms", True, "lease_ttl_ms: expected a number in [10, 3600000], got True"),
    (MetaConfig, "poll_spin_us", 0.5, "poll_spin_us: expected an integer in [0, 100000], got 0.5"),
    (MetaConfig, "evict_threshold_high", 101, "evict_threshold_high: expected a number in [1, 100], got 101"),
    (MetaConfig, "placement_policy", "nearest",
     "placement_policy: expected 'local_first', 'spread' or 'random', got 'nearest'"),
    (MetaConfig, "ha_enable", "yes", "ha_enable: expected true or false, got 'yes'"),
    (LocalConfig, "metrics_host", 5, "metrics_host: expected a string, got 5"),
    (LocalConfig, "shm_copy_loop", "fast", "shm_copy_loop: expected 'auto', 'native' or 'python', got 'fast'"),
    (LocalConfig, "checksum_verify_ratio", 2, "checksum_verify_ratio: expected a number in [0, 1], got 2"),
])
def test_messages_name_the_key_what_it_takes_and_the_value(cls, key, value, message):
    with pytest.raises(ConfigError) as e:
        apply_dict(fresh(cls), {key: value})
    assert str(e.value) == message


def test_what_was_accepted_before_still_is():
    """Scenario: a JSON file gives an integer setting as a float in range (``NUMBER``), and a key kept
    for memcache_hybrid compatibility any value: both load as they always did. ``ha_lease_ttl_ms`` is
    read, and checked, only with ``ha_enable``."""
    m = apply_dict(MetaConfig(), {"lease_ttl_ms": 5000.5, "lru_shard_count": "any", "ha_lease_ttl_ms": 1})
    assert (m.lease_ttl_ms, m.lru_shard_count, m.ha_lease_ttl_ms) == (5000.5, "any", 1)
    with pytest.raises(ConfigError, match=r"^ha_lease_ttl_ms: expected a number in \[2000, 600000\], got 1$"):
        apply_dict(MetaConfig(), {"ha_enable": True, "ha_etcd_endpoints": "127.0.0.1:2379", "ha_lease_ttl_ms": 1})


def test_choices_and_numbers_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEMCACHE_PLACEMENT_POLICY", "spread")
    monkeypatch.setenv("MEMCACHE_LEASE_TTL_MS", "0x100")
    monkeypatch.setenv("MEMCACHE_EVICT_THRESHOLD_HIGH", "95.5")
    assert env_overrides(MetaConfig) == {"placement_policy": "spread", "lease_ttl_ms": 256, "evict_threshold_high": 95.5}


def _documented(section: str) -> dict[str, str]:
    """key -> the "allowed" cell of one of docs/configuration.md's tables."""
    text = DOCS.read_text(encoding="utf-8").split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \| ([^|]*) \|", text, re.M)
    return {k: cell.strip() for k, cell in rows}


def _number(text: str) -> float:
    text = text.replace(",", "")
    if "^" in text:
        base, power = text.split("^")
        return float(base) ** float(power)
    return float(text)


@pytest.mark.parametrize(("cls", "section"), [(MetaConfig, "MetaConfig"), (LocalConfig, "LocalConfig")])
def test_the_docs_give_the_declared_ranges_and_choices(cls, section):
    documented = _documented(section)
    for key, hint in declarations(cls):
        info = inspect.type_info(hint)
        info = info.type if isinstance(info, inspect.Metadata) else info
        if isinstance(info, inspect.IntType | inspect.FloatType):
            lo, hi = re.match(r"([\d.,^]+)\s*[–-]\s*([\d.,^]+)", documented[key]).groups()   # type: ignore[union-attr]
            assert (_number(lo), _number(hi)) == (info.ge, info.le), key
        elif isinstance(info, inspect.LiteralType):
            assert {v for v in info.values if v} <= set(re.findall(r"`(\w+)`", documented[key])), key
