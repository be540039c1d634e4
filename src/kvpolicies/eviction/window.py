"""Sliding-window attention (Beltagy et al., 2020, "Longformer"): keep the ``b`` most recent tokens.

Mapped onto the cache as: every slot is a forced recent slot, ``forced(b) = (0, b)``, no scores. The
prompt is cut to its last ``b`` tokens and decoding keeps the last ``b``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy
from ..registry import register_policy


@register_policy("window", role="eviction")
@dataclass(frozen=True)
class Window(EvictionPolicy):
    """Sliding window: keep the most recent tokens."""

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = budgets.to(torch.int32)
        return torch.zeros_like(b), b
