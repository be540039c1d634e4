"""ZipCache (He et al., 2024, "ZipCache: Accurate and Efficient KV Cache Quantization with Salient Token
Identification").

Saliency is the **normalized** attention score: a token's accumulated attention divided by the number of
queries that could attend to it (``L - i`` for prompt token ``i`` of ``L``), which removes the causal mask's
bias toward early tokens. Under a policy whose last ``W`` queries vote (``snapkv``) those are the queries
behind the scores, so the count is ``min(W, L - i)`` (the cache passes it, ``assign(voters=)``). The
``salient`` fraction of each KV head's kept tokens with the highest normalized score are stored at ``high``
bits, the rest at ``low`` bits (token-wise rows, ``group`` channels per scale
and zero point; the paper divides keys by a per-channel factor first: ``channel_scale=True``, see ``kivi``;
``rotate=True`` stores both formats' rows Hadamard-rotated instead, see ``kivi``).
Ties go to the earlier token. It ranks by the eviction policy's prompt scores, so it composes with a scorer:
``compose("h2o", "zipcache", budget=0.5)``; ``compose("h2o", "zipcache", budget=1.0)`` quantizes without
evicting.

While decoding, new tokens enter at ``high`` bits and are re-compressed every ``every`` of them (the paper:
~100; 0 never): the tokens that arrived since the last compression are split like the prompt, their
``salient`` share by normalized score (accumulated attention over the queries that have seen each token,
:meth:`saliency`) staying at ``high`` bits. Under a policy that evicts while decoding
(``compose("h2o", "zipcache", budget=0.2)``) the high bits hold at most the ``salient`` share of the budget:
a re-compression that would exceed it (or a high-bit region that alone exceeds the budget, which starts one
early) re-selects the salient tokens among every high-bit token, and the eviction takes low-bit tokens only
(``kvmodels.cache.tiers.SideRegion``). A policy that scores nothing while decoding (``snapkv``) gets H2O's
accumulated attention on the decode steps for this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NATIVE_BITS, PrecisionPolicy, check_bool, check_int, check_number, check_range
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
    every: int = 100  # re-compress the tokens decoded since the last compression every `every` (0: never)

    needs_scores = True
    reselects = True

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
        check_int(self.name, "every", self.every, 0)

    def normalized(self, scores: torch.Tensor, voters: torch.Tensor | None = None) -> torch.Tensor:
        """``scores [Hkv, L]`` over the number of queries that see each token: ``voters [L]``, or ``L - i``
        for token ``i``."""
        if voters is None:
            voters = scores.shape[-1] - torch.arange(scores.shape[-1], device=scores.device)
        return scores.float() / voters.clamp(min=1).to(device=scores.device, dtype=torch.float32)

    @staticmethod
    def saliency(scores: torch.Tensor, positions: torch.Tensor, seen: int, window: int = 0) -> torch.Tensor:
        """The normalized score: ``scores`` (float) over the number of queries that have seen each token,
        ``seen - position`` for a sequence of ``seen`` tokens (``positions`` broadcasts with ``scores``), at
        most ``window`` when only the last ``window`` queries voted (0: every query did)."""
        voters = (seen - positions).clamp(min=1)
        if window:
            voters = voters.clamp(max=window)
        return scores.float() / voters.to(torch.float32)

    def high_share(self, n):
        """The most of ``n`` tokens a layer (KV head) holds at ``high`` bits: the ``salient`` share, rounded
        up; ``n`` an int, or a numpy array of counts (each its own)."""
        share = -((1e-9 - self.salient * n) // 1)  # ceil(salient * n - 1e-9); 1e-9: 0.4 * 5 must stay 2
        return int(share) if isinstance(share, float) else share.astype("int64")

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None,
               voters: torch.Tensor | None = None) -> torch.Tensor:
        if scores is None:
            raise ValueError(f"{self.name} ranks tokens by their attention scores; compose it with an "
                             "eviction policy that scores the prompt, e.g. compose('h2o', 'zipcache')")
        n_kept = kept.sum(-1, keepdim=True)  # [Hkv, 1]
        n_high = torch.ceil(n_kept * self.salient - 1e-9).long()  # 1e-9: 0.4 * 5 must stay 2
        rank_key = torch.where(kept, self.normalized(scores, voters), float("-inf"))
        order = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices  # ties: earlier first
        positions = torch.arange(kept.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, positions)
        bits = torch.where(rank < n_high, self.high, self.low)
        return torch.where(kept, bits, 0).to(torch.int64)

    def group_size(self) -> int:
        return self.group

    def formats(self) -> tuple[int, ...]:
        return (self.low, self.high)
