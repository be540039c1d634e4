"""Built-in eviction policies; each module registers one policy."""

from .a2sf import A2SF
from .chunkkv import ChunkKV
from .full import Full
from .h2o import H2O
from .keyformer import Keyformer
from .knorm import KNorm
from .kvzip import KVzip
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA
from .window import Window

__all__ = ["A2SF", "ChunkKV", "Full", "H2O", "KNorm", "KVzip", "Keyformer", "Scissorhands", "SnapKV",
           "Streaming", "TOVA", "Window"]
