"""Uniform layer budgets: every cache layer keeps the same number of tokens (the default)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import BudgetPolicy, LayerStats
from ..registry import register_policy
from ._rounding import check_budget_tokens, round_budgets


@register_policy("uniform", role="budget")
@dataclass(frozen=True)
class Uniform(BudgetPolicy):
    """Every layer gets the same budget (the default)."""

    def allocate(self, budget_tokens: torch.Tensor, n_layers: int, stats: LayerStats | None,
                 min_budget: int = 1) -> torch.Tensor:
        budget_tokens = check_budget_tokens(budget_tokens, n_layers)
        targets = budget_tokens.to(torch.float64)[None, :].expand(n_layers, -1)   # [L, B]
        return round_budgets(targets, n_layers * budget_tokens, min_budget)

