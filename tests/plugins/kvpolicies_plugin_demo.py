"""A tiny third-party policy package, found through the ``kvpolicies.policies`` entry-point group.

``test_registry`` writes a ``*.dist-info`` declaring ``every_other = kvpolicies_plugin_demo:EveryOther``
into a temporary directory on ``sys.path``; importing this module must not happen before that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicies import EvictionPolicy


@dataclass(frozen=True)
class EveryOther(EvictionPolicy):
    """Demo plugin: half the budget recent, the rest by accumulated attention."""

    score_mode = "accumulate"
    prefill_mode = "accumulate"

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = budgets.to(torch.int32)
        return torch.zeros_like(b), b // 2
