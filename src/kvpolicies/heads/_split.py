"""The one top-k that ``adakv`` (one layer) and ``pooled`` (every compressed layer of a sequence) share."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def top_k_split(scores: Sequence[torch.Tensor], budgets: Sequence[int], n_forced: Sequence[tuple[int, int]],
                alpha: float) -> torch.Tensor:
    """``[n, Hkv]`` int64 budgets of ``n`` layers split together, from their ``[Hkv, L_l]`` scores (``L_l >
    budgets[l]``), budgets and forced ``(n_sink, n_recent)``.

    Every head keeps a floor of ``max(ceil(alpha * B_l), n_sink + n_recent, 1)`` tokens (its forced ones
    first); the ``Hkv * sum(B_l - floor_l)`` slots left go to the best of all other (layer, head, token)
    entries, ties to the earlier layer, then the lower head, then the head's earlier-ranked token. The
    budgets sum to ``Hkv * sum(budgets)``; none exceeds its layer's ``L``.
    """
    floors, rests = [], []
    for s, budget, (n_sink, n_recent) in zip(scores, budgets, n_forced):
        H, L = s.shape
        # The 1e-9 guard keeps binary rounding from adding a slot (0.2 * 5 = 1.0000000000000002).
        floor = min(L, max(math.ceil(alpha * budget - 1e-9), n_sink + n_recent, 1))
        ranked = s.to(torch.float32).clone()
        forced = torch.zeros(L, dtype=torch.bool, device=s.device)
        forced[:n_sink] = True
        if n_recent:
            forced[L - n_recent:] = True
        ranked[:, forced] = float("inf")  # in every head's floor
        # Each head's tokens best first (stable: ties to the earlier token); its first `floor` are kept.
        order = torch.sort(ranked, dim=1, descending=True, stable=True).values  # [H, L]
        floors.append(floor)
        rests.append(order[:, floor:])  # what each head's floor leaves to compete
    H = scores[0].shape[0]
    extra = sum(H * (b - f) for b, f in zip(budgets, floors))
    flat = torch.cat([r.flatten() for r in rests])  # layer-major, then head-major: the ties' order
    top = torch.sort(flat, descending=True, stable=True).indices[:extra].cpu()
    owner = torch.cat([torch.arange(H).repeat_interleave(r.shape[1]) + i * H for i, r in enumerate(rests)])
    won = torch.bincount(owner[top], minlength=len(rests) * H).view(len(rests), H)
    return torch.tensor(floors, dtype=torch.int64)[:, None] + won.to(torch.int64)
