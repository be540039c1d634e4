"""Paged decode attention over quantized K/V pages (issue 36): the kernel dequantizes in registers.

The pool holds each (slot, KV head) as :mod:`kvkernels.quant` rows: ``codes [P, S, Hkv, D * bits / 8]``
uint8 (planar packing) with a ``scale`` and a ``zero`` point per group of channels ``[P, S, Hkv, D / group]``
(float16 or float32). K and V may use different formats (:class:`QuantFormat`). Each query head ``h`` reads
KV head ``h // (Hq / Hkv)`` (GQA); slot ``j < seq_lens[b]`` of sequence ``b`` lives in page
``page_table[b, j // S]`` at offset ``j % S``. The result equals :func:`paged_decode_attention_ref` on the
dequantized pool (:func:`quant_decode_attention_ref` does exactly that) up to float32 summation order.

Three implementations, as everywhere in kvkernels: the reference (dequantize everything, then the plain
reference), a batched torch path (CPU tensors), and the Triton kernel (CUDA tensors, or the interpreter in
tests). The kernel reads each packed byte once per channel it holds (``8 / bits`` loads of the same byte,
served from cache): DRAM traffic is the packed bytes plus the parameters. No split-K and no fused score
update yet: decode-time eviction policies (H2O's accumulated attention) do not run on quantized pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvkernels._checks import check_page_table, check_seq_lens, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, use_triton
from kvkernels.paged_attention import paged_decode_attention_ref
from kvkernels.quant import PARAM_DTYPES, Quantized, check_format, dequantize

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dequant_tile(codes_ptr, scale_ptr, zero_ptr, row, ok, offs_d,
                      D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
        """``[BLOCK_N, BLOCK_D]`` float32 values of the rows ``row`` (index into ``[P, S, Hkv]``): channel
        ``c`` is code ``(byte[c % (D/k)] >> (c // (D/k)) * BITS) & mask`` times its group's scale plus its
        zero point, ``k = 8 // BITS`` codes per byte (planar packing)."""
        PER_BYTE: tl.constexpr = 8 // BITS
        WIDTH: tl.constexpr = D // PER_BYTE  # bytes per row
        N_GROUPS: tl.constexpr = D // GROUP
        byte = tl.load(codes_ptr + row[:, None] * WIDTH + (offs_d % WIDTH)[None, :], mask=ok, other=0)
        shift = ((offs_d // WIDTH) * BITS).to(tl.int32)
        code = (byte.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)
        param = row[:, None] * N_GROUPS + (offs_d // GROUP)[None, :]
        s = tl.load(scale_ptr + param, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + param, mask=ok, other=0.0).to(tl.float32)
        return code.to(tl.float32) * s + z

    @triton.jit
    def _quant_decode_kernel(
        q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, page_table_ptr, seq_lens_ptr, out_ptr,
        scale, max_pages,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (sequence, KV head): online softmax over the sequence's slots, the group's query
        heads together (one ``tl.dot`` per tile), K and V dequantized tile by tile."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < G  # BLOCK_G >= 16 pads small groups so tl.dot has a legal shape
        d_ok = offs_d < D
        q_rows = (b * HKV + kvh) * G + offs_g
        q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        seq_len = tl.load(seq_lens_ptr + b)
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(0, seq_len, BLOCK_N):
            slots = n0 + offs_n
            in_seq = slots < seq_len
            page = tl.load(page_table_ptr + b * max_pages + slots // S, mask=in_seq, other=0).to(tl.int64)
            row = (page * S + slots % S) * HKV + kvh  # [BLOCK_N] into [P, S, Hkv]
            ok = in_seq[:, None] & d_ok[None, :]
            k = _dequant_tile(kc_ptr, ks_ptr, kz_ptr, row, ok, offs_d, D, K_BITS, K_GROUP)  # [N, D]
            x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            x = tl.where(in_seq[None, :], x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(x - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _dequant_tile(vc_ptr, vs_ptr, vz_ptr, row, ok, offs_d, D, V_BITS, V_GROUP)  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # 0 for an empty sequence
        tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :],
                 (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class QuantFormat:
    """How a pool's rows are quantized: ``bits`` per code (2, 4 or 8) and ``group`` channels per scale and
    zero point (a divisor of the head dim)."""

    bits: int = 4
    group: int = 32


def quant_decode_attention_ref(q: Tensor, k: Quantized, v: Quantized, page_table: Tensor, seq_lens: Tensor,
                               *, scale: float, k_format: QuantFormat, v_format: QuantFormat) -> Tensor:
    """Reference: dequantize the whole pool, then :func:`paged_decode_attention_ref` (float32 math)."""
    kd = dequantize(k, k_format.bits, k_format.group, torch.float32)
    vd = dequantize(v, v_format.bits, v_format.group, torch.float32)
    return paged_decode_attention_ref(q.float(), kd, vd, page_table, seq_lens, scale=scale).to(q.dtype)


def quant_decode_attention_torch(q: Tensor, k: Quantized, v: Quantized, page_table: Tensor, seq_lens: Tensor,
                                 *, scale: float, k_format: QuantFormat, v_format: QuantFormat) -> Tensor:
    """Batched torch path (no input checks, no host sync): gathers and dequantizes only the slots the
    table's columns cover, then one masked softmax per (sequence, query head)."""
    batch, n_q, d = q.shape
    page_size, n_kv = k.codes.shape[1], k.codes.shape[2]
    width = page_table.shape[1] * page_size
    j = torch.arange(width, device=q.device)
    pages = page_table.long().clamp_min(0)[:, j // page_size]  # [B, W]; unused entries read page 0
    offs = j % page_size

    def gather(x: Quantized, fmt: QuantFormat) -> Tensor:  # -> [B, W, Hkv, D] float32
        rows = Quantized(*(t[pages, offs] for t in x))
        return dequantize(rows, fmt.bits, fmt.group, torch.float32)

    kd, vd = gather(k, k_format), gather(v, v_format)
    group = n_q // n_kv
    qg = q.float().view(batch, n_kv, group, d)
    x = torch.einsum("bhgd,bwhd->bhgw", qg, kd) * scale  # [B, Hkv, G, W]
    visible = (j[None, :] < seq_lens.long()[:, None])[:, None, None, :]
    p = torch.softmax(x.masked_fill(~visible, float("-inf")), dim=-1)
    p = torch.where(visible, p, torch.zeros_like(p))  # an empty sequence: zeros, not NaN
    out = torch.einsum("bhgw,bwhd->bhgd", p, vd)
    return out.reshape(batch, n_q, d).to(q.dtype)


def quant_decode_attention_triton(q: Tensor, k: Quantized, v: Quantized, page_table: Tensor,
                                  seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                  v_format: QuantFormat) -> Tensor:
    """Triton launcher (no input checks): one program per (sequence, KV head)."""
    require_triton()
    batch, n_q, d = q.shape
    page_size, n_kv = k.codes.shape[1], k.codes.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = n_q // n_kv
    q = q.contiguous()
    launch(
        _quant_decode_kernel, (batch, n_kv),
        q, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, page_table, seq_lens, out,
        float(scale), page_table.shape[1],
        HKV=n_kv, G=group, D=d, S=page_size, K_BITS=k_format.bits, K_GROUP=k_format.group,
        V_BITS=v_format.bits, V_GROUP=v_format.group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d), BLOCK_N=32,
        num_warps=4,
    )
    return out


@torch.library.custom_op("kvkernels::quant_decode_attention", mutates_args=())
def _quant_decode_op(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                     v_scale: Tensor, v_zero: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
                     k_bits: int, k_group: int, v_bits: int, v_group: int) -> Tensor:
    impl = quant_decode_attention_triton if use_triton(q) else quant_decode_attention_torch
    return impl(q, Quantized(k_codes, k_scale, k_zero), Quantized(v_codes, v_scale, v_zero), page_table,
                seq_lens, scale=scale, k_format=QuantFormat(k_bits, k_group),
                v_format=QuantFormat(v_bits, v_group))


@_quant_decode_op.register_fake
def _(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, page_table, seq_lens, scale, k_bits, k_group,
      v_bits, v_group):
    return torch.empty_like(q)


def _check_pool(name: str, x: Quantized, fmt: QuantFormat, head_dim: int, slots: tuple[int, ...],
                device: torch.device) -> None:
    if not isinstance(x, Quantized):
        raise TypeError(f"{name} must be a kvkernels.quant.Quantized (codes, scale, zero), got "
                        f"{type(x).__name__}")
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{name}_format must be a QuantFormat(bits, group), got {type(fmt).__name__}")
    check_format(head_dim, fmt.bits, fmt.group)
    check_tensor(f"{name}.codes", x.codes, ndim=4, dtypes=(torch.uint8,), device=device, contiguous=True)
    check_shape(f"{name}.codes", x.codes, (*slots, head_dim * fmt.bits // 8),
                f"[P, S, Hkv, D * bits / 8] with bits={fmt.bits}")
    for part in ("scale", "zero"):
        t = getattr(x, part)
        check_tensor(f"{name}.{part}", t, dtypes=PARAM_DTYPES, device=device, contiguous=True)
        check_shape(f"{name}.{part}", t, (*slots, head_dim // fmt.group), f"[P, S, Hkv, D / group] with "
                    f"group={fmt.group}")


def quant_decode_attention(q: Tensor, k: Quantized, v: Quantized, page_table: Tensor, seq_lens: Tensor, *,
                           scale: float, k_format: QuantFormat = QuantFormat(),
                           v_format: QuantFormat = QuantFormat(), validate: bool = True) -> Tensor:
    """One decode step's attention over quantized pages: ``out [B, Hq, D]`` in ``q``'s dtype.

    Parameters
    ----------
    q : Tensor ``[B, Hq, D]`` float32 / float16 / bfloat16
        One query per sequence and head.
    k, v : :class:`kvkernels.quant.Quantized`
        The pool: ``codes [P, S, Hkv, D * bits / 8]`` uint8, ``scale`` / ``zero`` ``[P, S, Hkv, D / group]``
        float16 or float32, as :func:`kvkernels.quant.quantize` writes them.
    page_table : Tensor ``[B, M]`` int32; seq_lens : Tensor ``[B]`` int32
        As for :func:`kvkernels.paged_decode_attention`.
    scale : float
        Softmax scale (usually ``D ** -0.5``).
    k_format, v_format : :class:`QuantFormat`
        Bits and group size of each pool.
    validate : bool
        Check the lengths and the page table against the pool (reads the device: a host sync).
    """
    check_tensor("q", q, ndim=3, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    batch, n_q, d = q.shape
    if not isinstance(k, Quantized):
        raise TypeError(f"k must be a kvkernels.quant.Quantized (codes, scale, zero), got {type(k).__name__}")
    num_pages, page_size, n_kv = k.codes.shape[:3]
    if n_q % n_kv:
        raise ValueError(f"q has {n_q} heads, not a multiple of the pool's {n_kv} KV heads (GQA groups)")
    _check_pool("k", k, k_format, d, (num_pages, page_size, n_kv), q.device)
    _check_pool("v", v, v_format, d, (num_pages, page_size, n_kv), q.device)
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,), device=q.device, contiguous=True)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), device=q.device, contiguous=True)
    check_shape("seq_lens", seq_lens, (batch,), "[B], one length per sequence")
    check_shape("page_table", page_table, (batch, None), "[B, M]")
    if validate and not torch.compiler.is_compiling():
        check_seq_lens(seq_lens)
        check_page_table(page_table, seq_lens, num_pages, page_size)
    return torch.ops.kvkernels.quant_decode_attention(
        q, *k, *v, page_table, seq_lens, float(scale), k_format.bits, k_format.group, v_format.bits,
        v_format.group)


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

COMPILE_AXES: dict[str, tuple] = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "head_dim": (64, 128),
    "bits": (2, 4, 8),
    "group": (32, 64),
    "gqa": (1, 4, 8),
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls the Triton launcher on ``meta`` tensors with one
    configuration of :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "quant_decode_attention " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))


def _meta_launch(dtype: torch.dtype, head_dim: int, bits: int, group: int, gqa: int) -> None:
    B, P, S, M, Hkv = 3, 40, 16, 12, 2
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    fmt = QuantFormat(bits, group)
    pool = Quantized(t(P, S, Hkv, head_dim * bits // 8, dt=torch.uint8), t(P, S, Hkv, head_dim // group,
                     dt=torch.float16), t(P, S, Hkv, head_dim // group, dt=torch.float16))
    quant_decode_attention_triton(t(B, Hkv * gqa, head_dim, dt=dtype), pool, pool, t(B, M, dt=torch.int32),
                                  t(B, dt=torch.int32), scale=head_dim ** -0.5, k_format=fmt, v_format=fmt)
