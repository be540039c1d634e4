"""MiniCache (Liu et al., 2024, "MiniCache: KV Cache Compression in Depth Dimension for Large Language
Models").

Adjacent cache layers from the middle of the stack on are merged in pairs ``(l - 1, l)``: per token,
keys and values separately, ``r = |x|``, ``u = x / |x|``, ``theta = arccos(u_{l-1} . u_l)``,
``e = [sin((1 - t) theta) u_{l-1} + sin(t theta) u_l] / sin(theta)``; ``e`` is stored once with both
magnitudes and restored as ``e * r``. The ``ceil(retain_ratio * N)`` tokens with the largest angle are
kept unmerged in both layers. The kernel is ``kvkernels.magnitude_direction_merge``; this policy says
which pairs merge (``pairs``) and builds each pair's region with its ``t`` and ``retain_ratio``
(``region``).

Pairs: with ``s = floor(start * n_layers)``, ``(s, s + 1), (s + 2, s + 3), ...`` while both exist
(paper: from the middle layer, ``start = 0.5``; ``t = 0.5``; retention 5%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkernels import merge_region

from ..base import MergePolicy, check_number, check_range
from ..registry import register_policy


@register_policy("minicache", role="merge")
@dataclass(frozen=True)
class MiniCache(MergePolicy):
    """MiniCache: merge adjacent layers from the middle on by SLERP of directions."""

    start: float = 0.5
    t: float = 0.5
    retain_ratio: float = 0.05

    def __post_init__(self) -> None:
        for name in ("start", "t", "retain_ratio"):
            check_number("minicache", name, getattr(self, name))
            check_range("minicache", name, getattr(self, name), 0.0, 1.0)

    def pairs(self, n_layers: int) -> list[tuple[int, int]]:
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 0:
            raise ValueError(f"n_layers={n_layers!r} must be an int >= 0")
        first = int(self.start * n_layers + 1e-9)
        return [(l - 1, l) for l in range(first + 1, n_layers, 2)]

    def region(self, ka: torch.Tensor, kb: torch.Tensor, va: torch.Tensor, vb: torch.Tensor,
               pos: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> dict[str, torch.Tensor]:
        return merge_region(ka, kb, va, vb, pos, sa, sb, self.t, self.retain_ratio)
