"""An eviction policy written outside kvpolicies, through its open score hook only.

``vnorm`` keeps a recent window (a fraction ``recent`` of the budget) plus the tokens whose **values** have
the largest L2 norm, a token's value being what attention adds to the output when it attends to it. It is an
example of the extension point, not a published method. The policy is this file: no change to kvpolicies'
caches or kernels. Registered through the ``kvpolicies.policies`` entry point in ``pyproject.toml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicies import EvictionPolicy, NewTokens
from kvpolicies.base import fraction_count


@dataclass(frozen=True)
class VNorm(EvictionPolicy):
    """Keep the recent window and the largest-norm values."""

    recent: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.recent, (int, float)) or not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"vnorm: recent={self.recent!r} must be a fraction in [0, 1]")

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_recent = fraction_count(budgets, self.recent)  # floor(recent * b), as H2O's window
        return torch.zeros_like(n_recent), n_recent

    def token_scores(self, new: NewTokens) -> torch.Tensor:
        """``[..., Hkv]``: each token's value norm (higher is kept first)."""
        return torch.linalg.vector_norm(new.v.float(), dim=-1)

