"""Built-in head-budget policies; each module registers one policy."""

from .adakv import AdaKV
from .duo import Duo
from .even import Even
from .pooled import Pooled

__all__ = ["AdaKV", "Duo", "Even", "Pooled"]
