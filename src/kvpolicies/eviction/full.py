"""Full cache: keep every token (the baseline every other policy is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import EvictionPolicy
from ..registry import register_policy


@register_policy("full", role="eviction")
@dataclass(frozen=True)
class Full(EvictionPolicy):
    """Keep every token; the budget is ignored (the default eviction policy)."""

    prefill_compress = False
    decode_evict = False
