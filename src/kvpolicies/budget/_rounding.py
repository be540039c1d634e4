"""Turn real-valued layer budgets into integers that conserve the total exactly."""

from __future__ import annotations

import torch


def round_budgets(targets: torch.Tensor, totals: torch.Tensor, min_budget: int,
                  priority: torch.Tensor | None = None) -> torch.Tensor:
    """Integer layer budgets ``[L, B]`` int64 near ``targets`` with each column summing to ``totals``.

    Largest-remainder rounding above a floor: every layer first gets ``min_budget`` (or
    ``totals // L`` when the total cannot give every layer ``min_budget``); the rest,
    ``R = total - L * floor``, is shared in proportion to ``max(target - floor, 0)`` (evenly when that
    is zero everywhere), each layer taking the integer part of its share and the ``R - sum(parts)``
    leftover tokens going one each to the largest fractional parts (ties: the lower ``priority``, then
    the lower layer). When every
    target is ``>= min_budget`` and the targets sum to the total, this is plain largest-remainder
    rounding of the targets, and it preserves their order (a larger target never gets less).

    Parameters
    ----------
    targets : Tensor ``[L, B]`` float
        Wanted budgets per layer and sequence.
    totals : Tensor ``[B]`` int
        Exact column sums.
    min_budget : int
        Floor for every entry (when ``totals[b] >= L * min_budget``).
    priority : Tensor ``[L, B]``, optional
        Tie-break among equal fractional parts: a lower value gets the spare token first.
    """
    n_layers = targets.shape[0]
    totals = totals.to(torch.int64)
    floor = torch.clamp(totals // n_layers, max=min_budget)                         # [B]
    rest = totals - n_layers * floor                                                  # [B]
    excess = torch.clamp(targets.to(torch.float64) - floor[None, :], min=0.0)        # [L, B]
    col = excess.sum(0, keepdim=True)
    excess = torch.where(col > 0, excess, torch.ones_like(excess))
    shares = excess / excess.sum(0, keepdim=True) * rest[None, :]                     # [L, B], sums to rest
    parts = torch.floor(shares).to(torch.int64)
    leftover = rest - parts.sum(0)                                                    # [B], in [0, L]
    # Rank layers by fractional part, largest first; ties by priority, then the lower layer (stable sorts).
    frac = shares - parts
    order = torch.arange(n_layers, device=frac.device)[:, None].expand_as(frac)       # [L, B]
    if priority is not None:
        order = torch.sort(priority.to(frac.device), dim=0, stable=True).indices
    frac_in_order = frac.gather(0, order)
    order = order.gather(0, torch.sort(frac_in_order, dim=0, descending=True, stable=True).indices)
    rank = torch.empty_like(order)
    positions = torch.arange(n_layers, device=order.device)[:, None].expand_as(order).contiguous()
    rank.scatter_(0, order, positions)
    parts += (rank < leftover[None, :]).to(torch.int64)
    return parts + floor[None, :]


def cap_budgets(budgets: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Cap layer budgets ``[L, B]`` at ``capacity [B]`` (what a layer can hold: the prompt length) and
    hand the overflow to the layers that still have room, so the column total is conserved up to
    ``L * capacity``.

    Without this, a budget policy that moves budget onto a few layers (SqueezeAttention on SmolLM2 gives
    three outlier layers ~7x the mean) would promise them more tokens than the prompt has, and that budget
    would silently be lost. The overflow goes one token at a time, round-robin, to the layers with room in
    order of their current budget (largest first; ties: the lower layer), which keeps the policy's order.
    """
    out = budgets.to(torch.int64).clone()
    cap = capacity.to(torch.int64)
    for b in range(out.shape[1]):
        col, c = out[:, b], int(cap[b])
        spare = int((col - c).clamp_min(0).sum())
        col.clamp_(max=c)
        while spare > 0:
            room = torch.nonzero(col < c).reshape(-1)
            if room.numel() == 0:
                break                    # every layer holds the whole prompt: nothing left to give
            order = room[torch.sort(-col[room], stable=True).indices]
            give = order[:spare]
            col[give] += 1
            spare -= give.numel()
    return out


def check_budget_tokens(budget_tokens: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Shared argument checks of ``allocate``; returns ``budget_tokens`` as int64 ``[B]``."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be an int >= 1")
    if not isinstance(budget_tokens, torch.Tensor) or budget_tokens.dim() != 1:
        raise ValueError("budget_tokens must be a 1-D integer tensor [B] (ComposedPolicy.budget_tokens "
                         "gives one)")
    if budget_tokens.is_floating_point() or budget_tokens.dtype == torch.bool:
        raise TypeError(f"budget_tokens has dtype {budget_tokens.dtype}; pass integer token counts "
                        "(budget_tokens.long())")
    if budget_tokens.numel() and int(budget_tokens.min()) < 0:
        raise ValueError(f"budget_tokens must be >= 0, got min {int(budget_tokens.min())}")
    return budget_tokens.to(torch.int64)
