"""A2SF (Jo & Shin, 2024, "A2SF: Accumulative Attention Scoring with Forgetting Factor for Token Pruning
in Transformer Decoder").

H2O with a forgetting factor: ``score <- decay * score + sum_q A`` at every prompt query and decode step
(``score_mode = prefill_mode = "decay"``), so old attention counts less and tokens of different ages
compare fairly. Keep the ``floor(recent * b)`` most recent tokens plus the top-scoring rest, as H2O
(``recent = 0.5`` by default; the paper builds on H2O's split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import EvictionPolicy, check_number, check_range, fraction_count
from ..registry import register_policy


@register_policy("a2sf", role="eviction")
@dataclass(frozen=True)
class A2SF(EvictionPolicy):
    """A2SF: H2O scores with a forgetting factor."""

    decay: float = 0.9
    recent: float = 0.5

    score_mode = "decay"
    prefill_mode = "decay"

    def __post_init__(self) -> None:
        check_number("a2sf", "decay", self.decay)
        check_range("a2sf", "decay", self.decay, 0.0, 1.0, lo_open=True)
        check_number("a2sf", "recent", self.recent)
        check_range("a2sf", "recent", self.recent, 0.0, 1.0)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_recent = fraction_count(budgets, self.recent)
        return torch.zeros_like(n_recent), n_recent

    def prefill_kwargs(self, prompt_len: int) -> dict[str, Any]:
        return {"decay": float(self.decay)}

    def decode_kwargs(self, step: int, max_new_tokens: int) -> dict[str, Any]:
        return {"decay": float(self.decay)}
