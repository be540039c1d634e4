"""Built-in merge policies; each module registers one policy."""

from .minicache import MiniCache
from .none import NoMerge

__all__ = ["MiniCache", "NoMerge"]
