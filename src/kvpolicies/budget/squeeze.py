"""SqueezeAttention (Wang et al., 2024, "SqueezeAttention: 2D Management of KV-Cache in LLM Inference via
Layer-wise Optimal Budget"), Algorithm 1.

During prefill the model records, per cache layer ``l``, ``cos_sim[l]``: the mean over prompt tokens of
the cosine similarity between the hidden state before the attention block and after its residual add
(high = the layer changes the stream little = less important). The layers are clustered by KMeans into
3 groups (in torch, below); ``G3`` is the group with the highest mean similarity. With per-layer budget
``b_init`` and ``0 < p < 1``:

    b_l = p * b_init                                          for l in G3
    b_l = (n_layers * b_init - |G3| * p * b_init) / (|G1| + |G2|)   otherwise

so the total ``n_layers * b_init`` is conserved. The real values are rounded by largest remainder
(``_rounding.round_budgets``), which keeps the total exact and every layer ``>= min_budget``; spare
tokens go to the lower-similarity layers first, so a more similar layer never gets more.

The direction of ``p``: the paper's prose calls ``p`` the share of the budget *removed* from G3 while
Algorithm 1 gives G3 ``p * b_init``, the share *kept*. We follow Algorithm 1: a smaller ``p`` moves more
budget. Default ``p = 0.3`` (G3 keeps 30%).

Clustering is per sequence (each column of ``cos_sim``) and exact: in 1-D the optimal KMeans clusters
are intervals, so ``kmeans_1d`` tries every split (deterministic, no init to choose). With fewer than 3
distinct values the number of clusters drops to the number of distinct values; when all layers fall in
one cluster the budgets stay uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import BudgetPolicy, LayerStats, check_number, check_range, residual_cos_sim
from ..registry import register_policy
from ._rounding import check_budget_tokens, round_budgets


def kmeans_1d(values: torch.Tensor, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact 1-D KMeans: the ``k`` clusters with the least within-cluster sum of squares.

    In one dimension optimal clusters are intervals of the sorted values, so every split between
    distinct values is tried (``O(n^2)`` pairs for ``k = 3``, a few thousand for 80 layers) and the best
    taken; unlike Lloyd's iterations this cannot stop in a poor local optimum and needs no random init.
    Ties between equally good splits go to the earliest split.

    Parameters
    ----------
    values : Tensor ``[N]`` float
    k : int, 1 to 3
        Wanted clusters; reduced to the number of distinct values.

    Returns
    -------
    labels : Tensor ``[N]`` int64
        Cluster of each value, clusters numbered by increasing centre (0 = lowest).
    centres : Tensor ``[k']`` float64, increasing, ``k' = min(k, distinct values)``.
    """
    if not 1 <= k <= 3:
        raise ValueError(f"k={k} must be 1, 2 or 3")
    x = values.to(torch.float64).reshape(-1)
    sorted_x, order = torch.sort(x, stable=True)
    n = x.numel()
    k = min(k, int(torch.unique(x).numel()))
    s1 = torch.cat([x.new_zeros(1), sorted_x.cumsum(0)])                  # [N + 1] prefix sums
    s2 = torch.cat([x.new_zeros(1), (sorted_x**2).cumsum(0)])

    def sse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:           # cost of sorted_x[a:b]
        count = (b - a).to(torch.float64)
        return s2[b] - s2[a] - (s1[b] - s1[a]) ** 2 / count

    # Candidate boundaries: positions i where sorted_x[i - 1] < sorted_x[i] (never inside a run).
    cuts = torch.nonzero(sorted_x[1:] > sorted_x[:-1]).reshape(-1) + 1
    bounds = [0, n]
    if k == 2:
        best = int(torch.argmin(sse(torch.zeros_like(cuts), cuts) + sse(cuts, torch.full_like(cuts, n))))
        bounds = [0, int(cuts[best]), n]
    elif k == 3:
        i, j = torch.meshgrid(cuts, cuts, indexing="ij")
        valid = i < j
        i, j = i[valid], j[valid]
        cost = sse(torch.zeros_like(i), i) + sse(i, j) + sse(j, torch.full_like(j, n))
        best = int(torch.argmin(cost))
        bounds = [0, int(i[best]), int(j[best]), n]
    sorted_labels = torch.zeros(n, dtype=torch.int64)
    for c in range(1, len(bounds) - 1):
        sorted_labels[bounds[c]:] += 1
    labels = torch.empty_like(sorted_labels)
    labels[order] = sorted_labels
    centres = torch.stack([sorted_x[bounds[c]:bounds[c + 1]].mean() for c in range(len(bounds) - 1)])
    return labels, centres


@register_policy("squeeze", role="budget")
@dataclass(frozen=True)
class Squeeze(BudgetPolicy):
    """SqueezeAttention: move budget away from the layers that change the hidden state least."""

    p: float = 0.3

    needs_stats = True

    def __post_init__(self) -> None:
        check_number("squeeze", "p", self.p)
        check_range("squeeze", "p", self.p, 0.0, 1.0, lo_open=True, hi_open=True)

    def layer_statistic(self, h_in: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``cos(h_in, h_in + attn_out)`` per token: how little the layer's attention moves the residual."""
        return residual_cos_sim(h_in, attn_out)

    def targets(self, cos_sim: torch.Tensor) -> torch.Tensor:
        """Budget multipliers ``[n_layers]`` float64 (mean 1) for one sequence's ``cos_sim [n_layers]``."""
        n_layers = cos_sim.shape[0]
        labels, centres = kmeans_1d(cos_sim, 3)
        in_g3 = labels == centres.numel() - 1
        n_g3 = int(in_g3.sum())
        if centres.numel() <= 1 or n_g3 == n_layers:
            return torch.ones(n_layers, dtype=torch.float64)
        rest = (n_layers - n_g3 * self.p) / (n_layers - n_g3)
        return torch.where(in_g3, torch.tensor(self.p, dtype=torch.float64),
                           torch.tensor(rest, dtype=torch.float64))

    def allocate(self, budget_tokens: torch.Tensor, n_layers: int, stats: LayerStats | None,
                 min_budget: int = 1) -> torch.Tensor:
        budget_tokens = check_budget_tokens(budget_tokens, n_layers)
        cos_sim = None if stats is None else stats.cos_sim
        if cos_sim is None:
            raise ValueError("squeeze needs stats.cos_sim [n_layers, B] from prefill (the model records it "
                             "through cache.observe, with this policy's layer_statistic)")
        if tuple(cos_sim.shape) != (n_layers, budget_tokens.shape[0]):
            raise ValueError(f"stats.cos_sim must have shape [{n_layers}, {budget_tokens.shape[0]}] "
                             f"(n_layers, B), got {list(cos_sim.shape)}")
        if not bool(torch.isfinite(cos_sim).all()):
            raise ValueError("stats.cos_sim holds NaN or inf; record a finite similarity for every layer")
        cos_sim = cos_sim.detach().cpu()
        multipliers = torch.stack([self.targets(cos_sim[:, b]) for b in range(cos_sim.shape[1])], dim=1)
        targets = multipliers * budget_tokens.cpu().to(torch.float64)[None, :]    # [L, B]
        # Spare tokens from rounding go to the less similar (more important) layers first.
        out = round_budgets(targets, n_layers * budget_tokens.cpu(), min_budget, priority=cos_sim)
        return out.to(budget_tokens.device)
