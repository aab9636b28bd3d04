"""The transfer engine: moves payload between callers' buffers and pool segments, one copy each."""

from .engine import CopyOp, TransferEngine

__all__ = ["CopyOp", "TransferEngine"]
