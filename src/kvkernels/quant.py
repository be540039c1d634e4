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
fusion would otherwise elide) writes it and :func:`dequantize_rows` reads it. On CUDA the op is one Triton
launch (:func:`quantize_rows_triton`, float16 parameters and power-of-two head dims; the torch path's ~20
kernels otherwise), equal to the torch path bit for bit.

**Channel-separable keys** (ZipCache): :func:`key_channel_scale` gives a factor per channel from a prompt's
keys; the cache stores ``k / c`` (token-wise quantized) and attends with ``q * c``, so
``(q * c) . (k / c) = q . k`` while one token's group no longer spends its levels on a few large channels.
The factor is ``sqrt(max |k|)`` per channel, as in ZipCache, rounded to a power of two: dividing and
multiplying by it is exact in floating point, so rows stored unquantized come back bit for bit.

**Rotated rows** (RotateKV, QuaRot): :func:`hadamard_rotation` gives a fixed orthogonal ``R`` (a randomized
Hadamard matrix); a cache stores ``quantize_rows(x R)``, attends with ``q R`` and rotates the output back by
``R^T`` (:func:`rotate`). A large channel is spread over every channel of the row, and each row still carries
its own parameters. The kernels are unchanged: the rotation is two ``[D, D]`` products outside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from kvkernels._checks import FLOAT_DTYPES, check_choice, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, tl, triton, use_triton

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
    # +0 for -0: which zero a min or max returns is the implementation's choice (the Triton write's too).
    return scale.masked_fill(scale == 0, 0.0), zero.masked_fill(zero == 0, 0.0)


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
    fmt = QuantFormat(bits, group, getattr(torch, param_dtype))
    if use_triton(x) and triton_quantizes(x.shape[-1], fmt):
        return quantize_rows_triton(x, fmt)
    return pack(_quantize_fast(x, bits, group, fmt.param_dtype))


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


# ----------------------------------------------------------------------------------------------------
# Triton: quantize and pack rows in one launch (what a decode step's cache write runs on CUDA)
# ----------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _round_half_even(v):
        """``torch.round`` (half to even) from ``floor``: ``v - floor(v)`` is exact below ``2**23``."""
        f = tl.floor(v)
        r = v - f
        odd = (f - 2.0 * tl.floor(0.5 * f)) == 1.0
        return tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def _fp16_step(h, UP: tl.constexpr):
        """``torch.nextafter(h, +inf if UP else -inf)`` for float16 ``h`` (not NaN), on its bits."""
        bits = h.to(tl.int16, bitcast=True)
        mag = bits & 0x7FFF
        if UP:  # h >= 0 here (a scale): +0 -> the smallest subnormal, inf stays
            out = tl.where(mag == 0x7C00, bits, tl.where(mag == 0, 1, bits + 1).to(tl.int16))
        else:  # toward -inf: +-0 -> -smallest subnormal; positives shrink, negatives grow; -inf stays
            down = tl.where(bits > 0, bits - 1, bits + 1).to(tl.int16)
            out = tl.where(mag == 0, -32767, tl.where(bits == -1024, bits, down)).to(tl.int16)
        return out.to(tl.float16, bitcast=True)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, n_rows, D: tl.constexpr, GROUP: tl.constexpr,
                              BITS: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows ``[pid * BLOCK_R, ...)`` of ``x [n_rows, D]`` to packed rows ``codes | scale | zero`` with
        float16 parameters, bit for bit :func:`_quantize_fast` + :func:`pack`: IEEE division (``div_rn``;
        Triton's ``/`` is approximate on the GPU), half-to-even rounding, and outward rounding of the
        parameters on their bits. ``levels * scale`` is exact in float32 (8 x 11 significant bits), so a
        fused multiply-add of ``zero + levels * scale`` cannot change the comparison it feeds."""
        LEVELS: tl.constexpr = (1 << BITS) - 1
        PER_BYTE: tl.constexpr = 8 // BITS
        CODES: tl.constexpr = D // PER_BYTE
        NG: tl.constexpr = D // GROUP
        WIDTH: tl.constexpr = CODES + 4 * NG
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n_rows
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
        g = tl.reshape(x.to(tl.float32), (BLOCK_R, NG, GROUP))
        lo, hi = tl.min(g, axis=2), tl.max(g, axis=2)  # [BLOCK_R, NG]
        zero = lo.to(tl.float16)
        zero = tl.where(zero.to(tl.float32) > lo, _fp16_step(zero, False), zero)
        zf = zero.to(tl.float32)
        scale = tl.math.div_rn(hi - zf, tl.full(hi.shape, LEVELS, tl.float32)).to(tl.float16)
        for _ in tl.static_range(3):  # up an ulp while the top code falls short of the maximum
            short = zf + LEVELS * scale.to(tl.float32) < hi
            scale = tl.where(short, _fp16_step(scale, True), scale)
        scale = tl.where(scale == 0, 0.0, scale).to(tl.float16)  # +0 for -0, as _outward
        zero = tl.where(zero == 0, 0.0, zero).to(tl.float16)
        sf = scale.to(tl.float32)
        safe = tl.where(sf > 0, sf, 1.0)
        v = tl.math.div_rn(g - zf[:, :, None], tl.broadcast_to(safe[:, :, None], (BLOCK_R, NG, GROUP)))
        code = tl.minimum(tl.maximum(_round_half_even(v), 0.0), LEVELS).to(tl.int32)
        # Planar packing: channel i * CODES + j is part i of byte j.
        parts = tl.reshape(code, (BLOCK_R, PER_BYTE, CODES))
        shift = (tl.arange(0, PER_BYTE) * BITS)[None, :, None]
        byte = tl.sum(parts << shift, axis=1).to(tl.uint8)  # disjoint bit fields: sum == or
        base = out_ptr + rows64 * WIDTH
        tl.store(base[:, None] + tl.arange(0, CODES)[None, :], byte, mask=ok[:, None])
        params = (base + CODES).to(tl.pointer_type(tl.float16))[:, None] + tl.arange(0, NG)[None, :]
        tl.store(params, scale, mask=ok[:, None])
        tl.store(params + NG, zero, mask=ok[:, None])


def triton_quantizes(head_dim: int, fmt: QuantFormat) -> bool:
    """Whether :func:`quantize_rows_triton` takes this format: float16 parameters (the exactness argument
    of its kernel) and a power-of-two head dim (its tiles); other formats run the torch path."""
    return fmt.param_dtype == torch.float16 and head_dim & (head_dim - 1) == 0


def quantize_rows_triton(x: Tensor, fmt: QuantFormat) -> Tensor:
    """Triton launcher of :func:`quantize_rows` (no input checks): one launch for every row of ``x [..., D]``
    (:func:`triton_quantizes` formats), equal bit for bit to the torch path."""
    require_triton()
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], fmt.row_bytes(D), dtype=torch.uint8, device=x.device)
    n = rows.shape[0]
    if n == 0:
        return out
    block_r = max(1, min(64, 4096 // D))  # a 4096-value tile
    launch(_quantize_rows_kernel, (triton.cdiv(n, block_r),), rows, out, n, D=D, GROUP=fmt.group,
           BITS=fmt.bits, BLOCK_R=block_r, num_warps=4)
    return out


def dequantize_rows(rows: Tensor, head_dim: int, fmt: QuantFormat,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """Values ``[..., head_dim]`` in ``dtype`` of packed rows ``[..., W]`` (:func:`quantize_rows`)."""
    check_tensor("rows", rows, dtypes=(torch.uint8,))
    fmt.check(head_dim)
    if rows.shape[-1] != fmt.row_bytes(head_dim):
        raise ValueError(f"rows are {rows.shape[-1]} bytes wide but {fmt} packs a row of head dim {head_dim} "
                         f"in {fmt.row_bytes(head_dim)}")
    return dequantize(unpack(rows, head_dim, fmt), fmt.bits, fmt.group, dtype)


def encode_rows(x: Tensor, fmt: QuantFormat, rotation: Tensor | None = None) -> Tensor:
    """Packed rows ``[..., W]`` of ``x [..., D]`` as a cache stores them: with ``rotation``
    (:func:`hadamard_rotation`) rotated first, in float32 (no rounding to ``x``'s dtype before the quantizer);
    no finiteness check (it reads the device, and a compiled decode step writes through here)."""
    if rotation is not None:
        x = x.float() @ rotation
    return quantize_rows(x, fmt, validate=False)


def decode_rows(rows: Tensor, head_dim: int, fmt: QuantFormat, dtype: torch.dtype,
                rotation: Tensor | None = None) -> Tensor:
    """What a cache reads of rows :func:`encode_rows` wrote: values ``[..., head_dim]`` in ``dtype``, rotated
    back (in float32) with ``rotation``."""
    if rotation is None:
        return dequantize_rows(rows, head_dim, fmt, dtype)
    return (dequantize_rows(rows, head_dim, fmt) @ rotation.t()).to(dtype)


def hadamard_rotation(head_dim: int, device: torch.device | str | None = None) -> Tensor:
    """The randomized Hadamard rotation ``R [D, D]`` float32 that rotated rows are stored in (QuaRot's and
    RotateKV's fix for outlier channels): ``R = diag(s) H / sqrt(D)``, ``H`` Sylvester's Hadamard matrix and
    ``s`` a fixed pattern of signs (seed 0, the same on every device). ``R`` is orthogonal (``R R^T = I``), so
    a cache that stores ``k R`` and ``v R`` attends with ``q R`` and rotates the output back by ``R^T``:
    ``(q R) . (k R) = q . k`` and ``sum p (v R) R^T = sum p v``. A channel far larger than the others is
    spread over all ``D`` channels, so a token's quantization group no longer spends its levels on it.
    ``head_dim`` must be a power of two (Sylvester's construction)."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1 \
            or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {head_dim!r}")
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:  # [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return (signs[:, None].float() * h / math.sqrt(head_dim)).to(device)


def rotate(x: Tensor, rotation: Tensor, *, back: bool = False) -> Tensor:
    """``x [..., D]`` times ``rotation`` (or its transpose with ``back``), computed in float32 and returned in
    ``x``'s dtype."""
    r = rotation.t() if back else rotation
    return (x.float() @ r).to(x.dtype)


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


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

COMPILE_AXES: dict[str, tuple] = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "bits": (2, 4, 8),
    "head_dim": (64, 128, 8),
    "group": (32, 16, 8),
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: :func:`quantize_rows_triton` on ``meta`` rows, one per configuration of
    :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "quantize_rows " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: quantize_rows_triton(
            torch.empty(5, 3, cfg["head_dim"], dtype=cfg["dtype"], device="meta"),
            QuantFormat(cfg["bits"], min(cfg["group"], cfg["head_dim"]))))
