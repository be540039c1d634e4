"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation").

A layer's ``Hkv * B`` slots go to the best tokens of **all** its KV heads, chosen by one top-k over the
heads' concatenated prompt scores, instead of the best ``B`` of each head: heads whose attention is peaked
keep fewer tokens, diffuse heads more. Every head first keeps a floor of ``max(ceil(alpha * B),
n_sink + n_recent, 1)`` tokens (the paper's safeguard, ``alpha = 0.2`` by default, plus the eviction
policy's forced sinks and window, which every head keeps). Ties go to the earlier token, then the lower head.

Head budgets are fixed at prefill; decode-time eviction then holds each head at its own budget. It composes
with any eviction policy that scores the prompt per head and any layer-budget policy:
``compose("squeeze", "snapkv", "adakv")``. Scores are compared across heads as they are: this suits
attention-mass scores (each head's votes sum to the same total), the setting of the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import HeadBudgetPolicy, check_number, check_range
from ..registry import register_policy
from ._split import top_k_split


@register_policy("adakv", role="heads")
@dataclass(frozen=True)
class AdaKV(HeadBudgetPolicy):
    """Ada-KV: one top-k across a layer's KV heads, with a per-head floor of ``alpha`` x the budget."""

    alpha: float = 0.2

    per_head = True

    def __post_init__(self) -> None:
        check_number(self.name, "alpha", self.alpha)
        check_range(self.name, "alpha", self.alpha, 0.0, 1.0)

    def split(self, scores: torch.Tensor, budget: int, n_forced: tuple[int, int], *,
              layer: int | None = None) -> torch.Tensor:
        H, L = scores.shape
        if L <= budget:
            return torch.full((H,), int(budget), dtype=torch.int64)
        n_sink, n_recent = (int(x) for x in n_forced)
        return top_k_split([scores], [int(budget)], [(n_sink, n_recent)], self.alpha)[0]
