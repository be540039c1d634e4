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

``per_head=False`` (as for ``snapkv``; not in the paper) gives every KV head of a layer one selection, by
the heads' mean chunk scores. ``align="scores"`` (as for ``snapkv``; not in the paper) places the chunks on
the highest-scoring spans instead of a grid from the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import check_int
from ..registry import register_policy
from .snapkv import WindowVotes


@register_policy("chunkkv", role="eviction")
@dataclass(frozen=True)
class ChunkKV(WindowVotes):
    """ChunkKV: keep whole chunks of the prompt, ranked by observation-window attention (unpooled)."""

    chunk: int = 10
    reuse: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("chunkkv", "reuse", self.reuse, 1)

    def score_source_layer(self, layer: int) -> int:
        return layer - layer % self.reuse
