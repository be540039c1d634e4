"""Paged decode attention over quantized K/V pages (issue 36): the kernel dequantizes in registers.

The pool holds each (slot, KV head) as one packed :mod:`kvkernels.quant` row: ``uint8 [P, S, Hkv, W]``, a
row being its codes (planar packing) then a ``scale`` and a ``zero`` point per group of channels (float16
or float32). K and V may use different formats (:class:`kvkernels.quant.QuantFormat`). Each query head
``h`` reads KV head ``h // (Hq / Hkv)`` (GQA); slot ``j < seq_lens[b]`` of sequence ``b`` lives in page
``page_table[b, j // S]`` at offset ``j % S``. The result equals :func:`paged_decode_attention_ref` on the
dequantized pool (:func:`quant_decode_attention_ref` does exactly that) up to float32 summation order.

Three implementations, as everywhere in kvkernels: the reference (dequantize everything, then the plain
reference), a batched torch path (CPU tensors), and the Triton kernel (CUDA tensors, or the interpreter in
tests). The kernel reads each packed byte once per channel it holds (``8 / bits`` loads of the same byte,
served from cache): DRAM traffic is the packed bytes plus the parameters. No split-K and no fused score
update yet: decode-time eviction policies (H2O's accumulated attention) do not run on quantized pages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvkernels._checks import check_page_table, check_seq_lens, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, use_triton
from kvkernels.paged_attention import _masked_softmax
from kvkernels.quant import _PARAM_NAMES, QuantFormat, dequantize_rows

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dequant_tile(pages_ptr, row, ok, offs_d, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      PARAM_F32: tl.constexpr):
        """``[BLOCK_N, BLOCK_D]`` float32 values of the packed rows ``row`` (index into ``[P, S, Hkv]`` of a
        ``uint8 [P, S, Hkv, W]`` pool; a row is ``codes | scale | zero``, kvkernels.quant.pack): channel
        ``c`` is code ``(byte[c % (D/k)] >> (c // (D/k)) * BITS) & mask`` times its group's scale plus its
        zero point, ``k = 8 // BITS`` codes per byte (planar packing)."""
        PER_BYTE: tl.constexpr = 8 // BITS
        CODES: tl.constexpr = D // PER_BYTE  # code bytes per row
        N_GROUPS: tl.constexpr = D // GROUP
        PARAM_BYTES: tl.constexpr = 4 if PARAM_F32 else 2
        WIDTH: tl.constexpr = CODES + 2 * N_GROUPS * PARAM_BYTES
        base = pages_ptr + row.to(tl.int64)[:, None] * WIDTH  # [BLOCK_N, 1] row starts
        byte = tl.load(base + (offs_d % CODES)[None, :], mask=ok, other=0)
        shift = ((offs_d // CODES) * BITS).to(tl.int32)
        code = (byte.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)
        if PARAM_F32:
            params = (base + CODES).to(tl.pointer_type(tl.float32))
        else:
            params = (base + CODES).to(tl.pointer_type(tl.float16))
        g = (offs_d // GROUP)[None, :]
        s = tl.load(params + g, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(params + N_GROUPS + g, mask=ok, other=0.0).to(tl.float32)
        return code.to(tl.float32) * s + z

    @triton.jit
    def _load_rows(pages_ptr, row, ok, offs_d, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   PARAM_F32: tl.constexpr):
        """``[BLOCK_N, BLOCK_D]`` float32 rows: packed (``BITS`` > 0, :func:`_dequant_tile`) or stored in
        a float dtype (``BITS == 0``: ``[P, S, Hkv, D]``)."""
        if BITS == 0:
            return tl.load(pages_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :], mask=ok,
                           other=0.0).to(tl.float32)
        else:
            return _dequant_tile(pages_ptr, row, ok, offs_d, D, BITS, GROUP, PARAM_F32)

    @triton.jit
    def _attend_region(q, m_i, l_i, acc, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, b, kvh, scale,
                       max_pages, offs_d, d_ok,
                       HKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                       K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_F32: tl.constexpr,
                       V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_F32: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        """The online softmax state ``(m_i, l_i, acc)`` after one region's slots of sequence ``b``."""
        offs_n = tl.arange(0, BLOCK_N)
        seq_len = tl.load(seq_lens_ptr + b)
        for n0 in range(0, seq_len, BLOCK_N):
            slots = n0 + offs_n
            in_seq = slots < seq_len
            page = tl.load(page_table_ptr + b * max_pages + slots // S, mask=in_seq, other=0).to(tl.int64)
            row = (page * S + slots % S) * HKV + kvh  # [BLOCK_N] into [P, S, Hkv]
            ok = in_seq[:, None] & d_ok[None, :]
            k = _load_rows(k_ptr, row, ok, offs_d, D, K_BITS, K_GROUP, K_F32)  # [N, D]
            x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            x = tl.where(in_seq[None, :], x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(x - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_rows(v_ptr, row, ok, offs_d, D, V_BITS, V_GROUP, V_F32)  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _quant_decode_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr,
        k2_ptr, v2_ptr, page_table2_ptr, seq_lens2_ptr, out_ptr,
        scale, max_pages, max_pages2,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_F32: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_F32: tl.constexpr,
        HAS2: tl.constexpr, K2_BITS: tl.constexpr, K2_GROUP: tl.constexpr, K2_F32: tl.constexpr,
        V2_BITS: tl.constexpr, V2_GROUP: tl.constexpr, V2_F32: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (sequence, KV head): online softmax over the sequence's slots of the first
        region, then (``HAS2``) of the second, the group's query heads together (one ``tl.dot`` per tile),
        K and V dequantized tile by tile (a region with ``*_BITS == 0`` holds float rows)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G  # BLOCK_G >= 16 pads small groups so tl.dot has a legal shape
        d_ok = offs_d < D
        q_rows = (b * HKV + kvh) * G + offs_g
        q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        m_i, l_i, acc = _attend_region(q, m_i, l_i, acc, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, b, kvh,
                                       scale, max_pages, offs_d, d_ok, HKV, D, S, K_BITS, K_GROUP, K_F32,
                                       V_BITS, V_GROUP, V_F32, BLOCK_N)
        if HAS2:
            m_i, l_i, acc = _attend_region(q, m_i, l_i, acc, k2_ptr, v2_ptr, page_table2_ptr, seq_lens2_ptr,
                                           b, kvh, scale, max_pages2, offs_d, d_ok, HKV, D, S, K2_BITS,
                                           K2_GROUP, K2_F32, V2_BITS, V2_GROUP, V2_F32, BLOCK_N)
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # 0 for an empty sequence
        tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :],
                 (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


class Region(NamedTuple):
    """One more set of pages a sequence attends to, beside the first (a cache holding tokens in two formats:
    KIVI's unquantized recent tokens, ZipCache's salient ones at more bits, MiKV's kept ones unquantized).
    ``k_pages``/``v_pages`` ``[P2, S, Hkv, W]``: packed rows of ``k_format``/``v_format``, or float rows
    ``[P2, S, Hkv, D]`` when the format is ``None``; ``page_table [B, M2]`` int32, ``seq_lens [B]`` int32.
    The page size ``S`` and the KV heads are the first region's."""

    k_pages: Tensor
    v_pages: Tensor
    page_table: Tensor
    seq_lens: Tensor
    k_format: QuantFormat | None = None
    v_format: QuantFormat | None = None


def _rows(pages: Tensor, head_dim: int, fmt: QuantFormat | None) -> Tensor:
    """Float32 rows of a pool: dequantized, or the float rows themselves."""
    return pages.float() if fmt is None else dequantize_rows(pages, head_dim, fmt)


def quant_decode_attention_ref(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                               seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                               v_format: QuantFormat, second: Region | None = None) -> Tensor:
    """Reference: each sequence's rows of every region dequantized and laid end to end, then plain softmax
    attention in float32, one sequence at a time."""
    batch, n_q, d = q.shape
    regions = [Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format)]
    if second is not None:
        regions.append(second)
    out = torch.zeros(batch, n_q, d)
    for b in range(batch):
        ks, vs = [], []
        for r in regions:
            S, n = r.k_pages.shape[1], int(r.seq_lens[b])
            slots = [(int(r.page_table[b, j // S]), j % S) for j in range(n)]
            ks += [_rows(r.k_pages[p, o], d, r.k_format) for p, o in slots]  # [Hkv, D] each
            vs += [_rows(r.v_pages[p, o], d, r.v_format) for p, o in slots]
        if not ks:
            continue
        k, v = torch.stack(ks), torch.stack(vs)  # [n, Hkv, D]
        group = n_q // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, Hq, D]
        p = torch.softmax(scale * torch.einsum("hd,nhd->hn", q[b].float(), k), dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(q.dtype)


def _gather(region: Region, width: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The first ``width`` slots of every sequence of a region, dequantized: ``k, v [B, N, Hkv, D]``
    float32 and ``valid [B, N]`` (``N`` = ``width`` rounded up to pages)."""
    S = region.k_pages.shape[1]
    n_pages = -(-width // S)
    batch = region.page_table.shape[0]
    pages = region.page_table[:, :n_pages].long().clamp(0, region.k_pages.shape[0] - 1).flatten()

    def rows(pool: Tensor, fmt: QuantFormat | None) -> Tensor:  # index_select: whole pages, fast on CPU
        return _rows(pool.index_select(0, pages), head_dim, fmt).view(batch, n_pages * S, *pool.shape[2:3],
                                                                       head_dim)

    valid = torch.arange(n_pages * S, device=pages.device) < region.seq_lens[:, None]
    return rows(region.k_pages, region.k_format), rows(region.v_pages, region.v_format), valid


def quant_decode_attention_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                 seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                 v_format: QuantFormat, second: Region | None = None) -> Tensor:
    """Batched torch path (no input checks): gathers and dequantizes the pages the longest sequence of each
    region covers (one host read each), then one masked softmax over both regions' slots."""
    batch, n_q, d = q.shape
    regions = [Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format)]
    if second is not None:
        regions.append(second)
    parts = [_gather(r, int(r.seq_lens.max()), d) for r in regions if batch and int(r.seq_lens.max())]
    if not parts:
        return torch.zeros_like(q)
    k, v, valid = (torch.cat(x, dim=1) for x in zip(*parts, strict=True))  # [B, N, ...] over the regions
    v = v.masked_fill(~valid[:, :, None, None], 0.0)  # unused slots may hold anything (0 * NaN)
    n_kv = k.shape[2]
    qg = q.float().view(batch, n_kv, n_q // n_kv, d)
    x = scale * torch.einsum("bhgd,bnhd->bhgn", qg, k)
    p = _masked_softmax(x, valid[:, None, None, :])
    return torch.einsum("bhgn,bnhd->bhgd", p, v).reshape(batch, n_q, d).to(q.dtype)


def _launch_format(fmt: QuantFormat | None) -> tuple[int, int, bool]:
    """``(BITS, GROUP, PARAM_F32)`` of a region's pool for the kernel; ``BITS = 0``: float rows."""
    if fmt is None:
        return 0, 1, False
    return fmt.bits, fmt.group, fmt.param_dtype == torch.float32


def quant_decode_attention_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                  seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                  v_format: QuantFormat, second: Region | None = None) -> Tensor:
    """Triton launcher (no input checks): one program per (sequence, KV head)."""
    require_triton()
    batch, n_q, d = q.shape
    page_size, n_kv = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = n_q // n_kv
    q = q.contiguous()
    two = second if second is not None else Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format)
    k_bits, k_group, k_f32 = _launch_format(k_format)
    v_bits, v_group, v_f32 = _launch_format(v_format)
    k2_bits, k2_group, k2_f32 = _launch_format(two.k_format)
    v2_bits, v2_group, v2_f32 = _launch_format(two.v_format)
    launch(
        _quant_decode_kernel, (batch, n_kv),
        q, k_pages, v_pages, page_table, seq_lens, two.k_pages, two.v_pages, two.page_table, two.seq_lens,
        out,
        float(scale), page_table.shape[1], two.page_table.shape[1],
        HKV=n_kv, G=group, D=d, S=page_size,
        K_BITS=k_bits, K_GROUP=k_group, K_F32=k_f32, V_BITS=v_bits, V_GROUP=v_group, V_F32=v_f32,
        HAS2=second is not None, K2_BITS=k2_bits, K2_GROUP=k2_group, K2_F32=k2_f32,
        V2_BITS=v2_bits, V2_GROUP=v2_group, V2_F32=v2_f32,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d), BLOCK_N=32,
        num_warps=4,
    )
    return out


_DEFAULT = QuantFormat()


def _format_args(fmt: QuantFormat | None) -> tuple[int, int, str]:
    """A format as custom-op arguments (bits 0: float rows)."""
    return (0, 0, "") if fmt is None else (fmt.bits, fmt.group, _PARAM_NAMES[fmt.param_dtype])


def _format_of(bits: int, group: int, params: str) -> QuantFormat | None:
    return None if bits == 0 else QuantFormat(bits, group, getattr(torch, params))


@torch.library.custom_op("kvkernels::quant_decode_attention", mutates_args=())
def _quant_decode_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, seq_lens: Tensor,
                     scale: float, k_bits: int, k_group: int, k_params: str, v_bits: int, v_group: int,
                     v_params: str, second: list[Tensor], k2_bits: int, k2_group: int, k2_params: str,
                     v2_bits: int, v2_group: int, v2_params: str) -> Tensor:
    impl = quant_decode_attention_triton if use_triton(q) else quant_decode_attention_torch
    two = None
    if second:
        two = Region(*second, _format_of(k2_bits, k2_group, k2_params),
                     _format_of(v2_bits, v2_group, v2_params))
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale,
                k_format=QuantFormat(k_bits, k_group, getattr(torch, k_params)),
                v_format=QuantFormat(v_bits, v_group, getattr(torch, v_params)), second=two)


@_quant_decode_op.register_fake
def _(q, k_pages, v_pages, page_table, seq_lens, scale, k_bits, k_group, k_params, v_bits, v_group,
      v_params, second, k2_bits, k2_group, k2_params, v2_bits, v2_group, v2_params):
    return torch.empty_like(q)


def _check_pool(name: str, pages: Tensor, fmt: QuantFormat | None, head_dim: int,
                slots: tuple[int, ...] | None, device: torch.device,
                float_dtype: torch.dtype | None = None) -> None:
    if fmt is None:  # float rows (a second region only)
        check_tensor(f"{name}_pages", pages, ndim=4, dtypes=(float_dtype,) if float_dtype else
                     (torch.float32, torch.float16, torch.bfloat16), device=device, contiguous=True)
        check_shape(f"{name}_pages", pages, (*(slots or pages.shape[:3]), head_dim),
                    "[P, S, Hkv, D] float rows")
        return
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{name}_format must be a kvkernels.quant.QuantFormat(bits, group, param_dtype), got "
                        f"{type(fmt).__name__}")
    fmt.check(head_dim)
    check_tensor(f"{name}_pages", pages, ndim=4, dtypes=(torch.uint8,), device=device, contiguous=True)
    check_shape(f"{name}_pages", pages, (*(slots or pages.shape[:3]), fmt.row_bytes(head_dim)),
                f"[P, S, Hkv, W]: packed rows of {fmt.row_bytes(head_dim)} bytes "
                f"(kvkernels.quant.quantize_rows with {fmt})")


def _check_table(name: str, page_table: Tensor, seq_lens: Tensor, batch: int, device, num_pages: int,
                 page_size: int, validate: bool) -> None:
    check_tensor(f"{name}page_table", page_table, ndim=2, dtypes=(torch.int32,), device=device,
                 contiguous=True)
    check_tensor(f"{name}seq_lens", seq_lens, dtypes=(torch.int32,), device=device, contiguous=True)
    check_shape(f"{name}seq_lens", seq_lens, (batch,), "[B], one length per sequence")
    check_shape(f"{name}page_table", page_table, (batch, None), "[B, M]")
    if validate and not torch.compiler.is_compiling():
        check_seq_lens(seq_lens)
        check_page_table(page_table, seq_lens, num_pages, page_size)


def quant_decode_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, seq_lens: Tensor,
                           *, scale: float, k_format: QuantFormat = _DEFAULT,
                           v_format: QuantFormat = _DEFAULT, second: Region | None = None,
                           validate: bool = True) -> Tensor:
    """One decode step's attention over quantized pages: ``out [B, Hq, D]`` in ``q``'s dtype.

    Parameters
    ----------
    q : Tensor ``[B, Hq, D]`` float32 / float16 / bfloat16
        One query per sequence and head.
    k_pages, v_pages : Tensor ``[P, S, Hkv, W]`` uint8
        The pool's packed rows (``codes | scale | zero``, as :func:`kvkernels.quant.quantize_rows` writes
        them; ``W = format.row_bytes(D)``).
    page_table : Tensor ``[B, M]`` int32; seq_lens : Tensor ``[B]`` int32
        As for :func:`kvkernels.paged_decode_attention`.
    scale : float
        Softmax scale (usually ``D ** -0.5``).
    k_format, v_format : :class:`kvkernels.quant.QuantFormat`
        Bits, group size and parameter dtype of each pool.
    second : :class:`Region`, optional
        More slots of each sequence in a second pool (another format, or float rows): one softmax over both.
    validate : bool
        Check the lengths and the page tables against the pools (reads the device: a host sync).
    """
    check_tensor("q", q, ndim=3, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    batch, n_q, d = q.shape
    _check_pool("k", k_pages, k_format, d, None, q.device)
    num_pages, page_size, n_kv = k_pages.shape[:3]
    _check_pool("v", v_pages, v_format, d, (num_pages, page_size, n_kv), q.device)
    if n_q % n_kv:
        raise ValueError(f"q has {n_q} heads, not a multiple of the pool's {n_kv} KV heads (GQA groups)")
    _check_table("", page_table, seq_lens, batch, q.device, num_pages, page_size, validate)
    extra: list[Tensor] = []
    if second is not None:
        if not isinstance(second, Region):
            raise TypeError(f"second must be a kvkernels.quant_attention.Region, got {type(second).__name__}")
        _check_pool("second.k", second.k_pages, second.k_format, d, None, q.device)
        p2 = second.k_pages.shape[0]
        if tuple(second.k_pages.shape[1:3]) != (page_size, n_kv):
            raise ValueError(f"second.k_pages has pages of {tuple(second.k_pages.shape[1:3])} (slots, KV "
                             f"heads) but the first region's are {(page_size, n_kv)}; both regions share S "
                             "and Hkv")
        _check_pool("second.v", second.v_pages, second.v_format, d, (p2, page_size, n_kv), q.device,
                    second.k_pages.dtype if second.k_format is None else None)
        _check_table("second.", second.page_table, second.seq_lens, batch, q.device, p2, page_size, validate)
        extra = [second.k_pages, second.v_pages, second.page_table, second.seq_lens]
    two = second if second is not None else Region(k_pages, v_pages, page_table, seq_lens)
    return torch.ops.kvkernels.quant_decode_attention(
        q, k_pages, v_pages, page_table, seq_lens, float(scale), *_format_args(k_format),
        *_format_args(v_format), extra, *_format_args(two.k_format), *_format_args(two.v_format))


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

COMPILE_AXES: dict[str, tuple] = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "head_dim": (64, 128),
    "bits": (2, 4, 8),
    "group": (32, 64),
    "gqa": (1, 4, 8),
    "second": ("none", "float", "4bit"),  # a second region: none, float rows of q's dtype, 4-bit rows
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls the Triton launcher on ``meta`` tensors with one
    configuration of :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "quant_decode_attention " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))


def _meta_launch(dtype: torch.dtype, head_dim: int, bits: int, group: int, gqa: int,
                 second: str = "none") -> None:
    B, P, S, M, Hkv = 3, 40, 16, 12, 2
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    fmt = QuantFormat(bits, group)
    pool = t(P, S, Hkv, fmt.row_bytes(head_dim), dt=torch.uint8)
    region = None
    if second != "none":
        fmt2 = None if second == "float" else QuantFormat(4, 32)
        width = head_dim if fmt2 is None else fmt2.row_bytes(head_dim)
        pool2 = t(P, S, Hkv, width, dt=dtype if fmt2 is None else torch.uint8)
        region = Region(pool2, pool2, t(B, M, dt=torch.int32), t(B, dt=torch.int32), fmt2, fmt2)
    quant_decode_attention_triton(t(B, Hkv * gqa, head_dim, dt=dtype), pool, pool, t(B, M, dt=torch.int32),
                                  t(B, dt=torch.int32), scale=head_dim ** -0.5, k_format=fmt, v_format=fmt,
                                  second=region)
