"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Every kept token is stored at ``bits`` (asymmetric: a scale and a zero point per ``group`` channels) except
the most recent ``residual`` tokens each KV head keeps, which stay in the cache's dtype (KIVI quantizes them
a group at a time as they age; so does the paged cache: once more than ``residual + group`` wait, all
but the newest ``residual`` are quantized). One deviation from the paper, for eviction's sake: keys are
quantized **per token** like the values (the paper groups a channel across ``group`` tokens), so every
slot carries its own parameters and can be evicted or moved alone. Simulated on SmolLM2 (docs/results.md,
"KIVI's per-channel keys, simulated"): equal at 4 bits; at 2 bits per-channel keys keep 1-4 more passkey
answers of 24 without eviction and 2-3 fewer under eviction at 0.2 (a group of kept tokens spans the context).
``channel_scale=True`` divides the keys by ZipCache's per-channel factor first (``sqrt(max |k|)`` per channel
over each sequence's prompt, a power of two; the queries are multiplied by it), which spreads a token's
levels over all its channels instead of a few large ones. ``rotate=True`` stores every row rotated by a fixed
randomized Hadamard matrix instead (RotateKV's and QuaRot's remedy, ``kvkernels.quant.hadamard_rotation``;
the queries are rotated the same way and the attention's output rotated back, so ``q . k`` is unchanged),
which spreads a large channel over all channels while each row keeps its own parameters; it needs
``residual=0`` (a row kept unquantized must stay bit-identical, which a rotation round trip is not) and a
power-of-two head dim. On SmolLM2 (24 ~1k passkey prompts, full cache 22; docs/results.md) it takes 2 bits
at group 16 from 4 to 15 answers and ZipCache's 4 / 2 bits alone from 16 to 20; at 4 bits it changes
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NATIVE_BITS, PrecisionPolicy, check_bool, check_int
from ..registry import register_policy
from ._checks import check_bits, check_group, check_rotate


@register_policy("kivi", role="precision")
@dataclass(frozen=True)
class Kivi(PrecisionPolicy):
    """KIVI: kept tokens at `bits` (per-token groups), the last `residual` in the cache's dtype."""

    bits: int = 4
    group: int = 32
    residual: int = 128
    channel_scale: bool = False  # ZipCache's channel-separable keys (kvkernels.quant.key_channel_scale)
    rotate: bool = False  # rows stored Hadamard-rotated (kvkernels.quant.hadamard_rotation)

    def __post_init__(self) -> None:
        check_bits(self.name, "bits", self.bits)
        check_group(self.name, self.group)
        check_int(self.name, "residual", self.residual, 0)
        check_bool(self.name, "channel_scale", self.channel_scale)
        check_rotate(self.name, self.rotate, self.channel_scale,
                     f"residual={self.residual} (use residual=0)" if self.residual else None)

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None,
               voters: torch.Tensor | None = None) -> torch.Tensor:
        # The residual is the last `residual` tokens each KV head keeps (not the last positions, which an
        # eviction may have dropped), so every head holds the same number unquantized.
        from_end = kept.flip(-1).long().cumsum(-1).flip(-1)  # kept tokens at or after each position
        bits = torch.where(from_end <= self.residual, NATIVE_BITS, self.bits)
        return torch.where(kept, bits, 0).to(torch.int64)

    def held_unquantized(self) -> int:
        return self.residual + self.group if self.residual else 0

    def aging(self, n):
        """How many of a row's ``n`` newest tokens, waiting in the cache's dtype, are quantized now (an int,
        or per row of a numpy array / tensor): all but the newest ``residual`` once more than ``residual +
        group`` wait, else none, so tokens age a group or more at a time. Every cache that holds the residual
        (kvmodels' ``SideRegion``) asks this."""
        return (n > self.residual + self.group) * (n - self.residual)

    def group_size(self) -> int:
        return self.group

    def formats(self) -> tuple[int, ...]:
        return (self.bits, NATIVE_BITS) if self.residual else (self.bits,)
