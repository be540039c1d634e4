"""Even head budgets: every KV head of a layer keeps the layer's budget (the default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..base import HeadBudgetPolicy
from ..registry import register_policy


@register_policy("even", role="heads")
@dataclass(frozen=True)
class Even(HeadBudgetPolicy):
    """Every KV head keeps the layer's budget (the default)."""

    split_reads_scores: ClassVar[bool] = False
