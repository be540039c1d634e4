"""Scissorhands (Liu et al., NeurIPS 2023, "Scissorhands: Exploiting the Persistence of Importance
Hypothesis for LLM KV Cache Compression at Test Time").

A token is unimportant at a step when its attention falls below the average ``1 / n`` over the ``n``
tokens attended to; Scissorhands evicts the tokens unimportant most often, always keeping a recent
window. Mapped onto ``score_mode = prefill_mode = "count_low"``: ``score -= (c < 1 / n_valid)``, so the
score is minus the count and the top scores are the tokens counted least (ties: the earlier token).
Keep the ``floor(recent * b)`` most recent tokens plus the top ``b - floor(recent * b)`` of the rest.

Approximation: the paper counts within a history window of recent steps; here the count runs over every
step since the token entered the cache (all prompt queries, then every decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_number, check_range, fraction_count
from ..registry import register_policy


@register_policy("scissorhands", role="eviction")
@dataclass(frozen=True)
class Scissorhands(EvictionPolicy):
    """Scissorhands: evict the tokens most often below average attention; keep a recent window."""

    recent: float = 0.5

    score_mode = "count_low"
    prefill_mode = "count_low"

    def __post_init__(self) -> None:
        check_number("scissorhands", "recent", self.recent)
        check_range("scissorhands", "recent", self.recent, 0.0, 1.0)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_recent = fraction_count(budgets, self.recent)
        return torch.zeros_like(n_recent), n_recent
