"""Speculative decoding: proposers of draft tokens, verified by the target in one pass."""
from .config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
