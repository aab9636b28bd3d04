"""A weight update for engine tests, run inside vLLM's workers through ``LLM.apply_model``
(a module-level function, so the workers can unpickle it by name)."""

from __future__ import annotations

from typing import Any


def scale_weights(model: Any, match: str, factor: float) -> int:
    """Multiply every parameter whose name contains ``match`` by ``factor``; returns how many."""
    import torch

    n = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if match in name:
                param.mul_(factor)
                n += 1
    return n
