"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling").

Budgets decrease linearly with depth: the top layer gets ``b / beta`` and the bottom layer
``2 b - b / beta`` (``b`` the per-layer budget), layers in between on the straight line, so the mean is
``b`` and the total ``n_layers * b`` is conserved. ``beta >= 1`` sets the slope (``beta = 1`` is
uniform; the paper uses 20). Rounded by largest remainder, which keeps the budgets non-increasing with
depth, the total exact and every layer ``>= min_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import BudgetPolicy, LayerStats, check_number, check_range
from ..registry import register_policy
from ._rounding import check_budget_tokens, round_budgets


@register_policy("pyramid", role="budget")
@dataclass(frozen=True)
class Pyramid(BudgetPolicy):
    """PyramidKV: budgets decrease linearly with depth."""

    beta: float = 20.0

    def __post_init__(self) -> None:
        check_number("pyramid", "beta", self.beta)
        check_range("pyramid", "beta", self.beta, 1.0, float("inf"), hi_open=True)

    def allocate(self, budget_tokens: torch.Tensor, n_layers: int, stats: LayerStats | None,
                 min_budget: int = 1) -> torch.Tensor:
        budget_tokens = check_budget_tokens(budget_tokens, n_layers)
        top = 1.0 / self.beta
        bottom = 2.0 - top
        depth = torch.arange(n_layers, dtype=torch.float64, device=budget_tokens.device)
        slope = depth / (n_layers - 1) if n_layers > 1 else torch.full_like(depth, 0.5)
        multipliers = bottom + (top - bottom) * slope                                  # [L], mean 1
        targets = multipliers[:, None] * budget_tokens.to(torch.float64)[None, :]     # [L, B]
        return round_budgets(targets, n_layers * budget_tokens, min_budget)
