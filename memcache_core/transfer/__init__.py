"""The transfer engine: moves payload between callers' buffers and pool segments, one copy each."""

from .engine import TransferEngine
from .ops import CopyOp

__all__ = ["CopyOp", "TransferEngine"]
