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

import torch
from torch import Tensor

from kvkernels._checks import check_page_table, check_seq_lens, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, use_triton
from kvkernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_torch
from kvkernels.quant import QuantFormat, dequantize_rows

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
    def _quant_decode_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr,
        scale, max_pages,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_F32: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_F32: tl.constexpr,
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
            k = _dequant_tile(k_ptr, row, ok, offs_d, D, K_BITS, K_GROUP, K_F32)  # [N, D]
            x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
            x = tl.where(in_seq[None, :], x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(x - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _dequant_tile(v_ptr, row, ok, offs_d, D, V_BITS, V_GROUP, V_F32)  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # 0 for an empty sequence
        tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :],
                 (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def quant_decode_attention_ref(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                               seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                               v_format: QuantFormat) -> Tensor:
    """Reference: dequantize the whole pool, then :func:`paged_decode_attention_ref` (float32 math)."""
    d = q.shape[-1]
    kd = dequantize_rows(k_pages, d, k_format)
    vd = dequantize_rows(v_pages, d, v_format)
    return paged_decode_attention_ref(q.float(), kd, vd, page_table, seq_lens, scale=scale).to(q.dtype)


def quant_decode_attention_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                 seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                 v_format: QuantFormat) -> Tensor:
    """Batched torch path (no input checks): dequantizes the pages the batch's longest sequence covers into
    a dense temporary pool, one page per (sequence, table column), and runs the plain torch path on it."""
    batch, _, d = q.shape
    width = int(seq_lens.max()) if batch else 0  # one host read, as the plain torch path does
    if width == 0:
        return torch.zeros_like(q)
    n_pages = -(-width // k_pages.shape[1])
    pages = page_table[:, :n_pages].long().clamp(0, k_pages.shape[0] - 1).flatten()  # unused: any real page
    kd = dequantize_rows(k_pages.index_select(0, pages), d, k_format)  # [B * n_pages, S, Hkv, D] float32
    vd = dequantize_rows(v_pages.index_select(0, pages), d, v_format)
    table = torch.arange(batch * n_pages, device=q.device, dtype=torch.int32).view(batch, n_pages)
    return paged_decode_attention_torch(q.float(), kd, vd, table, seq_lens, scale=scale).to(q.dtype)


def quant_decode_attention_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                  seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                  v_format: QuantFormat) -> Tensor:
    """Triton launcher (no input checks): one program per (sequence, KV head)."""
    require_triton()
    batch, n_q, d = q.shape
    page_size, n_kv = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = n_q // n_kv
    q = q.contiguous()
    launch(
        _quant_decode_kernel, (batch, n_kv),
        q, k_pages, v_pages, page_table, seq_lens, out, float(scale), page_table.shape[1],
        HKV=n_kv, G=group, D=d, S=page_size,
        K_BITS=k_format.bits, K_GROUP=k_format.group, K_F32=k_format.param_dtype == torch.float32,
        V_BITS=v_format.bits, V_GROUP=v_format.group, V_F32=v_format.param_dtype == torch.float32,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d), BLOCK_N=32,
        num_warps=4,
    )
    return out


_PARAM_NAMES = {torch.float16: "float16", torch.float32: "float32"}
_DEFAULT = QuantFormat()


@torch.library.custom_op("kvkernels::quant_decode_attention", mutates_args=())
def _quant_decode_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, seq_lens: Tensor,
                     scale: float, k_bits: int, k_group: int, k_params: str, v_bits: int, v_group: int,
                     v_params: str) -> Tensor:
    impl = quant_decode_attention_triton if use_triton(q) else quant_decode_attention_torch
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale,
                k_format=QuantFormat(k_bits, k_group, getattr(torch, k_params)),
                v_format=QuantFormat(v_bits, v_group, getattr(torch, v_params)))


@_quant_decode_op.register_fake
def _(q, k_pages, v_pages, page_table, seq_lens, scale, k_bits, k_group, k_params, v_bits, v_group,
      v_params):
    return torch.empty_like(q)


def _check_pool(name: str, pages: Tensor, fmt: QuantFormat, head_dim: int, slots: tuple[int, ...] | None,
                device: torch.device) -> None:
    if not isinstance(fmt, QuantFormat):
        raise TypeError(f"{name}_format must be a kvkernels.quant.QuantFormat(bits, group, param_dtype), got "
                        f"{type(fmt).__name__}")
    fmt.check(head_dim)
    check_tensor(f"{name}_pages", pages, ndim=4, dtypes=(torch.uint8,), device=device, contiguous=True)
    check_shape(f"{name}_pages", pages, (*(slots or pages.shape[:3]), fmt.row_bytes(head_dim)),
                f"[P, S, Hkv, W]: packed rows of {fmt.row_bytes(head_dim)} bytes "
                f"(kvkernels.quant.quantize_rows with {fmt})")


def quant_decode_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, seq_lens: Tensor,
                           *, scale: float, k_format: QuantFormat = _DEFAULT,
                           v_format: QuantFormat = _DEFAULT, validate: bool = True) -> Tensor:
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
    validate : bool
        Check the lengths and the page table against the pool (reads the device: a host sync).
    """
    check_tensor("q", q, ndim=3, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    batch, n_q, d = q.shape
    _check_pool("k", k_pages, k_format, d, None, q.device)
    num_pages, page_size, n_kv = k_pages.shape[:3]
    _check_pool("v", v_pages, v_format, d, (num_pages, page_size, n_kv), q.device)
    if n_q % n_kv:
        raise ValueError(f"q has {n_q} heads, not a multiple of the pool's {n_kv} KV heads (GQA groups)")
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,), device=q.device, contiguous=True)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), device=q.device, contiguous=True)
    check_shape("seq_lens", seq_lens, (batch,), "[B], one length per sequence")
    check_shape("page_table", page_table, (batch, None), "[B, M]")
    if validate and not torch.compiler.is_compiling():
        check_seq_lens(seq_lens)
        check_page_table(page_table, seq_lens, num_pages, page_size)
    return torch.ops.kvkernels.quant_decode_attention(
        q, k_pages, v_pages, page_table, seq_lens, float(scale), k_format.bits, k_format.group,
        _PARAM_NAMES[k_format.param_dtype], v_format.bits, v_format.group, _PARAM_NAMES[v_format.param_dtype])


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
    pool = t(P, S, Hkv, fmt.row_bytes(head_dim), dt=torch.uint8)
    quant_decode_attention_triton(t(B, Hkv * gqa, head_dim, dt=dtype), pool, pool, t(B, M, dt=torch.int32),
                                  t(B, dt=torch.int32), scale=head_dim ** -0.5, k_format=fmt, v_format=fmt)
