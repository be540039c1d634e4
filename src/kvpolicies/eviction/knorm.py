"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Keys with a low L2 norm tend to receive high attention, so keep the ``b`` tokens whose keys have the lowest
norm: ``score = -||k||_2`` per (token, KV head), fixed when the token is cached. No attention scores are
needed, so it runs with any attention kernel. Nothing is forced (as NVIDIA kvpress's ``KnormPress``); the
prompt is compressed after prefill and, by default, the cache is evicted back to the budget at every decode
step (``decode=False``: the prompt only, as ``KnormPress``).

Written only through the open score hook (:meth:`EvictionPolicy.token_scores`): this file is the whole rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, NewTokens, check_bool
from ..registry import register_policy


@register_policy("knorm", role="eviction")
@dataclass(frozen=True)
class KNorm(EvictionPolicy):
    """KNorm: keep the tokens with the lowest key norm."""

    decode: bool = True

    def __post_init__(self) -> None:
        check_bool("knorm", "decode", self.decode)

    @property
    def decode_evict(self) -> bool:  # type: ignore[override]
        return self.decode

    def token_scores(self, new: NewTokens) -> torch.Tensor:
        return -torch.linalg.vector_norm(new.k.float(), dim=-1)
