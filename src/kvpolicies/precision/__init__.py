"""Built-in precision policies; each module registers one policy."""

from .kivi import Kivi
from .mikv import MiKV
from .native import Native
from .zipcache import ZipCache

__all__ = ["Kivi", "MiKV", "Native", "ZipCache"]
