"""A fixed per-layer budget profile, measured once per model instead of per prompt.

``weights[l]`` is layer ``l``'s share of the total, relative to the others: the budget of layer ``l`` is
``n_layers * b * weights[l] / sum(weights)`` (``b`` the per-layer budget), so the total
``n_layers * b`` is conserved, as with every layer-budget policy. Rounded by largest remainder, spare
tokens going to the larger weights first, every layer ``>= min_budget``. Without weights (the default)
every layer weighs the same: the budgets are ``uniform``'s.

Where the weights come from is the caller's choice. Without weights, :meth:`Profile.calibrate` measures them
through a model probe (``kvgen`` does, once per model); ``kvmodels.profile.retrieval_profile`` measures one on
random tokens, the way RazorAttention (Tang et al., 2024) finds retrieval heads: the layers whose heads copy
from earlier occurrences of the current token (echo) or from the token after them (induction) get more
budget. The weights carry no prompt information, so one profile serves every prompt of that model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from ..base import BudgetPolicy, LayerStats, ModelProbe
from ..registry import register_policy
from ._rounding import check_budget_tokens, round_budgets


@register_policy("profile", role="budget")
@dataclass(frozen=True)
class Profile(BudgetPolicy):
    """Budgets in proportion to fixed per-layer weights (one per cache layer of the model)."""

    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        w = self.weights
        if not isinstance(w, (tuple, list)):
            raise ValueError("profile: parameter weights must be a sequence of per-layer weights, one per "
                             f"cache layer, got {w!r} (kvmodels.profile.retrieval_profile measures one)")
        for i, x in enumerate(w):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"profile: weights[{i}] = {x!r}; every weight must be a finite number >= 0")
        if w and not sum(w) > 0:
            raise ValueError("profile: weights are all 0; give at least one layer a positive weight")
        object.__setattr__(self, "weights", tuple(float(x) for x in w))  # hashable, whatever was passed

    @property
    def needs_calibration(self) -> bool:
        return not self.weights

    def calibrate(self, probe: ModelProbe) -> tuple[Profile, str | None]:
        """Without weights: the model's retrieval profile, measured through ``probe``; with weights: as is."""
        if self.weights:
            return self, None
        t0 = time.perf_counter()
        weights = probe.retrieval_profile()
        seconds = time.perf_counter() - t0
        note = (f"this model's retrieval profile ({probe.name}, {seconds:.1f} s), layer weights "
                + " ".join(f"{w:.2f}" for w in weights))
        return replace(self, weights=weights), note

    def check_model(self, n_layers: int, n_kv_heads: int) -> None:
        self._check_layers(n_layers)

    def _check_layers(self, n_layers: int) -> None:
        if self.weights and len(self.weights) != n_layers:
            raise ValueError(f"profile: weights has {len(self.weights)} entries but the model has {n_layers} "
                             "cache layers; measure a profile for this model (one weight per cache layer)")

    def allocate(self, budget_tokens: torch.Tensor, n_layers: int, stats: LayerStats | None,
                 min_budget: int = 1) -> torch.Tensor:
        budget_tokens = check_budget_tokens(budget_tokens, n_layers)
        self._check_layers(n_layers)
        w = torch.tensor(self.weights or (1.0,) * n_layers, dtype=torch.float64, device=budget_tokens.device)
        multipliers = w * (n_layers / w.sum())                                         # [L], mean 1
        targets = multipliers[:, None] * budget_tokens.to(torch.float64)[None, :]     # [L, B]
        priority = (-w)[:, None].expand_as(targets)                                    # larger weight first
        return round_budgets(targets, n_layers * budget_tokens, min_budget, priority=priority)
