"""No cross-layer merging: every cache layer stores its own K/V (the default)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import MergePolicy
from ..registry import register_policy


@register_policy("none", role="merge")
@dataclass(frozen=True)
class NoMerge(MergePolicy):
    """No cross-layer merging (the default)."""
