"""MiKV (Yang et al., 2024, "No Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed
Precision Quantization").

The tokens the eviction policy keeps are stored at ``high`` bits (16: unquantized, the cache's dtype), and
the tokens it would evict are **kept** at ``low`` bits instead of dropped, so nothing the model may need again
is lost, at a fraction of its bytes. ``compose("h2o", "mikv", budget=0.2)``: a fifth of the tokens in full
precision, the rest at 2 bits. ``channel_scale=True``: ZipCache's channel-separable keys (see ``kivi``).
``rotate=True`` (with ``high`` 4 or 8): rows stored Hadamard-rotated (see ``kivi``). With an eviction policy
that evicts while decoding (``compose("h2o", "mikv", budget=0.2)``), each token it evicts moves to the low
bits instead (``kvmodels.cache.tiers.SideRegion.demote``); nothing leaves the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NATIVE_BITS, PrecisionPolicy, check_bool
from ..registry import register_policy
from ._checks import check_bits, check_group, check_rotate


@register_policy("mikv", role="precision")
@dataclass(frozen=True)
class MiKV(PrecisionPolicy):
    """MiKV: kept tokens at `high` bits (16 = the cache's dtype), the evicted ones kept at `low` bits."""

    high: int = NATIVE_BITS
    low: int = 2
    group: int = 32
    channel_scale: bool = False  # ZipCache's channel-separable keys (kvkernels.quant.key_channel_scale)
    rotate: bool = False  # rows stored Hadamard-rotated (kvkernels.quant.hadamard_rotation)

    keeps_evicted = True  # while decoding too: an evicting policy's victims move to the low bits

    def __post_init__(self) -> None:
        check_bits(self.name, "high", self.high, native=True)
        check_bits(self.name, "low", self.low)
        if self.low >= self.high:
            raise ValueError(f"{self.name}: low={self.low} must be below high={self.high} (bits of the "
                             "evicted and the kept tokens)")
        check_group(self.name, self.group)
        check_bool(self.name, "channel_scale", self.channel_scale)
        check_rotate(self.name, self.rotate, self.channel_scale,
                     f"high={self.high} (use high=8 or 4)" if self.high == NATIVE_BITS else None)

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None,
               voters: torch.Tensor | None = None) -> torch.Tensor:
        return torch.where(kept, self.high, self.low).to(torch.int64)

    def demoted(self, rank: torch.Tensor, keep: int, n_sink: int, n_recent: int) -> torch.Tensor:
        """While decoding: which of a row's ``total`` kept tokens (``rank [total, Hkv]``, the eviction's
        ranking in position order) move to the low bits so that ``keep`` stay: ``[total - keep, Hkv]`` slot
        indices, ascending, each KV head's lowest-ranked, the first ``n_sink`` and last ``n_recent`` excepted,
        ties to the older. Every cache that holds MiKV's low bits (kvmodels' ``SideRegion.demote``) asks
        this."""
        total = rank.shape[0]
        slot = torch.arange(total, device=rank.device)
        forced = (slot < n_sink) | (slot >= total - n_recent)
        rank = rank.masked_fill(forced[:, None], float("inf"))
        return torch.sort(rank, dim=0, stable=True).indices[:total - keep].sort(dim=0).values

    def group_size(self) -> int:
        return self.group

    def formats(self) -> tuple[int, ...]:
        return (self.low, self.high)
