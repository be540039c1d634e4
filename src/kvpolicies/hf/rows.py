"""Quantized rows in the transformers bridge: ``kivi``, every kept token in one packed format, or with KIVI's
residual (``residual > 0``) all but each sequence's newest ``residual`` to ``residual + group`` tokens, which
wait in the cache's dtype and age into the packed format a group or more at a time (``Kivi.aging``).

:class:`PackedRows` stores what ``kvmodels.cache.storage.PackedRows`` stores for the same policy and K/V:
the ``kvkernels.quant`` packed row (``codes | scale | zero``, ``QuantFormat.row_bytes`` bytes, float16
parameters), written by ``encode_rows`` (rotated first, in float32, with ``rotate=True``) and read by
``decode_rows`` (rotated back), the functions kvmodels' storage calls. ZipCache's channel-separable keys
(``channel_scale=True``) are the layer's: it stores ``k / c`` and multiplies ``c`` back on reads.
:func:`packed_rows` refuses, by name and with the fix, what the bridge cannot hold (two formats: KIVI's
ZipCache's and MiKV's two packed formats) and what kvmodels refuses (ALiBi, a format that does not fit the
head dim; with two parts Keyformer's per-slot noise, a reconstruction pass, head budgets). ``mikv(high=16)``
keeps its kept tokens in the cache's dtype and the ones its eviction drops packed at ``low`` bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvkernels.quant import QuantFormat, decode_rows, encode_rows, hadamard_rotation
from kvpolicies.base import NATIVE_BITS

#: Why a quantizing precision policy is refused, by name (else: its formats).
_TWO_FORMATS = {
    "zipcache": "stores salient tokens at {high} bits and the others at {low}",
    "mikv": "keeps the tokens it evicts at {low} bits beside the kept ones at high={high} bits",
}


@dataclasses.dataclass(frozen=True, eq=False)
class PackedRows:
    """One packed format for K and V (``fmt``), Hadamard-rotated rows (``rotation [D, D]``) or not; with
    ``precision`` (KIVI's residual, MiKV) a layer also holds tokens in the cache's dtype (KIVI's newest,
    ``precision.aging``; MiKV's kept ones, ``precision.demoted`` while decoding)."""

    fmt: QuantFormat
    head_dim: int
    rotation: torch.Tensor | None = None
    channel_scale: bool = False
    precision: Any = None  # the Kivi policy whose residual the layers hold, else None

    @property
    def width(self) -> int:
        """Bytes of one packed row."""
        return self.fmt.row_bytes(self.head_dim)

    def _rotation(self, device: torch.device) -> torch.Tensor | None:
        return None if self.rotation is None else self.rotation.to(device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[..., W]`` uint8 of ``x [..., D]`` (``encode_rows``, kvmodels' write)."""
        return encode_rows(x, self.fmt, self._rotation(x.device))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values ``[..., D]`` in ``dtype`` of packed rows ``[..., W]`` (``decode_rows``, kvmodels' read)."""
        return decode_rows(rows, self.head_dim, self.fmt, dtype, self._rotation(rows.device))

    def describe(self) -> str:
        how = ", Hadamard-rotated" if self.rotation is not None else ""
        how += ", channel-scaled keys" if self.channel_scale else ""
        text = f"{self.fmt.bits}-bit rows, group {self.fmt.group}{how} ({self.width} B per K or V row)"
        if self.precision is not None and self.precision.name == "mikv":
            text = f"the kept tokens in the cache's dtype, the evicted ones as {text}"
        elif self.precision is not None:
            r = self.precision.residual
            text += f", the newest {r} to {r + self.fmt.group} tokens in the cache's dtype"
        return text


def packed_rows(policy: Any, kind: str, head_dim: int) -> PackedRows | None:
    """The rows ``policy``'s precision role stores on a ``kind`` model of ``head_dim``: None for ``native``;
    ``ValueError`` naming the policy, why, and the fix for what the bridge does not hold."""
    prec = policy.precision
    if not prec.quantizes:
        return None
    name = f"policy {policy.name!r}: precision {prec.name!r} ({prec})"
    mikv = prec.name == "mikv" and prec.high == NATIVE_BITS  # the kept tokens as they came, the others packed
    if prec.name != "kivi" and not mikv:
        why = _TWO_FORMATS.get(prec.name, "stores tokens in formats {formats}").format_map(
            {**vars(prec), "formats": prec.formats()})
        raise ValueError(f"{name} {why}: two packed formats in one cache, which the transformers bridge "
                         "does not hold (one packed format, beside tokens in the cache's dtype or not); use "
                         "kivi(bits=..., group=...) or mikv(high=16), or run it on kvmodels "
                         "(kvmodels.decoder.Decoder)")
    two_parts = mikv or prec.residual
    if two_parts:
        ev = policy.eviction
        refuse = (f"eviction policy {ev.name!r} scores with Gumbel noise drawn per slot of one part"
                  if ev.decode_evict and ev.score_mode == "gumbel" else
                  f"eviction policy {ev.name!r} ranks the context by a reconstruction pass" if ev.probe else
                  f"head-budget policy {policy.heads.name!r} gives each KV head its own budget"
                  if policy.heads.per_head else None)
        if refuse:
            what = ("keeps what its eviction drops at low bits beside the kept tokens" if mikv else
                    f"keeps each sequence's newest {prec.residual} tokens unquantized beside the packed ones")
            fix = "kivi(bits=...)" if mikv else "kivi(..., residual=0)"
            raise ValueError(f"{name} {what}, and {refuse}, which the bridge does not combine with two "
                             f"parts, as kvmodels does not; use {fix}")
    if kind == "mpt":  # as kvmodels' attend refuses it
        raise ValueError(f"{name} on an ALiBi model (MPT): ALiBi reads each slot's position beside its "
                         "K/V, which kvmodels' quantized decode kernel does not; use a RoPE model (Llama, "
                         "GPT-J) or native precision")
    fmt = QuantFormat(prec.low if mikv else prec.bits, prec.group_size())
    try:
        fmt.check(head_dim)
        rotation = hadamard_rotation(head_dim) if prec.rotate else None
    except ValueError as e:  # a group that does not divide the head dim, a rotation of a non-power of two
        fix = "; use rotate=False" if prec.rotate and "Hadamard" in str(e) else ""
        raise ValueError(f"{name} does not fit this model: {e}{fix}") from None
    return PackedRows(fmt, head_dim, rotation, prec.channel_scale, prec if two_parts else None)
