"""Built-in layer-budget policies; each module registers one policy."""

from .profile import Profile
from .pyramid import Pyramid
from .squeeze import Squeeze, kmeans_1d
from .uniform import Uniform

__all__ = ["Profile", "Pyramid", "Squeeze", "Uniform", "kmeans_1d"]
