"""Per-slot score update rules shared by the fused decode update and the prefill scorer.

See docs/contract.md §2.2. ``contrib`` is the attention mass one query step gives each slot, already
averaged over the query heads of the KV group (so it sums to 1 over the valid slots of a KV head).
"""

from __future__ import annotations

import torch

SCORE_MODES = ("none", "accumulate", "gumbel", "decay", "replace", "count_low")


def update_scores_ref(old: torch.Tensor, contrib: torch.Tensor, mode: str, *, decay: float = 1.0,
                      n_valid: torch.Tensor | int | None = None) -> torch.Tensor:
    """Return the new scores for one query step (float32, same shape as ``old``).

    old, contrib: ``[..., N]`` float32 — current scores and this step's contribution for N valid slots.
    n_valid: number of valid slots the step attended over (``count_low`` threshold ``1 / n_valid``);
        broadcastable to ``old[..., :1]``.
    """
    if mode == "none":
        return old
    if mode in ("accumulate", "gumbel"):
        return old + contrib
    if mode == "decay":
        return decay * old + contrib
    if mode == "replace":
        return contrib.clone()
    if mode == "count_low":
        if n_valid is None:
            raise ValueError("count_low needs n_valid (the number of slots attended over)")
        threshold = 1.0 / torch.as_tensor(n_valid, dtype=torch.float32, device=old.device).clamp_min(1)
        return old - (contrib < threshold).to(old.dtype)
    raise ValueError(f"score_mode={mode!r} is not supported; choose one of {list(SCORE_MODES)}")
