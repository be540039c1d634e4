"""Native precision: every kept token in the cache's dtype (the default)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import PrecisionPolicy
from ..registry import register_policy


@register_policy("native", role="precision")
@dataclass(frozen=True)
class Native(PrecisionPolicy):
    """Every kept token stored in the cache's dtype (the default)."""

    quantizes = False
