"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference"; ../shared/papers/more-methods.md).

Prompt only, like SnapKV: the last ``W`` prompt queries (the observation window, 32) vote,
``s[h, j] = sum_{i in window} A[h, i, j]`` (GQA: mean over the query heads of each KV group). The prefix
``j < L - W`` is cut into chunks of ``chunk`` consecutive tokens (10, from the first token) and every token
gets its chunk's total, so the top-k keeps whole chunks, best first: a number or a name is kept or dropped
as a unit instead of losing some of its tokens. The window is kept (forced). The budget is exact, so the last
chunk taken may be cut short (its earliest tokens kept). No pooling: the chunk sum smooths already.

``reuse = r`` is the paper's layer-wise index reuse: layer ``l`` selects by the scores of layer
``l - l % r`` (one scoring pass per ``r`` layers; each layer still keeps its own budget's worth of the
ranking). ``reuse = 1`` (default) scores every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_int, chunk_sums
from ..registry import register_policy


@register_policy("chunkkv", role="eviction")
@dataclass(frozen=True)
class ChunkKV(EvictionPolicy):
    """ChunkKV: keep whole chunks of the prompt, ranked by observation-window attention."""

    window: int = 32
    chunk: int = 10
    reuse: int = 1

    prefill_mode = "accumulate"
    decode_evict = False

    def __post_init__(self) -> None:
        check_int("chunkkv", "window", self.window, 1)
        check_int("chunkkv", "chunk", self.chunk, 1)
        check_int("chunkkv", "reuse", self.reuse, 1)

    def prefill_window(self, prompt_len: int) -> int:
        return min(self.window, prompt_len)

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = budgets.to(torch.int32)
        return torch.zeros_like(b), b.clamp(max=self.window)

    def postprocess_prefill_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Chunk totals over the prefix of ``[Hkv, L]`` scores; the (forced) window is left alone."""
        n_prefix = scores.shape[-1] - self.prefill_window(scores.shape[-1])
        if n_prefix <= 0:
            return scores
        return torch.cat([chunk_sums(scores[:, :n_prefix], self.chunk), scores[:, n_prefix:]], dim=-1)

    def score_source_layer(self, layer: int) -> int:
        return layer - layer % self.reuse
