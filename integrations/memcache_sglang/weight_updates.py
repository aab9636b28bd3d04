"""The weight version that enters the namespace, and how the backend learns of weight updates.

SGLang 0.5.23 never tells a storage backend that weights changed: after
``/update_weights_from_disk`` (``_from_tensor``, ``_from_distributed``, ``_from_ipc``) the scheduler
flushes the device and host caches (``Scheduler.flush_cache``), which never reaches L3. What the
backend can observe, in the scheduler process it lives in:

* ``runtime_context.get_serving().weight_version``: set by an update request that carries
  ``weight_version`` (``Scheduler.record_weight_version_change``);
* ``runtime_context.get_model().model_path``: set by ``update_weights_from_disk``
  (``ModelRunner.update_model_fields``);
* every successful update of any kind, through a hook on
  ``SchedulerWeightUpdaterManager.record_weight_version_after_update`` that the plugin installs
  (SGLang calls it after the new weights are loaded and before it flushes its caches).

An update that names its version moves the server to the namespace of that version, which other
servers updated (or started) with the same version share. An update without a version cannot be
named: the server moves to a namespace of its own (a random epoch) that no other server shares, so
it can never read KV of the old weights nor hand its new KV to servers still on the old ones.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HOOK_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater."
               "SchedulerWeightUpdaterManager.record_weight_version_after_update")

_lock = threading.Lock()
_unnamed_epoch = ""  # set on an update that carried no weight_version; random, never seeded


def after_weight_update(result: Any, manager: Any = None, weight_version: str | None = None,
                        *args: Any, **kwargs: Any) -> None:
    """AFTER hook: an update without a version gives this process a namespace of its own."""
    global _unnamed_epoch
    if weight_version is None:
        with _lock:
            _unnamed_epoch = uuid.uuid4().hex
        logger.warning("weights updated without a weight_version: this server's L3 namespace is now "
                       "private (epoch %s); pass weight_version to share the pool after updates",
                       _unnamed_epoch[:8])
    return None


def install_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, after_weight_update, HookType.AFTER)


@dataclass(frozen=True)
class WeightState:
    """What the served weights are right now, as far as the scheduler process knows."""

    model_path: str
    weight_version: str
    unnamed_epoch: str

    @property
    def label(self) -> str:
        if self.unnamed_epoch:
            return f"{self.weight_version}+unnamed-{self.unnamed_epoch}"
        return self.weight_version


def current_weight_state() -> WeightState:
    from sglang.srt.runtime_context import get_model, get_serving

    with _lock:
        epoch = _unnamed_epoch
    return WeightState(str(get_model().model_path), str(get_serving().weight_version), epoch)
