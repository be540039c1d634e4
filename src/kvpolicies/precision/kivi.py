"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Every kept token is stored at ``bits`` (asymmetric: a scale and a zero point per ``group`` channels) except
the most recent ``residual`` tokens, which stay in the cache's dtype (KIVI quantizes them a group at a time
as they age). One deviation from the paper, for eviction's sake: keys are quantized **per token** like the
values (the paper groups a channel across ``group`` tokens), so every slot carries its own parameters and can
be evicted or moved alone; ZipCache's per-channel key normalisation is what recovers the accuracy that
per-channel grouping buys (``zipcache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NATIVE_BITS, PrecisionPolicy, check_int
from ..registry import register_policy
from ._checks import check_bits, check_group


@register_policy("kivi", role="precision")
@dataclass(frozen=True)
class Kivi(PrecisionPolicy):
    """KIVI: kept tokens at `bits` (per-token groups), the last `residual` in the cache's dtype."""

    bits: int = 4
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        check_bits(self.name, "bits", self.bits)
        check_group(self.name, self.group)
        check_int(self.name, "residual", self.residual, 0)

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        L = kept.shape[-1]
        recent = torch.arange(L, device=kept.device) >= L - self.residual
        bits = torch.where(recent, NATIVE_BITS, self.bits).expand_as(kept)
        return torch.where(kept, bits, 0).to(torch.int64)

    def group_size(self) -> int:
        return self.group

    def formats(self) -> tuple[int, ...]:
        return (self.bits, NATIVE_BITS)
