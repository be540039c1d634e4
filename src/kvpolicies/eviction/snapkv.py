"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Prompt only. The last ``W`` prompt queries (the observation window, 32 by default) vote:
``s[h, j] = sum_{i in window} A[h, i, j]`` (``prefill_mode="accumulate"``, ``prefill_window = min(W, L)``;
GQA: mean over the query heads of each KV group). The votes of the prefix ``j < L - W`` are smoothed
with a 1-D pooling (``pooling="max"`` or ``"avg"``, odd ``kernel``, default 7, stride 1, ``kernel // 2``
padding; the window's own scores are left alone, they are forced). Keep the window plus the top
``b - W`` prefix tokens (ties: the earlier token). Decoding appends without evicting
(``decode_evict = False``, ``score_mode = "none"``), as in the paper.

``chunk > 1`` (not in the paper; ChunkKV's idea, see ``chunkkv``) then sums the pooled prefix scores over
chunks of ``chunk`` consecutive tokens, so whole chunks are kept. ``align="grid"`` (default, ChunkKV's) cuts
the prefix every ``chunk`` tokens from the first; ``align="scores"`` places the chunks on the scores instead
(the highest-scoring span of ``chunk`` tokens first, then the best span overlapping none placed;
``kvpolicies.base.placed_chunk_sums``), so a grid boundary cannot cut a number in two; with
``per_head=False`` the chunks are placed once for the layer, on the heads' mean.

``per_head=False`` (not in the paper, which selects per head) makes the KV heads of a layer keep one
selection: each token's final score becomes its mean over the layer's KV heads (the mean over all query
heads), as TOVA's paper does. On SmolLM2-135M (3 KV heads per layer) this raised passkey answers at budget
0.2 from 9 to 19 of 22 for ``snapkv`` and from 15 to 20 for ``chunkkv`` (docs/results.md, "One selection
per layer and a 16-query window"): a head that does not read the key no longer drops it from the layer.
Both caches then hold every head of a layer at the same tokens; it does not compose with ``adakv``'s
per-head budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import EvictionPolicy, check_bool, check_int, chunk_sums, placed_chunk_sums
from ..registry import register_policy


@dataclass(frozen=True)
class WindowVotes(EvictionPolicy):
    """Prompt compression by the votes of the last ``window`` prompt queries (SnapKV, ChunkKV): the window
    is forced; each prefix token's votes go through :meth:`smooth`, then are summed over chunks of ``chunk``
    tokens (``chunk = 1``: token by token). Decoding appends without evicting."""

    window: int = 32
    chunk: int = 1
    per_head: bool = True
    align: str = "grid"

    prefill_mode = "accumulate"
    decode_evict = False

    def __post_init__(self) -> None:
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "chunk", self.chunk, 1)
        check_bool(self.name, "per_head", self.per_head)
        if self.align not in ("grid", "scores"):
            raise ValueError(f"{self.name}: parameter align={self.align!r} is out of range; choose 'grid' "
                             "(chunks every `chunk` tokens from the first) or 'scores' (chunks placed on the "
                             "highest-scoring spans)")

    @property
    def heads_share_selection(self) -> bool:
        return not self.per_head

    def prefill_window(self, prompt_len: int) -> int:
        return min(self.window, prompt_len)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = budgets.to(torch.int32)
        return torch.zeros_like(b), b.clamp(max=self.window)

    def smooth(self, prefix: torch.Tensor) -> torch.Tensor:
        """The prefix's ``[Hkv, L - W]`` votes before the chunk sums (none here)."""
        return prefix

    def postprocess_prefill_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Smoothed, chunk-summed prefix (``[Hkv, L - W]``) of ``[Hkv, L]`` scores; the window unchanged;
        with ``per_head=False``, each token's result averaged over the KV heads (every row the same)."""
        n_prefix = scores.shape[-1] - self.prefill_window(scores.shape[-1])
        if n_prefix > 0:
            prefix = self.smooth(scores[:, :n_prefix])
            if self.align == "grid":
                prefix = chunk_sums(prefix, self.chunk)
            elif self.per_head:
                prefix = placed_chunk_sums(prefix, self.chunk)
            else:  # one placement for the layer: chunks placed on the heads' mean
                prefix = placed_chunk_sums(prefix.mean(0, keepdim=True), self.chunk).expand_as(prefix)
            scores = torch.cat([prefix, scores[:, n_prefix:]], dim=-1)
        # Shared after smoothing: each head's own pooling first, as per head; then one ranking for all.
        return self.eviction_scores(scores, head_dim=0).contiguous()


@register_policy("snapkv", role="eviction")
@dataclass(frozen=True)
class SnapKV(WindowVotes):
    """SnapKV: compress the prompt by observation-window votes, smoothed by pooling."""

    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("snapkv", "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"snapkv: parameter kernel={self.kernel} must be odd (the pooling keeps length)")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv: parameter pooling={self.pooling!r} is out of range; "
                             "choose 'max' or 'avg'")

    def smooth(self, prefix: torch.Tensor) -> torch.Tensor:
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        # [Hkv, 1, L - W]: pooling wants a channel dim
        return pool(prefix[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
