"""TOVA, Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At every step keep the ``b`` tokens with the highest attention from the current query; nothing is
forced, so the newest token can be dropped too. Mapped onto ``score_mode = prefill_mode = "replace"``
(``score = c``): the prompt is scored by its last query (``prefill_window = 1``, which gives the same
scores as replacing over every row) and each decode step overwrites the scores.

Approximation: TOVA averages the attention over all heads of a layer and drops the same token from
every head; here each KV head averages over its query group and selects its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import EvictionPolicy
from ..registry import register_policy


@register_policy("tova", role="eviction")
@dataclass(frozen=True)
class TOVA(EvictionPolicy):
    """TOVA: keep the tokens the current query attends to most."""

    score_mode = "replace"
    prefill_mode = "replace"

    def prefill_window(self, prompt_len: int) -> int:
        return min(1, prompt_len)
