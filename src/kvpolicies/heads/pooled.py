"""Pooled head budgets: one top-k over the tokens of every compressed layer and KV head of a sequence.

``adakv`` moves a layer's slots between its KV heads; ``pooled`` also moves them between layers. The
compressed layers' ``Hkv * B_l`` slots (``B_l`` from the layer-budget policy) form one pool, and each
(layer, head) keeps as many tokens as win places in one ranking of all their scores: a layer whose heads
need few tokens gives its slots to one that needs many. This is KVzip's allocation (Kim et al., 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction"; kvpress's ``KVzipPress`` with its default
``layerwise=False``): its reconstruction scores are attention probabilities in ``[0, 1]`` in every layer,
so one threshold over all of them is meaningful. Compose it with ``kvzip`` (``compose("kvzip",
"pooled")``); with a policy whose scores grow with the layer (none of the built-in ones does: attention
mass sums to the same total per query row in every layer) the pool would favour those layers.

Every head first keeps a floor of ``max(ceil(alpha * B_l), n_sink + n_recent, 1)`` tokens: its forced
sinks and window (KVzip forces sinks only; ``alpha = 0`` by default, no further safeguard). A layer the
prompt fits in (``L <= B_l``) or that is not compressed keeps its budget and takes no part in the pool, so
the cache holds the layer-budget policy's total. Ties go to the earlier layer, then the lower head, then the
earlier token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..base import HeadBudgetPolicy, check_number, check_range
from ..registry import register_policy
from ._split import top_k_split


@register_policy("pooled", role="heads")
@dataclass(frozen=True)
class Pooled(HeadBudgetPolicy):
    """KVzip's allocation: one top-k over every compressed layer's and KV head's scores, with a per-head
    floor of ``alpha`` x its layer's budget (and its forced tokens)."""

    alpha: float = 0.0

    per_head = True
    pools_layers: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_number(self.name, "alpha", self.alpha)
        check_range(self.name, "alpha", self.alpha, 0.0, 1.0)

    def split(self, scores: torch.Tensor, budget: int, n_forced: tuple[int, int], *,
              layer: int | None = None) -> torch.Tensor:
        """One layer alone: the pool of that layer (Ada-KV's split with this floor)."""
        return self.split_layers([scores], [budget], [n_forced])[0]

    def split_layers(self, scores: Sequence[torch.Tensor], budgets: Sequence[int],
                     n_forced: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[n, Hkv]`` int64 budgets of ``n`` compressed layers of one sequence, from their ``[Hkv, L_l]``
        scores (``L_l > budgets[l]``), budgets and forced ``(n_sink, n_recent)``: they sum to ``Hkv *
        sum(budgets)``, each head of layer ``l`` keeps at least its floor and at most ``L_l``."""
        return top_k_split(scores, budgets, n_forced, self.alpha)
