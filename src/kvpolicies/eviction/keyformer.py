"""Keyformer (Adnan et al., MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for
Efficient Generative Inference").

Score: accumulated Gumbel-perturbed attention, ``score[h, j] += sum_q softmax((x + G) / tau_t)[h, q, j]``
with ``x = q.k * scale`` and ``G ~ Gumbel(0, 1)`` i.i.d. (``score_mode = prefill_mode = "gumbel"``).
The attention output itself uses the plain softmax; only the score sees the noise. The temperature
rises linearly, ``tau_t = tau_init + t * (tau_end - tau_init) / max_new_tokens``, with ``t = 0`` for the
prompt and ``t = step + 1`` for decode ``step`` (0-based), so the last step uses ``tau_end``.
Keep the ``floor(recent * b)`` most recent tokens (the paper's window ``w``, 30% of the budget) plus the
top ``b - w`` by score (ties: the earlier token).

Differences from the reference code, on purpose: tokens are compacted out of the cache (the reference
only masks them), scores are per sequence (the reference sums them over the batch), and the noise is
seeded (``ComposedPolicy.seed``) so a run is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import EvictionPolicy, check_number, check_range, fraction_count
from ..registry import register_policy


@register_policy("keyformer", role="eviction")
@dataclass(frozen=True)
class Keyformer(EvictionPolicy):
    """Keyformer: recent window plus key tokens by Gumbel-perturbed accumulated attention."""

    tau_init: float = 1.0
    tau_end: float = 2.0
    recent: float = 0.3

    score_mode = "gumbel"
    prefill_mode = "gumbel"

    def __post_init__(self) -> None:
        for name in ("tau_init", "tau_end"):
            check_number("keyformer", name, getattr(self, name))
            check_range("keyformer", name, getattr(self, name), 0.0, float("inf"), lo_open=True,
                        hi_open=True)
        check_number("keyformer", "recent", self.recent)
        check_range("keyformer", "recent", self.recent, 0.0, 1.0)

    needs_max_new_tokens = True  # tau rises from tau_init to tau_end over the generation

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_recent = fraction_count(budgets, self.recent)
        return torch.zeros_like(n_recent), n_recent

    def temperature(self, step: int, max_new_tokens: int) -> float:
        """``tau_t`` for decode ``step`` (0-based; ``step = -1`` is the prompt)."""
        if max_new_tokens < 1:
            raise ValueError(f"keyformer: max_new_tokens={max_new_tokens} must be >= 1")
        return float(self.tau_init + (step + 1) * (self.tau_end - self.tau_init) / max_new_tokens)

    def prefill_kwargs(self, prompt_len: int) -> dict[str, Any]:
        return {"temperature": float(self.tau_init)}

    def decode_kwargs(self, step: int, max_new_tokens: int) -> dict[str, Any]:
        return {"temperature": self.temperature(step, max_new_tokens)}
