"""Retrieval heads and streaming heads (DuoAttention, Xiao et al., 2024; RazorAttention, Tang et al., 2024).

Both papers find that only a fraction of a model's attention heads, the *retrieval heads*, attend to the
whole context; the others (*streaming heads*) attend to the attention sinks and the recent tokens. They keep
the full KV cache for the retrieval heads and a short, constant one (sinks + a recent window) for the rest.
Both identify the heads once per model, without the prompt: DuoAttention by an optimization on synthetic
data, RazorAttention on random tokens repeated twice (echo and induction heads), the measurement
``kvmodels.profile`` makes. Both keep a model-wide share of the heads, not a share per layer.

Here a layer's ``Hkv * B`` slots (``B`` the layer's budget from the layer-budget policy) are split so that:

* the retrieval heads of the layer keep as much of the prompt as the total allows, up to all of it (``L``
  each), shared evenly among them (the remainder to the lower heads);
* every other head keeps what remains, at least the eviction policy's forced tokens (``n_sink +
  n_recent``, and 1): its sinks and window; what the retrieval heads cannot hold (all of their ``L``
  taken) goes to the streaming heads evenly.

A layer whose heads are all retrieval heads or none of them gives every head ``B``, as ``even`` does. The
total is conserved, so the cache's size is the layer budget policy's; the eviction policy still chooses
*which* tokens each head keeps (per head, by its scores), so a retrieval head below ``L`` keeps its best
ones and a streaming head at its floor keeps only what the eviction forces.

Parameters
----------
weights : per cache layer, one retrieval score per KV head, e.g. the largest echo or induction score of the
    head's query heads (``kvmodels.profile.retrieval_head_weights``). Without weights the policy is
    calibrated once per model (``ComposedPolicy.calibrate``, as ``kvgen`` does) with that measurement.
fraction : the share of the model's KV heads treated as retrieval heads, in ``[0, 1]``: the
    ``ceil(fraction * n_heads)`` heads with the highest weights, model-wide (ties to the earlier layer, then
    the lower head). DuoAttention reports its results with a quarter to a half of the heads as retrieval
    heads, RazorAttention with about 15%; default 0.25.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..base import HeadBudgetPolicy, ModelProbe, check_number, check_range
from ..registry import register_policy


def _check_weights(name: str, weights: object) -> tuple[tuple[float, ...], ...]:
    """``weights`` as a tuple of equal-length tuples of finite floats >= 0; errors name the parameter."""
    hint = "one sequence of per-KV-head scores per cache layer (kvmodels.profile.retrieval_head_weights)"
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (tuple, list)):
        raise ValueError(f"{name}: parameter weights must be {hint}, got {weights!r}")
    rows = []
    for l, row in enumerate(weights):
        if isinstance(row, (str, bytes)) or not isinstance(row, (tuple, list)) or not row:
            raise ValueError(f"{name}: parameter weights[{l}] = {row!r}; weights must be {hint}")
        for h, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"{name}: parameter weights[{l}][{h}] = {x!r}; every weight must be a "
                                 "finite number >= 0")
        if len(row) != len(weights[0]):
            raise ValueError(f"{name}: parameter weights[{l}] has {len(row)} heads and weights[0] "
                             f"{len(weights[0])}; every cache layer has the same number of KV heads")
        rows.append(tuple(float(x) for x in row))
    return tuple(rows)


@register_policy("duo", role="heads")
@dataclass(frozen=True)
class Duo(HeadBudgetPolicy):
    """Retrieval heads keep up to the whole prompt, the others their sinks and window (what remains)."""

    weights: tuple[tuple[float, ...], ...] = ()
    fraction: float = 0.25

    per_head: ClassVar[bool] = True
    split_reads_scores: ClassVar[bool] = False  # which heads retrieve comes from the weights, not the prompt

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _check_weights(self.name, self.weights))  # hashable
        check_number(self.name, "fraction", self.fraction)
        check_range(self.name, "fraction", self.fraction, 0.0, 1.0)

    # -- which heads retrieve -----------------------------------------------------------------------------
    def retrieval_heads(self) -> torch.Tensor:
        """``[n_layers, Hkv]`` bool: the ``ceil(fraction * n_heads)`` heads of highest weight, model-wide."""
        if not self.weights:
            raise ValueError(f"{self.name}: parameter weights is empty; pass per-layer, per-KV-head "
                             "retrieval scores (kvmodels.profile.retrieval_head_weights(model)) or calibrate "
                             "the policy on the model (ComposedPolicy.calibrate)")
        w = torch.tensor(self.weights, dtype=torch.float64)
        n = min(w.numel(), math.ceil(self.fraction * w.numel() - 1e-9))
        # stable sort of the flattened (layer-major) weights: ties to the earlier layer, then the lower head
        chosen = torch.sort(-w.flatten(), stable=True).indices[:n]
        mask = torch.zeros(w.numel(), dtype=torch.bool)
        mask[chosen] = True
        return mask.view(w.shape)

    # -- calibration ----------------------------------------------------------------------------------------
    @property
    def needs_calibration(self) -> bool:
        return not self.weights

    def calibrate(self, probe: ModelProbe) -> tuple[Duo, str | None]:
        """Without weights: the model's per-KV-head retrieval scores, measured through ``probe``."""
        if self.weights:
            return self, None
        fitted = replace(self, weights=probe.retrieval_heads())
        mask = fitted.retrieval_heads()
        per_layer = " ".join(str(int(x)) for x in mask.sum(dim=1))
        return fitted, (f"this model's retrieval heads ({probe.name}): {int(mask.sum())} of {mask.numel()} "
                        f"KV heads (fraction={self.fraction:g}), per layer {per_layer}")

    def check_model(self, n_layers: int, n_kv_heads: int) -> None:
        """Weights of ``n_layers`` cache layers of ``n_kv_heads`` KV heads each: the retrieval heads are
        chosen model-wide, so weights of another model are refused, not cut or padded, and none at all (not
        calibrated: :meth:`retrieval_heads` says how to get them) before a prompt is prefilled."""
        self.retrieval_heads()
        if (len(self.weights), len(self.weights[0])) != (n_layers, n_kv_heads):
            raise ValueError(f"{self.name}: parameter weights has {len(self.weights)} cache layers of "
                             f"{len(self.weights[0])} KV heads, and the model {n_layers} of {n_kv_heads}; "
                             "measure the weights on this model (kvmodels.profile.retrieval_head_weights)")

    # -- the split ------------------------------------------------------------------------------------------
    def split(self, scores: torch.Tensor, budget: int, n_forced: tuple[int, int], *,
              layer: int | None = None) -> torch.Tensor:
        H, L = scores.shape
        if L <= budget:
            return torch.full((H,), int(budget), dtype=torch.int64)
        mask = self.retrieval_heads()
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"{self.name}: split needs the cache layer's index (layer=), got {layer!r}; "
                             "ComposedPolicy.plan / head_budgets(..., layer=l) pass it")
        if not 0 <= layer < mask.shape[0]:
            raise ValueError(f"{self.name}: parameter weights has {mask.shape[0]} cache layers, and layer "
                             f"{layer} was asked for; measure the weights on this model")
        if mask.shape[1] != H:
            raise ValueError(f"{self.name}: parameter weights has {mask.shape[1]} KV heads per layer, and "
                             f"layer {layer} has {H}; measure the weights on this model")
        retrieval = mask[layer]
        k = int(retrieval.sum())
        if k in (0, H):
            return torch.full((H,), int(budget), dtype=torch.int64)
        n_sink, n_recent = (int(x) for x in n_forced)
        floor = min(L, max(n_sink + n_recent, 1))
        out = torch.full((H,), floor, dtype=torch.int64)
        left = H * int(budget) - H * floor
        for group in (retrieval, ~retrieval):  # retrieval heads first, the streaming heads what remains
            idx = torch.nonzero(group).flatten()
            room = len(idx) * (L - floor)
            give = min(left, room)
            share, rem = divmod(give, len(idx))
            out[idx] += share
            out[idx[:rem]] += 1
            left -= give
        return out
