"""ZipCache (He et al., 2024, "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token
Identification").

Saliency is the **normalized** attention score: a token's accumulated attention divided by the number of
queries that could attend to it (``L - i`` for prompt token ``i`` of ``L``), which removes the causal mask's
bias toward early tokens. The ``salient`` fraction of each KV head's kept tokens with the highest normalized
score are stored at ``high`` bits, the rest at ``low`` bits (token-wise rows, ``group`` channels per scale
and zero point; the paper divides keys by a per-channel factor first: ``channel_scale=True``, see ``kivi``;
``rotate=True`` stores both formats' rows Hadamard-rotated instead, see ``kivi``).
Ties go to the earlier token. It ranks by the eviction policy's prompt scores, so it composes with a scorer:
``compose("h2o", "zipcache", budget=0.5)``; ``compose("h2o", "zipcache", budget=1.0)`` quantizes without
evicting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NATIVE_BITS, PrecisionPolicy, check_bool, check_number, check_range
from ..registry import register_policy
from ._checks import check_bits, check_group, check_rotate


@register_policy("zipcache", role="precision")
@dataclass(frozen=True)
class ZipCache(PrecisionPolicy):
    """ZipCache: the `salient` share of kept tokens (normalized attention) at `high` bits, the rest `low`."""

    high: int = 4
    low: int = 2
    salient: float = 0.4
    group: int = 32
    channel_scale: bool = False  # ZipCache's channel-separable keys (kvkernels.quant.key_channel_scale)
    rotate: bool = False  # rows stored Hadamard-rotated (kvkernels.quant.hadamard_rotation)

    needs_scores = True

    def __post_init__(self) -> None:
        check_bits(self.name, "high", self.high, native=True)
        check_bits(self.name, "low", self.low)
        if self.low >= self.high:
            raise ValueError(f"{self.name}: low={self.low} must be below high={self.high} (bits of the "
                             "non-salient and the salient tokens)")
        check_number(self.name, "salient", self.salient)
        check_range(self.name, "salient", self.salient, 0.0, 1.0)
        check_group(self.name, self.group)
        check_bool(self.name, "channel_scale", self.channel_scale)
        check_rotate(self.name, self.rotate, self.channel_scale,
                     f"high={self.high} (use high=8 or 4)" if self.high == NATIVE_BITS else None)

    def normalized(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores [Hkv, L]`` over the number of queries that see each token: ``L - i`` for token ``i``."""
        L = scores.shape[-1]
        return scores.float() / torch.arange(L, 0, -1, device=scores.device, dtype=torch.float32)

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        if scores is None:
            raise ValueError(f"{self.name} ranks tokens by their attention scores; compose it with an "
                             "eviction policy that scores the prompt, e.g. compose('h2o', 'zipcache')")
        n_kept = kept.sum(-1, keepdim=True)  # [Hkv, 1]
        n_high = torch.ceil(n_kept * self.salient - 1e-9).long()  # 1e-9: 0.4 * 5 must stay 2
        rank_key = torch.where(kept, self.normalized(scores), float("-inf"))
        order = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices  # ties: earlier first
        positions = torch.arange(kept.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, positions)
        bits = torch.where(rank < n_high, self.high, self.low)
        return torch.where(kept, bits, 0).to(torch.int64)

    def group_size(self) -> int:
        return self.group

    def formats(self) -> tuple[int, ...]:
        return (self.low, self.high)
