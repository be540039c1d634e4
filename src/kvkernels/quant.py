"""Token-wise asymmetric quantization of K/V rows, packed into ``uint8`` (issue 36's storage format).

Each row (one token of one head, ``D`` channels) is cut into groups of ``group`` channels; a group stores
a zero point ``z`` (its minimum, rounded *down* to the parameter dtype) and a scale ``s`` (its range over
``2**bits - 1``, rounded *up*), and each channel the code ``q = round((x - z) / s)`` in ``[0, 2**bits)``.
Rounding the parameters outward keeps every value inside the representable range, so the round trip
``q * s + z`` is off by at most ``s / 2`` (plus float32 arithmetic), whatever the parameter dtype.

Every row carries its own parameters -- nothing is shared across tokens -- so a quantized slot can be
evicted, moved by ``topk_compact`` / ``topk_evict`` or dropped without touching its neighbours. That is
why this is token-wise for keys too, as ZipCache's "channel-separable tokenwise" scheme (keys divided by a
per-channel factor ``c`` first, which the attention folds into the query: ``q . k = (q * c) . (k / c)``),
not KIVI's per-channel groups across tokens, which an eviction inside a group would break.

Packing is *planar*: with ``k = 8 // bits`` codes per byte, byte ``j`` of a row holds channels ``j``,
``j + D/k``, ..., ``j + (k-1) D/k``, code ``i`` in bits ``[i * bits, (i + 1) * bits)``. Unpacking part ``i``
(``(byte >> i * bits) & mask``) yields the contiguous channel slice ``[i D/k, (i+1) D/k)``, so a kernel
splits the query the same way and never interleaves registers.

:func:`quantize_ref` / :func:`dequantize_ref` loop per group and per channel, written for clarity; the
vectorised :func:`quantize` / :func:`dequantize` must equal them bit for bit.

**Packed rows** (what a cache page holds): :func:`pack` lays one quantized row out as one run of bytes,
``codes | scale | zero`` (``D * bits / 8`` code bytes, then the ``D / group`` scales and zero points in the
parameter dtype), :meth:`QuantFormat.row_bytes` wide. A pool of such rows is a plain ``uint8`` tensor
``[P, S, Hkv, W]`` that eviction moves like any other K/V rows; :func:`quantize_rows` (quantize + pack, a
custom op so that ``torch.compile`` keeps the outward rounding of the parameters, which inductor's
fusion would otherwise elide) writes it and :func:`dequantize_rows` reads it.

**Channel-separable keys** (ZipCache): :func:`key_channel_scale` gives a factor per channel from a prompt's
keys; the cache stores ``k / c`` (token-wise quantized) and attends with ``q * c``, so
``(q * c) . (k / c) = q . k`` while one token's group no longer spends its levels on a few large channels.
The factor is ``sqrt(max |k|)`` per channel, as in ZipCache, rounded to a power of two: dividing and
multiplying by it is exact in floating point, so rows stored unquantized come back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from kvkernels._checks import FLOAT_DTYPES, check_choice, check_tensor

BITS = (2, 4, 8)
PARAM_DTYPES = (torch.float16, torch.float32)


class Quantized(NamedTuple):
    """Packed rows: ``codes [..., D * bits / 8]`` uint8, ``scale`` and ``zero`` ``[..., D / group]``."""

    codes: Tensor
    scale: Tensor
    zero: Tensor


def check_format(head_dim: int, bits: int, group: int) -> None:
    """``bits`` in :data:`BITS`; ``group`` divides ``head_dim``; the planar packing needs ``8 // bits``
    equal channel slices."""
    check_choice("bits", bits, BITS)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or head_dim % group:
        raise ValueError(f"group={group!r} must be a positive divisor of the head dim {head_dim} (channels "
                         "per scale / zero point)")
    per_byte = 8 // bits
    if head_dim % per_byte:
        raise ValueError(f"bits={bits} packs {per_byte} channels per byte, which needs a head dim divisible "
                         f"by {per_byte}, got {head_dim}; use more bits")


@dataclass(frozen=True)
class QuantFormat:
    """How rows are quantized: ``bits`` per code (2, 4 or 8), ``group`` channels per scale and zero point (a
    divisor of the head dim), and the parameters' dtype (float16 or float32)."""

    bits: int = 4
    group: int = 32
    param_dtype: torch.dtype = torch.float16

    def check(self, head_dim: int) -> None:
        """:func:`check_format`, the parameter dtype, and the packed row's alignment (its parameters start
        on a multiple of their size)."""
        check_format(head_dim, self.bits, self.group)
        check_choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        size = torch.empty(0, dtype=self.param_dtype).element_size()
        if (head_dim * self.bits // 8) % size:
            raise ValueError(f"a packed row of head dim {head_dim} at bits={self.bits} has "
                             f"{head_dim * self.bits // 8} code bytes, not a multiple of the {size}-byte "
                             "parameters that follow them; use float16 parameters or more bits")

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one packed row (:func:`bytes_per_row`)."""
        return bytes_per_row(head_dim, self.bits, self.group, self.param_dtype)

    def code_bytes(self, head_dim: int) -> int:
        return head_dim * self.bits // 8


def bytes_per_row(head_dim: int, bits: int, group: int, param_dtype: torch.dtype = torch.float16) -> int:
    """Bytes one quantized row occupies: its codes plus a scale and a zero point per group."""
    check_format(head_dim, bits, group)
    return head_dim * bits // 8 + 2 * (head_dim // group) * torch.empty(0, dtype=param_dtype).element_size()


def _outward(lo: Tensor, hi: Tensor, levels: int, param_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Zero point ``lo`` rounded down and scale ``(hi - zero) / levels`` rounded up to ``param_dtype``
    (float32 in, ``param_dtype`` out), so ``[zero, zero + levels * scale]`` covers ``[lo, hi]``."""
    zero = lo.to(param_dtype)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -float("inf"))), zero)
    scale = ((hi - zero.float()) / levels).to(param_dtype)
    for _ in range(3):  # up an ulp while the top code (in dequantize's float32 arithmetic) falls short
        short = zero.float() + levels * scale.float() < hi
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return scale, zero


def _check_input(x: Tensor, bits: int, group: int, param_dtype: torch.dtype) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have a channel dimension (the last), got a scalar")
    check_format(x.shape[-1], bits, group)
    check_choice("param_dtype", param_dtype, PARAM_DTYPES)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x holds NaN or inf; quantization needs finite values")


def quantize(x: Tensor, bits: int = 4, group: int = 32,
             param_dtype: torch.dtype = torch.float16) -> Quantized:
    """Quantize the rows of ``x [..., D]`` (float32 / float16 / bfloat16); see the module docstring."""
    _check_input(x, bits, group, param_dtype)
    return _quantize_fast(x, bits, group, param_dtype)


def dequantize(qx: Quantized, bits: int = 4, group: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows ``[..., D]`` in ``dtype`` from :func:`quantize`'s output (computed in float32)."""
    codes, scale, zero = qx
    check_tensor("codes", codes, dtypes=(torch.uint8,))
    per_byte = 8 // bits
    D = codes.shape[-1] * per_byte
    check_format(D, bits, group)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    q = ((codes[..., None, :] >> shifts[:, None]) & (2**bits - 1)).flatten(-2)  # [..., D] in channel order
    g = q.float().unflatten(-1, (D // group, group))
    return (g * scale.float()[..., None] + zero.float()[..., None]).flatten(-2).to(dtype)


def quantize_ref(x: Tensor, bits: int = 4, group: int = 32,
                 param_dtype: torch.dtype = torch.float16) -> Quantized:
    """Reference of :func:`quantize`: one row, one group and one channel at a time."""
    _check_input(x, bits, group, param_dtype)
    D, levels, per_byte = x.shape[-1], 2**bits - 1, 8 // bits
    rows = x.float().reshape(-1, D)
    codes = torch.zeros(rows.shape[0], D // per_byte, dtype=torch.uint8)
    scale = torch.zeros(rows.shape[0], D // group, dtype=param_dtype)
    zero = torch.zeros_like(scale)
    for r, row in enumerate(rows):
        for gi in range(D // group):
            values = row[gi * group:(gi + 1) * group]
            s, z = _outward(values.min(), values.max(), levels, param_dtype)
            scale[r, gi], zero[r, gi] = s, z
            for c in range(gi * group, (gi + 1) * group):
                code = 0 if s == 0 else int(torch.round((row[c] - z.float()) / s.float()).clamp(0, levels))
                part, byte = divmod(c, D // per_byte)
                codes[r, byte] |= code << (part * bits)
    lead = x.shape[:-1]
    return Quantized(codes.reshape(*lead, D // per_byte), scale.reshape(*lead, D // group),
                     zero.reshape(*lead, D // group))


def dequantize_ref(qx: Quantized, bits: int = 4, group: int = 32,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """Reference of :func:`dequantize`: one channel at a time."""
    codes, scale, zero = (t.reshape(t[..., 0].numel(), t.shape[-1]) for t in qx)
    per_byte = 8 // bits
    D = codes.shape[-1] * per_byte
    out = torch.zeros(codes.shape[0], D)
    for r in range(codes.shape[0]):
        for c in range(D):
            part, byte = divmod(c, D // per_byte)
            code = (int(codes[r, byte]) >> (part * bits)) & (2**bits - 1)
            out[r, c] = code * scale[r, c // group].float() + zero[r, c // group].float()
    return out.reshape(*qx.codes.shape[:-1], D).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Packed rows: codes | scale | zero as one run of bytes
# ----------------------------------------------------------------------------------------------------

def pack(qx: Quantized) -> Tensor:
    """One ``uint8`` row ``[..., W]`` per quantized row: its codes, then its scales' and zero points'
    bytes."""
    codes, scale, zero = qx
    as_bytes = [t.contiguous().view(torch.uint8) for t in (scale, zero)]
    return torch.cat([codes, *as_bytes], dim=-1)


def unpack(rows: Tensor, head_dim: int, fmt: QuantFormat) -> Quantized:
    """The :class:`Quantized` parts of packed rows ``[..., W]`` (copies)."""
    c = fmt.code_bytes(head_dim)
    p = (rows.shape[-1] - c) // 2
    codes, scale, zero = rows[..., :c], rows[..., c:c + p], rows[..., c + p:]
    return Quantized(codes.contiguous(), scale.contiguous().view(fmt.param_dtype),
                     zero.contiguous().view(fmt.param_dtype))


def _quantize_fast(x: Tensor, bits: int, group: int, param_dtype: torch.dtype) -> Quantized:
    """:func:`quantize` without its checks (no host sync)."""
    D, levels, per_byte = x.shape[-1], 2**bits - 1, 8 // bits
    g = x.float().unflatten(-1, (D // group, group))  # [..., D/G, G]
    scale, zero = _outward(g.amin(-1), g.amax(-1), levels, param_dtype)  # [..., D/G] each
    safe = torch.where(scale > 0, scale.float(), 1.0)[..., None]  # a constant group: every code 0
    q = torch.round((g - zero.float()[..., None]) / safe).clamp_(0, levels).to(torch.uint8).flatten(-2)
    parts = q.unflatten(-1, (per_byte, D // per_byte))  # [..., k, D/k]: part i = channels [i D/k, (i+1) D/k)
    shifts = torch.arange(per_byte, device=x.device, dtype=torch.uint8) * bits
    codes = (parts << shifts[:, None]).sum(-2, dtype=torch.uint8)  # disjoint bit fields: sum == or
    return Quantized(codes, scale, zero)


_PARAM_NAMES = {torch.float16: "float16", torch.float32: "float32"}


@torch.library.custom_op("kvkernels::quantize_rows", mutates_args=())
def _quantize_rows_op(x: Tensor, bits: int, group: int, param_dtype: str) -> Tensor:
    return pack(_quantize_fast(x, bits, group, getattr(torch, param_dtype)))


@_quantize_rows_op.register_fake
def _(x, bits, group, param_dtype):
    fmt = QuantFormat(bits, group, getattr(torch, param_dtype))
    return x.new_empty((*x.shape[:-1], fmt.row_bytes(x.shape[-1])), dtype=torch.uint8)


def quantize_rows(x: Tensor, fmt: QuantFormat, *, validate: bool = True) -> Tensor:
    """Packed rows ``[..., W]`` uint8 of ``x [..., D]`` (:func:`quantize` then :func:`pack`).

    ``validate=False`` skips the finiteness check (a host sync): a compiled decode step writes through it.
    One custom op, so ``torch.compile`` runs it as written (its outward rounding of the parameters is kept).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have a channel dimension (the last), got a scalar")
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"fmt must be a kvkernels.quant.QuantFormat, got {type(fmt).__name__}")
    fmt.check(x.shape[-1])
    if validate and not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
        raise ValueError("x holds NaN or inf; quantization needs finite values")
    return torch.ops.kvkernels.quantize_rows(x, fmt.bits, fmt.group, _PARAM_NAMES[fmt.param_dtype])


def dequantize_rows(rows: Tensor, head_dim: int, fmt: QuantFormat,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """Values ``[..., head_dim]`` in ``dtype`` of packed rows ``[..., W]`` (:func:`quantize_rows`)."""
    check_tensor("rows", rows, dtypes=(torch.uint8,))
    fmt.check(head_dim)
    if rows.shape[-1] != fmt.row_bytes(head_dim):
        raise ValueError(f"rows are {rows.shape[-1]} bytes wide but {fmt} packs a row of head dim {head_dim} "
                         f"in {fmt.row_bytes(head_dim)}")
    return dequantize(unpack(rows, head_dim, fmt), fmt.bits, fmt.group, dtype)


def key_channel_scale(k: Tensor) -> Tensor:
    """ZipCache's channel-separable factor of a prompt's keys ``k [L, H, D]``: ``c [H, D]`` float32, per head
    and channel ``sqrt(max_i |k[i, h, d]|)`` rounded to the nearest power of two (in the log domain); 1 for
    a channel that is all zeros. A power of two, so ``k / c * c == k`` exactly (no overflow: ``|k / c|`` is
    at most about ``sqrt(max |k|)``)."""
    if k.dim() != 3 or k.shape[0] == 0:
        raise ValueError(f"k must be [L, H, D] keys with L >= 1, got shape {tuple(k.shape)}")
    amax = k.detach().abs().amax(dim=0).float()  # [H, D]
    exp = torch.round(0.5 * torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny)))
    return torch.where(amax > 0, torch.exp2(exp.clamp(-60.0, 60.0)), 1.0)
