"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keep the first ``s`` tokens (attention sinks, paper default 4) and the most recent ``b - s``:
``forced(b) = (s, b - s)``, no scores. Applied to the prompt and at every decode step.
``min_budget = s + 1`` so at least one recent slot exists; a smaller budget (which the budget rules
never produce) degrades to ``min(s, b - 1)`` sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_int
from ..registry import register_policy


@register_policy("streaming", role="eviction")
@dataclass(frozen=True)
class Streaming(EvictionPolicy):
    """StreamingLLM: attention sinks plus a recent window."""

    sinks: int = 4

    def __post_init__(self) -> None:
        check_int("streaming", "sinks", self.sinks, 0)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = budgets.to(torch.int32)
        n_sink = torch.clamp(b - 1, min=0).clamp(max=self.sinks)
        return n_sink, b - n_sink

    def min_budget(self) -> int:
        return self.sinks + 1
