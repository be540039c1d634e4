"""Built-in head-budget policies; each module registers one policy."""

from .adakv import AdaKV
from .even import Even

__all__ = ["AdaKV", "Even"]
