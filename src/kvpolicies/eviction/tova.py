"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At every step keep the ``b`` tokens with the highest attention from the current query, averaged over all
heads of the layer, so every head drops the same token; nothing is forced, so the newest token can be
dropped too. Mapped onto ``score_mode = prefill_mode = "replace"`` (``score = c``): the prompt is scored by
its last query (``prefill_window = 1``, which gives the same scores as replacing over every row) and each
decode step overwrites the scores; ``heads_share_selection`` averages them over the layer's KV heads
before each eviction (the mean over KV heads of their group means is the mean over all query heads).

Parameters: ``per_head=True`` lets each KV head rank by its own query group and keep its own tokens (this
library's behaviour before 2026-11; not the paper's). ``decode=False`` compresses the prompt only, by the
last prompt token's attention, and lets the cache grow while decoding: NVIDIA kvpress's ``TOVAPress``
(a prefill-time press). The paper evicts at every decode step (``decode=True``, the default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_bool
from ..registry import register_policy


@register_policy("tova", role="eviction")
@dataclass(frozen=True)
class TOVA(EvictionPolicy):
    """TOVA: keep the tokens the current query attends to most (averaged over the layer's heads)."""

    per_head: bool = False
    decode: bool = True

    score_mode = "replace"
    prefill_mode = "replace"

    def __post_init__(self) -> None:
        check_bool("tova", "per_head", self.per_head)
        check_bool("tova", "decode", self.decode)

    @property
    def decode_evict(self) -> bool:  # type: ignore[override]  # a parameter here, a class constant elsewhere
        return self.decode

    def prefill_window(self, prompt_len: int) -> int:
        return min(1, prompt_len)

    @property
    def heads_share_selection(self) -> bool:
        return not self.per_head

    def postprocess_prefill_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return self.eviction_scores(scores, head_dim=0).contiguous()  # [Hkv, L]; shared: one row repeated
