"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models").

Score: accumulated attention, ``score[h, j] += sum_q A[h, q, j]``, over every prompt query
(``prefill_mode="accumulate"``) and every decode step (``score_mode="accumulate"``). For GQA the
contribution of a step is the mean over the query heads of the KV group (docs/contract.md §2.2).
Keep: the ``floor(recent * b)`` most recent tokens plus the top ``b - floor(recent * b)`` by score
among the rest (ties: the earlier token). The paper splits the budget evenly between heavy hitters and
recent tokens, hence ``recent = 0.5``. Evicted tokens' scores leave with them; new tokens start at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_number, check_range, fraction_count
from ..registry import register_policy


@register_policy("h2o", role="eviction")
@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """H2O: recent window plus heavy hitters by accumulated attention."""

    recent: float = 0.5

    score_mode = "accumulate"
    prefill_mode = "accumulate"

    def __post_init__(self) -> None:
        check_number("h2o", "recent", self.recent)
        check_range("h2o", "recent", self.recent, 0.0, 1.0)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_recent = fraction_count(budgets, self.recent)
        return torch.zeros_like(n_recent), n_recent
