"""Paged decode attention over quantized K/V pages (issue 36): the kernel dequantizes in registers.

The pool holds each (slot, KV head) as one packed :mod:`kvkernels.quant` row: ``uint8 [P, S, Hkv, W]``, a
row being its codes (planar packing) then a ``scale`` and a ``zero`` point per group of channels (float16
or float32). K and V may use different formats (:class:`kvkernels.quant.QuantFormat`). Each query head
``h`` reads KV head ``h // (Hq / Hkv)`` (GQA); slot ``j < seq_lens[b]`` of sequence ``b`` lives in page
``page_table[b, j // S]`` at offset ``j % S``. The result equals :func:`paged_decode_attention_ref` on the
dequantized pool (:func:`quant_decode_attention_ref` does exactly that) up to float32 summation order, and
for float16 / bfloat16 queries the rounding of the dequantized rows and the probabilities: to float16 where
both formats hold float16 parameters (:data:`HALF_ROWS`, the default formats), else to the query's dtype.

Three implementations, as everywhere in kvkernels: the reference (dequantize everything, then the plain
reference), a batched torch path (CPU tensors), and the Triton kernel (CUDA tensors, or the interpreter in
tests). The kernel is the native decode kernel's shape (:mod:`kvkernels.paged_attention`): one program per
(sequence, KV head, split), the group's query heads in one tensor-core product per tile, split-K partials
combined by the same reduce kernel. A tile's code bytes, scales and zero points are read once each, as
contiguous runs, and unpacked in registers; for 16-bit queries with float16 parameters each code becomes a
float16 directly and is scaled in packed float16 arithmetic, the products in float16 (:data:`HALF_ROWS`);
otherwise the tile is dequantized in float32 and rounded once to the query's dtype for the product (float32
queries: exact float32 products). The score update of decode-time eviction (H2O's
accumulated attention, Keyformer's Gumbel score, ...) is fused as in the native kernel: the tile logits go to
the split scratch and the shared reduce kernel scores the slots
(``kvkernels::quant_decode_attention_scored``).
With a second region (KIVI's float residual beside the packed tokens) every mode scores both regions'
slots from the one softmax, the second's scores in ``Region.score``: its logits follow the first region's
in each scratch row and more reduce programs score them (``kvkernels::quant_decode_attention_scored_two``);
Gumbel's noise is hashed with the sequence's logical slot, the second region's slot ``j`` at ``len1 + j``.

The first kernel (one program per sequence and KV head, each channel's code byte and parameters gathered
per element, float32 products on the CUDA cores) ran 36x slower than bf16 pages on an H200
(bench/results/nvidia-h200-2026-11-26/run6); ``python bench/sass.py`` shows what changed without a GPU.
The second (run 8) took 1.73x bf16 pages' time at B64/4k while reading 3.2x fewer bytes, and twice its
time at half the tile: each loop step waited on its own loads. A variant runs its loads a tile ahead of the
arithmetic by hand (``_attend_region``'s ``LOADS``; static counts in ``bench/sass.py``): run 10 timed it
at 364 us (1.48x bf16 pages' 246 us) for 4-bit pages; the 2026-11-28 run found 8-bit pages faster
prefetched too (415 against 446 us), and the loop without it failing GPU-only examples that the prefetched
variants pass, so it is on for every width (:data:`PREFETCH_TILES`; ``bench/gpu.py``'s quant stage times
both ways). Run 4 of 2026-11-28 traced that failure to the loop's contiguous code-byte loads (runs of 4
and 8 bytes); it reads int32 words since, as the prefetched loop does, and passed on the H200 (run 5).
The same arithmetic in the same order: bit for bit the same results in the interpreter; on sm_90 the 4-bit
outputs differed in the last bits (run 10, when the loop without prefetching still read bytes), the 8-bit
ones were bit-identical.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from kvkernels._checks import check_page_table, check_seq_lens, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, LOG2E_C, covering, launch, require_triton, use_triton
from kvkernels.paged_attention import (
    _NEG_BIG,
    _NO_SCORES,
    ScoreUpdate,
    SecondScores,
    _masked_softmax,
    _partials,
    _split_plan,
    check_scores,
    paged_decode_attention_ref,
    paged_decode_attention_torch,
    reduce_splits,
)
from kvkernels.quant import _PARAM_NAMES, QuantFormat, dequantize_rows
from kvkernels.tuning import launch_config

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kvkernels.paged_attention import _finish_split, _keep_logits  # shared with the native kernel

    _NEG_BIG_C = tl.constexpr(_NEG_BIG)  # jit code may only read globals that are constexpr

    @triton.jit
    def _unpack(byte, BITS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        """``[BLOCK_N, D]`` int32 codes of ``[BLOCK_N, D * BITS / 8]`` planar-packed bytes: part ``i`` of
        every byte (bits ``[i * BITS, (i + 1) * BITS)``) is the channel slice ``[i * D/k, (i+1) * D/k)``,
        so the parts are joined and laid side by side (``join`` + ``permute`` + ``reshape``: register moves,
        no gathers from memory)."""
        b = byte.to(tl.int32)
        if BITS == 8:
            return b
        elif BITS == 4:
            parts = tl.join(b & 15, b >> 4)  # [N, D/2, 2]: part i at [..., i]
            return tl.reshape(tl.permute(parts, (0, 2, 1)), (BLOCK_N, D))
        else:
            parts = tl.join(tl.join(b & 3, (b >> 2) & 3), tl.join((b >> 4) & 3, b >> 6))  # [N, D/4, 2, 2]:
            return tl.reshape(tl.permute(parts, (0, 3, 2, 1)), (BLOCK_N, D))  # part 2 j + i at [..., i, j]

    @triton.jit
    def _load_rows(pages_ptr, row, in_seq, offs_d, d_ok, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, PARAM_F32: tl.constexpr,
                   WORDS: tl.constexpr, HALF: tl.constexpr):
        """``[BLOCK_N, BLOCK_D]`` float32 (``WORDS`` and ``HALF``: float16) values of the rows ``row``
        (``[BLOCK_N]`` indices into ``[P, S, Hkv]``; 0 where not ``in_seq``): float rows ``[P, S, Hkv, D]``
        (``BITS == 0``), or packed rows ``codes | scale | zero`` (:func:`kvkernels.quant.pack`) dequantized as
        ``code * scale + zero``.

        ``WORDS`` (packed rows of a power-of-two head dim in a pool starting on 4 bytes, :func:`_loads`) reads
        each row's codes as contiguous int32 words, its scales and zero points as contiguous runs, and unpacks
        in registers (:func:`_fetch_rows`, :func:`_decode_rows`: the prefetched loop's own loads); other
        packed rows read each code byte once per channel it holds and each parameter once per channel (a
        gather; cached reads; :func:`_dequant_rows`)."""
        ok = in_seq[:, None] & d_ok[None, :]
        if WORDS:
            word, s, z = _fetch_rows(pages_ptr, row, in_seq, D, BITS, GROUP, PARAM_F32)
            return _decode_rows(word, s, z, D, BLOCK_N, BITS, GROUP, HALF)
        elif BITS == 0:
            return tl.load(pages_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :], mask=ok,
                           other=0.0).to(tl.float32)
        else:
            return _dequant_rows(pages_ptr, row, ok, offs_d, D, BITS, GROUP, PARAM_F32)

    @triton.jit
    def _row_starts(pages_ptr, row, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    PARAM_F32: tl.constexpr):
        """``[BLOCK_N]`` byte pointers to the packed rows ``row`` and typed pointers to their parameters
        (``codes | scale | zero``: :func:`kvkernels.quant.pack`)."""
        CODES: tl.constexpr = D * BITS // 8
        WIDTH: tl.constexpr = CODES + 2 * (D // GROUP) * (4 if PARAM_F32 else 2)
        base = pages_ptr + row.to(tl.int64) * WIDTH
        if PARAM_F32:
            params = (base + CODES).to(tl.pointer_type(tl.float32))
        else:
            params = (base + CODES).to(tl.pointer_type(tl.float16))
        return base, params

    @triton.jit
    def _dequant_rows(pages_ptr, row, ok, offs_d, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      PARAM_F32: tl.constexpr):
        """The packed branch of :func:`_load_rows` without ``WORDS``: channel ``c`` of a row is part
        ``c // CODES`` of code byte ``c % CODES`` (planar packing, :func:`kvkernels.quant.pack`), gathered per
        channel with its group's scale and zero point (any head dim, any pool start).

        Contiguous byte runs unpacked in registers (as the words are) failed the reference on an H200 (run 4
        of 2026-11-28: runs of 4 and 8 bytes, 2- and 4-bit rows of head dim 16, far off on some slots; the
        interpreter passed) where the word loads passed: pools off 4 bytes take this gather instead."""
        CODES: tl.constexpr = D * BITS // 8  # code bytes per row
        N_GROUPS: tl.constexpr = D // GROUP
        base, params = _row_starts(pages_ptr, row, D, BITS, GROUP, PARAM_F32)
        byte = tl.load(base[:, None] + (offs_d % CODES)[None, :], mask=ok, other=0)
        code = (byte.to(tl.int32) >> ((offs_d // CODES) * BITS)[None, :]) & ((1 << BITS) - 1)
        g = (offs_d // GROUP)[None, :]
        s = tl.load(params[:, None] + g, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(params[:, None] + N_GROUPS + g, mask=ok, other=0.0).to(tl.float32)
        return code.to(tl.float32) * s + z

    @triton.jit
    def _word_bytes(word, BLOCK_N: tl.constexpr, CODES: tl.constexpr):
        """``[BLOCK_N, CODES]`` int32 bytes of ``[BLOCK_N, CODES / 4]`` little-endian int32 words: byte ``j``
        of word ``w`` is byte ``4 w + j`` of the row (``join`` + ``permute`` + ``reshape``, as in
        :func:`_unpack`: register moves)."""
        lo = tl.join(word & 255, (word >> 8) & 255)
        parts = tl.join(lo, tl.join((word >> 16) & 255, (word >> 24) & 255))  # [N, CODES/4, 2, 2]: byte
        return tl.reshape(tl.permute(parts, (0, 1, 3, 2)), (BLOCK_N, CODES))  # 2 j + i at [..., i, j]

    @triton.jit
    def _fetch_rows(pages_ptr, row, in_seq, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    PARAM_F32: tl.constexpr):
        """The stored parts of the packed rows ``row`` (``[BLOCK_N]`` indices into ``[P, S, Hkv]``; 0 where
        not ``in_seq``), before any arithmetic: ``[BLOCK_N, D * BITS / 32]`` int32 words of codes,
        ``[BLOCK_N, D / GROUP]`` scales and zero points, apart from their arithmetic (:func:`_decode_rows`),
        so that ``_attend_region``'s prefetched loop can issue them a tile early and carry them to the next
        step: as words, four code bytes to a register where a byte tensor holds one per register. Rows and
        code runs are multiples of 4 bytes at power-of-two head dims >= 16, and the launcher checks the
        pool's start."""
        CODES: tl.constexpr = D * BITS // 8  # code bytes per row
        N_GROUPS: tl.constexpr = D // GROUP
        base, params = _row_starts(pages_ptr, row, D, BITS, GROUP, PARAM_F32)
        words = base.to(tl.pointer_type(tl.int32))
        word = tl.load(words[:, None] + tl.arange(0, CODES // 4)[None, :], mask=in_seq[:, None], other=0)
        offs_g = tl.arange(0, N_GROUPS)[None, :]
        s = tl.load(params[:, None] + offs_g, mask=in_seq[:, None], other=0.0)
        z = tl.load(params[:, None] + N_GROUPS + offs_g, mask=in_seq[:, None], other=0.0)
        return word, s, z

    @triton.jit
    def _decode_rows(word, s, z, D: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr, HALF: tl.constexpr):
        """``[BLOCK_N, D]`` values ``code * scale + zero`` of :func:`_fetch_rows`'s parts: float32 (the words
        split into their bytes, then into their codes), or with ``HALF`` float16 (:func:`_half_codes`, then
        one packed float16 fused multiply-add per two values)."""
        N_GROUPS: tl.constexpr = D // GROUP
        if HALF:
            x = tl.reshape(_half_codes(word, D, BLOCK_N, BITS), (BLOCK_N, N_GROUPS, GROUP))
            x = tl.fma(x, s.to(tl.float16)[:, :, None], z.to(tl.float16)[:, :, None])
        else:
            code = _unpack(_word_bytes(word, BLOCK_N, D * BITS // 8), BITS, BLOCK_N, D).to(tl.float32)
            x = (tl.reshape(code, (BLOCK_N, N_GROUPS, GROUP)) * s.to(tl.float32)[:, :, None]
                 + z.to(tl.float32)[:, :, None])
        return tl.reshape(x, (BLOCK_N, D))

    @triton.jit
    def _half_of(pair, HI: tl.constexpr):
        """The float16 in the low (or, ``HI``, high) 16 bits of each int32 of ``pair``."""
        if HI:
            return (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            return pair.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _half_pair(word, SHIFT: tl.constexpr, BITS: tl.constexpr):
        """The codes at bit ``SHIFT`` and ``SHIFT + 16`` of each word as two float16 ``1024 + code`` in one
        int32: one mask-and-or on the word (``0x6400`` is 1024 in float16, whose ulp there is 1, so the code
        is the mantissa: exact for every code below 1024, no integer-to-float conversion)."""
        MASK: tl.constexpr = ((1 << BITS) - 1) * 0x10001
        return ((word >> SHIFT) & MASK) | 0x64006400

    @triton.jit
    def _half_part(word, J: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr):
        """``[BLOCK_N, WORDS, 2]`` float16 codes ``1024 + code`` of part ``I`` of bytes ``J`` and ``J + 2`` of
        every word: ``[..., h]`` holds byte ``J + 2 h``'s."""
        pair = _half_pair(word, 8 * J + I * BITS, BITS)
        return tl.join(_half_of(pair, False), _half_of(pair, True))

    @triton.jit
    def _half_codes(word, D: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
        """``[BLOCK_N, D]`` float16 codes of ``[BLOCK_N, D * BITS / 32]`` int32 words of planar-packed rows
        (part ``i`` of code byte ``b`` is channel ``b + i * D / (8 / BITS)``), in channel order, exact.

        Each int32 yields two codes at once (:func:`_half_pair`: byte ``j`` and ``j + 2`` of a word, the same
        part), so a code costs about one integer operation and half a packed float16 subtraction, where
        ``_unpack`` + ``.to(float32)`` + a float32 multiply-add + the rounding to the query's dtype cost about
        five instructions (``bench/sass.py``). Channel ``i * D / k + 4 w + 2 h + j`` (``k = 8 / BITS`` parts
        per byte, word ``w``, byte ``j + 2 h`` of it) is element ``[n, w, h, j, i...]`` of the joined codes;
        the permutation puts the parts first (8 bits: one part, already in order)."""
        if BITS == 8:
            c = tl.join(_half_part(word, 0, 0, BITS), _half_part(word, 1, 0, BITS))  # [N, W, h, j]: in order
        elif BITS == 4:
            c = tl.join(tl.join(_half_part(word, 0, 0, BITS), _half_part(word, 1, 0, BITS)),
                        tl.join(_half_part(word, 0, 1, BITS), _half_part(word, 1, 1, BITS)))
            c = tl.permute(c, (0, 4, 1, 2, 3))  # [N, W, h, j, i] to [N, i, W, h, j]
        else:
            lo = tl.join(tl.join(_half_part(word, 0, 0, BITS), _half_part(word, 1, 0, BITS)),
                         tl.join(_half_part(word, 0, 1, BITS), _half_part(word, 1, 1, BITS)))
            hi = tl.join(tl.join(_half_part(word, 0, 2, BITS), _half_part(word, 1, 2, BITS)),
                         tl.join(_half_part(word, 0, 3, BITS), _half_part(word, 1, 3, BITS)))
            c = tl.permute(tl.join(lo, hi), (0, 5, 4, 1, 2, 3))  # [N, W, h, j, i % 2, i // 2]
        return tl.reshape(c, (BLOCK_N, D)) - 1024.0

    @triton.jit
    def _slot_pages(page_table_ptr, b, slots, in_seq, max_pages, S: tl.constexpr):
        """``[BLOCK_N]`` int32 page of each slot of sequence ``b`` (0 where not ``in_seq``)."""
        return tl.load(page_table_ptr + b * max_pages + slots // S, mask=in_seq, other=0)

    @triton.jit
    def _half_query(q, scale):
        """``q [BLOCK_G, BLOCK_D]`` (float16 or bfloat16) as float16 for products with float16 rows, and the
        logits' scale to go with it. A float16 query is itself. A bfloat16 one is multiplied by the power of
        two ``2^-e`` that puts its largest magnitude in ``[2^14, 2^15)``, then rounded to float16, which holds
        every bfloat16 value of that range exactly (8 significant bits within float16's 11; bfloat16's range
        beyond float16's is what the power of two removes); the scale becomes ``scale * 2^e``, so the logits
        are those of the bfloat16 query. Elements under ``2^-28`` of the largest become float16 subnormals and
        lose bits, those under ``2^-39`` of it round to zero: far below the float32 accumulation's error.
        (A float16 query needs no scaling: it already is what the products take.)"""
        if q.dtype == tl.float16:
            return q, scale
        qf = q.to(tl.float32)
        top = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        e = ((top.to(tl.int32, bitcast=True) >> 23) & 255) - 127 - 14  # floor(log2(top)) - 14
        e = tl.minimum(tl.maximum(e, -100), 113)  # zero (or subnormal) queries: 2^100, a no-op on zeros
        down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exactly
        up = ((127 + e) << 23).to(tl.float32, bitcast=True)
        return (qf * down).to(tl.float16), scale * up

    @triton.jit
    def _softmax_step(q, k, m_i, l_i, in_seq, scale, DOT_PRECISION: tl.constexpr):
        """One tile's logits ``x [BLOCK_G, BLOCK_N]`` (``-inf`` past the region), the new running max and
        sum, the old max's factor ``alpha`` and the unnormalised probabilities ``p``."""
        x = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, N]
        x = tl.where(in_seq[None, :], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        alpha = tl.exp2((m_i - m_new) * LOG2E_C)  # exp as exp2 of a multiply-add, as the native kernel
        p = tl.exp2(x * LOG2E_C - (m_new * LOG2E_C)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return x, m_new, alpha, p, l_i

    @triton.jit
    def _tile_tail(q, v, x, alpha, p, acc, gm_i, gl_i, n_vis, logits_ptr, noise_key, noise_offset, q_rows,
                   g_ok, slots, in_seq, tau, logits_len, DOT_PRECISION: tl.constexpr,
                   KEEP_LOGITS: tl.constexpr, GUMBEL: tl.constexpr):
        """A tile's step after :func:`_softmax_step`, shared by both loops of :func:`_attend_region`: the
        rescaled ``acc`` plus ``p @ v`` and (``KEEP_LOGITS``) the native kernel's ``_keep_logits`` (every
        slot of the region is visible)."""
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        if KEEP_LOGITS:
            gm_i, gl_i, n_vis = _keep_logits(x, gm_i, gl_i, n_vis, logits_ptr, noise_key, noise_offset,
                                             q_rows, g_ok, slots, in_seq, in_seq, tau, logits_len, q.shape[0],
                                             x.shape[1], noise_key.shape[0], GUMBEL)
        return acc, gm_i, gl_i, n_vis

    @triton.jit
    def _attend_region(q, m_i, l_i, acc, gm_i, gl_i, n_vis, k_ptr, v_ptr, page_table_ptr, logits_ptr,
                       noise_key, noise_offset, q_rows, g_ok, b, kvh, start, end, scale, tau, max_pages,
                       logits_len, offs_d, d_ok,
                       HKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                       K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_F32: tl.constexpr,
                       V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_F32: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       KEEP_LOGITS: tl.constexpr, GUMBEL: tl.constexpr, LOADS: tl.constexpr,
                       HALF: tl.constexpr):
        """The online softmax state ``(m_i, l_i, acc)`` after slots ``[start, end)`` of one region of
        sequence ``b``. Each tile is dequantized in float32, rounded once to the query's dtype and multiplied
        on the tensor cores (fp32 queries: exact fp32 products); with ``HALF`` (:func:`_half`) decoded to
        float16 and multiplied in float16 with the query made float16 exactly (:func:`_half_query`).
        ``KEEP_LOGITS``: the fp32 logits go to the scratch by slot, with the visible count ``n_vis`` and
        (``GUMBEL``) the noised running max and sum ``(gm_i, gl_i)``, for the reduce kernel's score update
        (as in the native decode kernel).

        ``LOADS`` (the launcher's choice, :func:`_loads`): 2, the loads run one tile ahead of the
        arithmetic, by hand. The loop carries the next tile's raw K and V rows (:func:`_fetch_rows`: code
        words, scales, zero points; a few registers each) and the page-table entries of the tile after it.
        A step decodes its K tile and at once issues the next tile's K loads, computes the logits, decodes
        its V tile and issues the next tile's V loads and the page-table entries of the tile after next,
        then multiplies V: each load has about a step's arithmetic to arrive in, and one copy of each raw
        tile is live at a time. Triton's pipeliner leaves these loads alone (they feed no product in the
        step that issues them). Otherwise each step's loads are its own (1: the same word loads, 0: code
        bytes, :func:`_load_rows`) and the pipeliner overlaps what
        it can, which on sm_90 is little (``bench/sass.py``, TTGIR): it issues the next tile's copies
        after the current tile's products and waits for them first thing in the next step, behind a plain
        page-table load (2 stages) or plain loads of the scales and zero points (3 stages): each step
        waits for one or two round trips to memory that nothing overlaps. Both do the same arithmetic in
        the same order (:func:`_softmax_step`, then :func:`_tile_tail`): bit-identical in the interpreter
        (sm_90, run 10: 4-bit differs in the last bits).
        """
        offs_n = tl.arange(0, BLOCK_N)
        if HALF:  # the products in float16 (the query exactly, _half_query), the rows decoded to float16
            q, scale = _half_query(q, scale)
        if LOADS == 2:
            tl.static_assert(K_BITS > 0 and V_BITS > 0 and BLOCK_D == D, "prefetching: packed rows, D = 2^k")
            slots = start + offs_n
            in_seq = slots < end
            page = _slot_pages(page_table_ptr, b, slots, in_seq, max_pages, S).to(tl.int64)
            row = (page * S + slots % S) * HKV + kvh  # [BLOCK_N] into [P, S, Hkv]
            kb, ks, kz = _fetch_rows(k_ptr, row, in_seq, D, K_BITS, K_GROUP, K_F32)
            vb, vs, vz = _fetch_rows(v_ptr, row, in_seq, D, V_BITS, V_GROUP, V_F32)
            next_slots = slots + BLOCK_N
            next_page = _slot_pages(page_table_ptr, b, next_slots, next_slots < end, max_pages, S)
            for n0 in range(start, end, BLOCK_N):
                slots = n0 + offs_n
                in_seq = slots < end
                next_slots = slots + BLOCK_N
                next_in = next_slots < end  # masked off past the region: no traffic
                next_row = (next_page.to(tl.int64) * S + next_slots % S) * HKV + kvh  # (int32 carried)
                # Each raw tile is replaced by the next one's as soon as it is decoded: one copy of each live.
                k = _decode_rows(kb, ks, kz, D, BLOCK_N, K_BITS, K_GROUP, HALF)
                kb, ks, kz = _fetch_rows(k_ptr, next_row, next_in, D, K_BITS, K_GROUP, K_F32)
                x, m_new, alpha, p, l_i = _softmax_step(q, k, m_i, l_i, in_seq, scale, DOT_PRECISION)
                v = _decode_rows(vb, vs, vz, D, BLOCK_N, V_BITS, V_GROUP, HALF)
                vb, vs, vz = _fetch_rows(v_ptr, next_row, next_in, D, V_BITS, V_GROUP, V_F32)
                after_slots = next_slots + BLOCK_N  # the tile after next: the next step's rows
                next_page = _slot_pages(page_table_ptr, b, after_slots, after_slots < end, max_pages, S)
                acc, gm_i, gl_i, n_vis = _tile_tail(q, v, x, alpha, p, acc, gm_i, gl_i, n_vis, logits_ptr,
                                                    noise_key, noise_offset, q_rows, g_ok, slots, in_seq,
                                                    tau, logits_len, DOT_PRECISION, KEEP_LOGITS, GUMBEL)
                m_i = m_new
        else:
            for n0 in range(start, end, BLOCK_N):
                slots = n0 + offs_n
                in_seq = slots < end
                page = _slot_pages(page_table_ptr, b, slots, in_seq, max_pages, S).to(tl.int64)
                row = (page * S + slots % S) * HKV + kvh  # [BLOCK_N] into [P, S, Hkv]
                k = _load_rows(k_ptr, row, in_seq, offs_d, d_ok, D, BLOCK_N, BLOCK_D, K_BITS, K_GROUP, K_F32,
                               LOADS == 1, HALF)
                x, m_new, alpha, p, l_i = _softmax_step(q, k, m_i, l_i, in_seq, scale, DOT_PRECISION)
                v = _load_rows(v_ptr, row, in_seq, offs_d, d_ok, D, BLOCK_N, BLOCK_D, V_BITS, V_GROUP, V_F32,
                               LOADS == 1, HALF)
                acc, gm_i, gl_i, n_vis = _tile_tail(q, v, x, alpha, p, acc, gm_i, gl_i, n_vis, logits_ptr,
                                                    noise_key, noise_offset, q_rows, g_ok, slots, in_seq,
                                                    tau, logits_len, DOT_PRECISION, KEEP_LOGITS, GUMBEL)
                m_i = m_new
        return m_i, l_i, acc, gm_i, gl_i, n_vis

    @triton.jit
    def _quant_decode_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr,
        k2_ptr, v2_ptr, page_table2_ptr, seq_lens2_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr,
        logits_ptr, key_ptr, temp_ptr, out_ptr,
        scale, max_pages, max_pages2, num_splits, chunk, logits_len,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_F32: tl.constexpr,
        V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_F32: tl.constexpr,
        HAS2: tl.constexpr, K2_BITS: tl.constexpr, K2_GROUP: tl.constexpr, K2_F32: tl.constexpr,
        V2_BITS: tl.constexpr, V2_GROUP: tl.constexpr, V2_F32: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        ONE_SPLIT: tl.constexpr, KEEP_LOGITS: tl.constexpr, GUMBEL: tl.constexpr, HAS_TEMP: tl.constexpr,
        LOADS: tl.constexpr, LOADS2: tl.constexpr, HALF: tl.constexpr, HALF2: tl.constexpr,
        G_P2: tl.constexpr,
    ):
        """One program per (sequence, KV head, split): the split's share of the sequence's slots, the first
        region's then (``HAS2``) the second's, laid end to end; the group's query heads together (one
        ``tl.dot`` per tile). One split normalises and writes the output; several write the partials (and,
        ``KEEP_LOGITS``, both regions' logits: the second's after the first's ``max_pages * S`` slots of
        each scratch row) that ``paged_attention.reduce_splits`` combines and scores, as for native pages.
        ``LOADS``/``LOADS2``: how each region's loop reads its rows (:func:`_attend_region`,
        :func:`_loads`)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G  # BLOCK_G >= 16 pads small groups so tl.dot has a legal shape
        d_ok = offs_d < D
        q_rows = (b * HKV + kvh) * G + offs_g
        q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
        tau = 1.0
        noise_key = tl.arange(0, G_P2)  # gumbel: the group's query heads' noise keys ([B, Hq] int32)
        if GUMBEL:
            if HAS_TEMP:
                tau = tl.load(temp_ptr)
            noise_key = tl.load(key_ptr + (b * HKV + kvh) * G + noise_key, mask=noise_key < G, other=0)
        len1 = tl.load(seq_lens_ptr + b)
        total = len1
        if HAS2:
            total += tl.load(seq_lens2_ptr + b)
        start = split * chunk
        end = tl.minimum(start + chunk, total)
        m_i = tl.full([BLOCK_G], _NEG_BIG_C, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        gm_i = tl.full([BLOCK_G], _NEG_BIG_C, tl.float32)
        gl_i = tl.zeros([BLOCK_G], tl.float32)
        n_vis = tl.zeros([BLOCK_N], tl.int32)
        m_i, l_i, acc, gm_i, gl_i, n_vis = _attend_region(
            q, m_i, l_i, acc, gm_i, gl_i, n_vis, k_ptr, v_ptr, page_table_ptr, logits_ptr, noise_key, 0,
            q_rows, g_ok, b, kvh, start, tl.minimum(end, len1), scale, tau, max_pages, logits_len, offs_d,
            d_ok, HKV, D, S, K_BITS, K_GROUP, K_F32, V_BITS, V_GROUP, V_F32, BLOCK_N, BLOCK_D, DOT_PRECISION,
            KEEP_LOGITS, GUMBEL, LOADS, HALF)
        if HAS2:  # the second region's slots follow the first's: [len1, total) of the sequence
            # KEEP_LOGITS: its logits go to each scratch row after the first region's max_pages * S slots,
            # and n_vis counts its slots too; Gumbel's noise takes the sequence's logical slot, len1 + j.
            m_i, l_i, acc, gm_i, gl_i, n_vis = _attend_region(
                q, m_i, l_i, acc, gm_i, gl_i, n_vis, k2_ptr, v2_ptr, page_table2_ptr,
                logits_ptr + max_pages * S, noise_key, len1, q_rows, g_ok, b, kvh,
                tl.maximum(start, len1) - len1, end - len1, scale, tau, max_pages2, logits_len, offs_d, d_ok,
                HKV, D, S, K2_BITS, K2_GROUP, K2_F32, V2_BITS, V2_GROUP, V2_F32, BLOCK_N, BLOCK_D,
                DOT_PRECISION, KEEP_LOGITS, GUMBEL, LOADS2, HALF2)
        _finish_split(out_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr, m_i, l_i, acc, gm_i, gl_i,
                      n_vis, q_rows, g_ok, offs_d, d_ok, b, kvh, split, num_splits, HKV, D, ONE_SPLIT,
                      KEEP_LOGITS, GUMBEL)


class Region(NamedTuple):
    """One more set of pages a sequence attends to, beside the first (a cache holding tokens in two formats:
    KIVI's unquantized recent tokens, ZipCache's salient ones at more bits, MiKV's kept ones unquantized).
    ``k_pages``/``v_pages`` ``[P2, S, Hkv, W]``: packed rows of ``k_format``/``v_format``, or float rows
    ``[P2, S, Hkv, D]`` when the format is ``None``; ``page_table [B, M2]`` int32, ``seq_lens [B]`` int32.
    The page size ``S`` and the KV heads are the first region's. ``score [P2, S, Hkv]`` float32: the region's
    slot scores, updated in place by a call's score update (:class:`ScoreUpdate`, whose ``score`` holds the
    first region's) from the one softmax over both regions; required with a score update."""

    k_pages: Tensor
    v_pages: Tensor
    page_table: Tensor
    seq_lens: Tensor
    k_format: QuantFormat | None = None
    v_format: QuantFormat | None = None
    score: Tensor | None = None


def _rows(pages: Tensor, head_dim: int, fmt: QuantFormat | None) -> Tensor:
    """Float32 rows of a pool: dequantized, or the float rows themselves."""
    return pages.float() if fmt is None else dequantize_rows(pages, head_dim, fmt)


def quant_decode_attention_ref(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                               seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                               v_format: QuantFormat, second: Region | None = None,
                               scores: ScoreUpdate | None = None) -> Tensor:
    """Reference: each sequence's rows of every region dequantized and laid end to end, then plain softmax
    attention in float32, one sequence at a time. With ``scores``: one region, the native reference on the
    dequantized pool, which updates the scores in place; two regions, :func:`_scored_two_ref`."""
    batch, n_q, d = q.shape
    if scores is not None and scores.mode != "none" and scores.score is not None:
        if second is not None:
            return _scored_two_ref(q, Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format,
                                             scores.score), second, scale, scores)
        return paged_decode_attention_ref(q, _rows(k_pages, d, k_format), _rows(v_pages, d, v_format),
                                          page_table, seq_lens, scale=scale, scores=scores)
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


def _scored_two_ref(q: Tensor, first: Region, second: Region, scale: float, scores: ScoreUpdate) -> Tensor:
    """The two-region score update, plainly: per sequence, both regions' rows dequantized and laid end to end
    as one page of ``len1 + len2`` slots with their scores, :func:`paged_decode_attention_ref` with the score
    update on that one-page pool, and the updated scores written back to their regions' slots (a region
    without ``score``: its slots count, their scores are dropped). Gumbel's noise follows the slots laid end
    to end: the second region's slot ``j`` takes the sequence's logical slot ``len1 + j``."""
    batch, _, d = q.shape
    out = torch.zeros(q.shape, dtype=q.dtype)
    for b in range(batch):
        places, ks, vs, olds = [], [], [], []
        for r in (first, second):
            S = r.k_pages.shape[1]
            score = r.score if r.score is not None else torch.zeros(r.k_pages.shape[:3])
            for j in range(int(r.seq_lens[b])):
                p, o = int(r.page_table[b, j // S]), j % S
                places.append((score, p, o))
                ks.append(_rows(r.k_pages[p, o], d, r.k_format))  # [Hkv, D]
                vs.append(_rows(r.v_pages[p, o], d, r.v_format))
                olds.append(score[p, o])  # [Hkv]
        if not places:
            continue
        n = len(places)
        one = torch.stack(olds)[None].clone()  # [1, n, Hkv]: one page of n slots
        table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
        key = None if scores.gumbel_key is None else scores.gumbel_key[b:b + 1]  # sequence b's noise keys
        out[b] = paged_decode_attention_ref(q[b:b + 1], torch.stack(ks)[None], torch.stack(vs)[None], table,
                                            lens, scale=scale,
                                            scores=scores._replace(score=one, gumbel_key=key))[0]
        for j, (score, p, o) in enumerate(places):
            score[p, o] = one[0, j]
    return out


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
                                 v_format: QuantFormat, second: Region | None = None,
                                 scores: ScoreUpdate | None = None) -> Tensor:
    """Batched torch path (no input checks): gathers and dequantizes the pages the longest sequence of each
    region covers (one host read each), then one masked softmax over both regions' slots. With ``scores``:
    :func:`_scored_torch` (one region), :func:`_scored_two_torch` (two)."""
    batch, n_q, d = q.shape
    if scores is not None and scores.mode != "none" and scores.score is not None and batch:
        if second is not None:
            return _scored_two_torch(q, Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format,
                                               scores.score), second, scale, scores)
        return _scored_torch(q, k_pages, v_pages, page_table, seq_lens, scale, k_format, v_format, scores)
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


def _scored_torch(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, seq_lens: Tensor,
                  scale: float, k_format: QuantFormat, v_format: QuantFormat, scores: ScoreUpdate) -> Tensor:
    """The pages each sequence holds, dequantized into a small float pool (plus one empty page for the
    table's unused entries) with their scores, through the native torch path and its score update; the
    updated scores written back to their pages (each page is one sequence's: no duplicates)."""
    S = k_pages.shape[1]
    width = int(seq_lens.max())
    if width == 0:
        return torch.zeros_like(q)
    n_pages = -(-width // S)
    own = torch.arange(n_pages, device=q.device) < (seq_lens[:, None] + S - 1) // S  # [B, n_pages]
    pages = page_table[:, :n_pages].long()[own]  # [V] the pool's pages in use
    table = torch.full(own.shape, pages.numel(), dtype=torch.int32, device=q.device)  # unused: the empty page
    table[own] = torch.arange(pages.numel(), dtype=torch.int32, device=q.device)

    def small(pool: Tensor, fmt: QuantFormat | None) -> Tensor:
        rows = _rows(pool.index_select(0, pages), q.shape[-1], fmt)
        return torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])])

    score = torch.cat([scores.score[pages], scores.score.new_zeros(1, *scores.score.shape[1:])])
    out = paged_decode_attention_torch(q, small(k_pages, k_format), small(v_pages, v_format), table, seq_lens,
                                       scale=scale, scores=scores._replace(score=score))
    scores.score[pages] = score[:-1]
    return out


def _scored_two_torch(q: Tensor, first: Region, second: Region, scale: float, scores: ScoreUpdate) -> Tensor:
    """The two-region score update, batched: each region's pages the longest sequence covers gathered and
    dequantized (:func:`_gather`) with their scores, each sequence's slots of both regions laid end to end in
    a contiguous pool ``[B, W, Hkv, D]`` (``W`` the longest ``len1 + len2``; sequence ``b`` is page ``b``),
    the native torch path with the score update on it, and the updated scores written back to their
    regions' slots (each valid slot is one pool slot: no duplicates); Gumbel's noise by the slots laid end to
    end, as the kernel hashes it."""
    batch, _, d = q.shape
    lens1, lens2 = first.seq_lens.long(), second.seq_lens.long()
    width = int((lens1 + lens2).max())
    if width == 0:
        return torch.zeros_like(q)
    dev, n_kv = q.device, first.k_pages.shape[2]
    parts = []  # per region: k, v [B, N, Hkv, D], valid [B, N], flat score rows [B, N], score [P * S, Hkv]
    for r in (first, second):
        S, longest = r.k_pages.shape[1], int(r.seq_lens.max())
        score = r.score if r.score is not None else torch.zeros(r.k_pages.shape[:3], device=dev)
        if longest == 0:  # nothing to gather (the table may have no column)
            k = torch.zeros(batch, 0, n_kv, d, device=dev)
            parts.append((k, k, torch.zeros(batch, 0, dtype=torch.bool, device=dev),
                          torch.zeros(batch, 0, dtype=torch.long, device=dev), score.view(-1, n_kv)))
            continue
        k, v, valid = _gather(r, longest, d)
        pages = r.page_table[:, :k.shape[1] // S].long().clamp(0, r.k_pages.shape[0] - 1)
        rows = (pages[:, :, None] * S + torch.arange(S, device=dev)).flatten(1)  # [B, N] into [P * S]
        parts.append((k, v, valid, rows, score.view(-1, n_kv)))
    (k1, v1, valid1, rows1, flat1), (k2, v2, valid2, rows2, flat2) = parts
    n1 = k1.shape[1]
    # Slot j of sequence b's pool: the first region's slot j below len1, else the second's j - len1 (at
    # n1 + j - len1 of the regions' slots laid side by side); past len1 + len2 anything (masked).
    j = torch.arange(width, device=dev)[None, :]
    at = torch.where(j < lens1[:, None], j, n1 + j - lens1[:, None]).clamp(max=n1 + k2.shape[1] - 1)
    seq = torch.arange(batch, device=dev)[:, None]
    k, v = torch.cat([k1, k2], dim=1)[seq, at], torch.cat([v1, v2], dim=1)[seq, at]  # [B, W, Hkv, D]
    score = torch.cat([flat1[rows1], flat2[rows2]], dim=1)[seq, at]  # [B, W, Hkv]
    table = torch.arange(batch, dtype=torch.int32, device=dev)[:, None]  # sequence b: page b of W slots
    out = paged_decode_attention_torch(q, k, v, table, (lens1 + lens2).to(torch.int32), scale=scale,
                                       scores=scores._replace(score=score))
    # Back to the regions: the first's slot i sits at i, the second's at len1 + i.
    pos1 = torch.arange(n1, device=dev).expand(batch, n1)
    pos2 = lens1[:, None] + torch.arange(k2.shape[1], device=dev)
    for flat, rows, valid, pos in ((flat1, rows1, valid1, pos1), (flat2, rows2, valid2, pos2)):
        new = score[seq, pos.clamp(max=width - 1)]  # [B, N, Hkv]
        flat[rows[valid]] = new[valid]
    return out


#: The largest bit width whose packed regions the launcher prefetches by hand (``LOADS == 2``, see
#: ``_attend_region``; :func:`_loads` says where it can): 8, every width. On an H200 (B64/4k and B8/4k,
#: ``bench/results/nvidia-h200-2026-11-28/run1``) prefetching decoded 4-bit pages in 367 us against 418 us
#: without and 8-bit pages in 415 us against 446 us (B8: 63.6 / 73.2 us, 75.6 / 80.8 us), bit for bit the
#: same 8-bit outputs; and on that GPU the loop without it failed the tests' reference (two Hypothesis
#: examples: 2-bit keys at head dim 16, pinned in tests/test_quant_attention.py) where every prefetched
#: variant passed, so only gathered rows (other head dims) and float rows still take it. (Run 10 had 8-bit
#: pages slower prefetched, 554 us against 415 us at 64/4/2, before the tuned 32/4/3.) 0 turns it off, 4
#: limits it to 2- and 4-bit pages.
#: Each value is its own compiled variant: set it before a call (a captured CUDA graph keeps its kernel),
#: or with :func:`prefetch_tiles`.
PREFETCH_TILES = 8


@contextlib.contextmanager
def _setting(name: str, value: object) -> Iterator[None]:
    """This module's launch setting ``name`` (:data:`PREFETCH_TILES`, :data:`MAX_REGISTERS`,
    :data:`HALF_ROWS`) set to ``value`` inside the block, restored after it (also after an error); the
    public context managers check the value first."""
    old = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = old


@contextlib.contextmanager
def prefetch_tiles(bits: int) -> Iterator[None]:
    """:data:`PREFETCH_TILES` set to ``bits`` inside the block (0: off, 8: every packed width)."""
    if bits not in (0, 2, 4, 8) or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r}: the largest bit width to prefetch, one of 0 (none), 2, 4, 8")
    with _setting("PREFETCH_TILES", bits):
        yield


def _loads(k_pages: Tensor, v_pages: Tensor, k_format: QuantFormat | None, v_format: QuantFormat | None,
           head_dim: int) -> int:
    """How a region's kernel loop reads its rows (``_attend_region``'s ``LOADS``): 2, its tiles prefetched by
    hand; 1, as int32 words in each step; 0, code bytes (or float rows). Words need K and V packed, a
    power-of-two head dim >= 16 (contiguous code runs, rows of a multiple of 4 bytes) and pools starting on 4
    bytes; prefetching also needs both widths at most :data:`PREFETCH_TILES`. Float rows feed the products
    directly, and Triton's pipeliner already turns their loads into asynchronous copies to shared memory;
    gathered rows (other head dims) would carry a code byte and two parameters per channel in registers.
    0 gathers each channel's code byte (``_dequant_rows``): other head dims, pools off 4 bytes, a region of
    one packed and one float pool."""
    if (k_format is None or v_format is None or head_dim != triton.next_power_of_2(head_dim) or head_dim < 16
            or k_pages.data_ptr() % 4 or v_pages.data_ptr() % 4):
        return 0
    return 2 if max(k_format.bits, v_format.bits) <= PREFETCH_TILES else 1


#: Whether 16-bit queries multiply float16 rows (``_attend_region``'s ``HALF``, :func:`_half`): each code
#: becomes a float16 with one integer operation per two codes and is scaled in packed float16 arithmetic
#: (:func:`_half_codes`), where the float32 path converts each code to float32, multiplies and adds in
#: float32 and rounds to the query's dtype. Not yet timed on a GPU (``bench/gpu.py``'s quant stage times
#: both); statically, sm_90, B64/4k 4-bit: ``bench/sass.py int4/prefetch`` against ``int4/prefetch/f32``.
#: Each value is its own compiled variant (:func:`half_rows` sets it for a block).
HALF_ROWS = True

#: The kernel's register ceiling per thread (``maxnreg``). Compiled for sm_90 at the default 4 warps, the
#: float16 rows with the fused score update take 137 registers unbounded, which leaves room for three
#: programs per SM where 128 leave four (B64 x 8 KV heads = 512 programs on an H200's 132 SMs: one wave at
#: four, two at three); at 128 they do not spill (``bench/sass.py int4+h2o/prefetch``: no local memory).
MAX_REGISTERS = 128


def _register_ceiling(num_warps: int) -> int:
    """``maxnreg`` at ``num_warps`` warps a program: :data:`MAX_REGISTERS` from 4 warps up; under 4 the same
    registers per program (each thread then holds more of the tile: at 2 warps, block 32, the 4-bit decode
    takes 167 registers and spills 144 bytes at 128; sm_90, ``bench/sass.py``), at most 255."""
    return MAX_REGISTERS if num_warps >= 4 else min(255, MAX_REGISTERS * 4 // num_warps)


@contextlib.contextmanager
def max_registers(n: int) -> Iterator[None]:
    """:data:`MAX_REGISTERS` set to ``n`` inside the block (a compiled variant per value; under 128 the
    kernel spills: ``bench/sass.py``). For ``bench/gpu.py``'s occupancy probe: at batch 64 the launcher's
    one split gives 512 programs, all resident at four per SM; more programs per SM need both more splits
    and fewer registers."""
    if isinstance(n, bool) or not isinstance(n, int) or not 24 <= n <= 255:
        raise ValueError(f"n={n!r}: registers per thread, an integer in [24, 255] (the default is 128)")
    with _setting("MAX_REGISTERS", n):
        yield


@contextlib.contextmanager
def half_rows(on: bool) -> Iterator[None]:
    """:data:`HALF_ROWS` set to ``on`` inside the block."""
    if not isinstance(on, bool):
        raise ValueError(f"on={on!r}: True (float16 rows for 16-bit queries) or False (float32 rows)")
    with _setting("HALF_ROWS", on):
        yield


def _half(q: Tensor, k_format: QuantFormat | None, v_format: QuantFormat | None, loads: int) -> bool:
    """Whether a region's rows are decoded to float16 and multiplied in float16 (``HALF``): with
    :data:`HALF_ROWS`, a float16 or bfloat16 query, rows read as words (``loads``, :func:`_loads`, > 0),
    and float16 scales and zero points in both formats, which float16 arithmetic then uses exactly: each
    row is ``code * scale + zero`` rounded once to float16 (a fused multiply-add on the GPU), what the float32
    path gives float16 queries, and closer than the bfloat16 rounding it gives bfloat16 ones (their query
    enters the float16 products exactly, :func:`_half_query`, and their probabilities are rounded to
    float16, not bfloat16). float32 parameters keep the float32 path (their rows may exceed float16's
    range)."""
    return (HALF_ROWS and q.dtype in (torch.float16, torch.bfloat16)
            and loads > 0 and k_format is not None and v_format is not None
            and k_format.param_dtype == torch.float16 and v_format.param_dtype == torch.float16)


def _check_start(name: str, pages: Tensor, fmt: QuantFormat | None) -> None:
    """A packed pool must start on a multiple of its parameters' size: the kernel reads each row's float16
    or float32 scales and zero points as such, and a misaligned read is a CUDA error (``misaligned
    address``, which ends the process's CUDA context) on the GPU. Rows keep the alignment
    (:meth:`QuantFormat.check`); a pool that ``torch`` allocated whole starts on 256 bytes, so only a view
    into a byte buffer at an odd offset can fail this. Checked in the launcher, on real tensors (the op's
    checks also run traced)."""
    if fmt is None:
        return
    size = torch.empty(0, dtype=fmt.param_dtype).element_size()
    if pages.data_ptr() % size:
        raise ValueError(f"{name} starts at address {pages.data_ptr():#x}, not a multiple of the {size}-byte "
                         f"{fmt.param_dtype} scales and zero points in its rows; allocate the pool whole "
                         "(kvkernels.quant.quantize_rows, torch.empty) or pass pages.clone()")


def _launch_format(fmt: QuantFormat | None) -> tuple[int, int, bool]:
    """``(BITS, GROUP, PARAM_F32)`` of a region's pool for the kernel; ``BITS = 0``: float rows."""
    if fmt is None:
        return 0, 1, False
    return fmt.bits, fmt.group, fmt.param_dtype == torch.float32


def quant_decode_attention_triton(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                  seq_lens: Tensor, *, scale: float, k_format: QuantFormat,
                                  v_format: QuantFormat, second: Region | None = None,
                                  scores: ScoreUpdate | None = None, num_splits: int = 0) -> Tensor:
    """Triton launcher (no input checks but the pools' start, :func:`_check_start`): one program per
    (sequence, KV head, split); ``num_splits`` 0 picks the split count as for native pages (enough programs
    to fill the GPU twice)."""
    require_triton()
    batch, n_q, d = q.shape
    page_size, n_kv = k_pages.shape[1], k_pages.shape[2]
    for name, pool, fmt in (("k_pages", k_pages, k_format), ("v_pages", v_pages, v_format)) + (
            (("second.k_pages", second.k_pages, second.k_format),
             ("second.v_pages", second.v_pages, second.v_format)) if second is not None else ()):
        _check_start(name, pool, fmt)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = n_q // n_kv
    q = q.contiguous()
    two = second if second is not None else Region(k_pages, v_pages, page_table, seq_lens, k_format, v_format)
    cfg = launch_config("quant_decode", q.device)
    # tl.dot needs every dimension >= 16 on the GPU (the interpreter does not): head dims under 16 are padded
    # (and masked), as small groups are; they take _dequant_rows's per-channel path.
    block_n = cfg.block
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    # Static: the scratch shape never depends on the lengths' values (CUDA graphs).
    max_len = page_table.shape[1] * page_size + (two.page_table.shape[1] * page_size if second is not None
                                                 else 0)
    num_splits, chunk = _split_plan(batch, n_kv, max_len, block_n, q.device, num_splits)
    score, mode, _, gumbel_key, temperature = _NO_SCORES if scores is None else scores
    keep_logits = mode != "none" and score is not None  # both regions' slots (with a second region)
    gumbel = keep_logits and mode == "gumbel"
    one_split = num_splits == 1 and not keep_logits
    # The logits scratch holds each row's first-region slots, then (two regions) the second's.
    parts = _partials(q, n_kv, num_splits, max_len, one_split=one_split, keep_logits=keep_logits,
                      gumbel=gumbel)
    consts = dict(HKV=n_kv, G=group, D=d, S=page_size, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n)
    formats = [_launch_format(f) for f in (k_format, v_format, two.k_format, two.v_format)]
    loads = _loads(k_pages, v_pages, k_format, v_format, d)
    loads2 = _loads(two.k_pages, two.v_pages, two.k_format, two.v_format, d)
    launch(
        _quant_decode_kernel, (batch, n_kv, num_splits),
        q, k_pages, v_pages, page_table, seq_lens, two.k_pages, two.v_pages, two.page_table, two.seq_lens,
        parts.m, parts.l, parts.acc, parts.gm, parts.gl, parts.nvis, parts.logits,
        gumbel_key if gumbel else parts.dummy,
        parts.dummy if temperature is None else temperature, out,
        float(scale), page_table.shape[1], two.page_table.shape[1], num_splits, chunk, parts.logits.shape[-1],
        **{f"{name}_{what}": value for name, fmt in zip(("K", "V", "K2", "V2"), formats, strict=True)
           for what, value in zip(("BITS", "GROUP", "F32"), fmt, strict=True)},
        HAS2=second is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ONE_SPLIT=one_split, KEEP_LOGITS=keep_logits, GUMBEL=gumbel, HAS_TEMP=temperature is not None,
        LOADS=loads, LOADS2=loads2, HALF=_half(q, k_format, v_format, loads),
        HALF2=_half(q, two.k_format, two.v_format, loads2),
        G_P2=triton.next_power_of_2(group),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=_register_ceiling(cfg.num_warps),
        **consts,
    )
    if not one_split:
        # The second region's scores: updated by the same reduce launch (a region without scores still counts
        # in count_low's visible slots, its own scores dropped).
        score2 = None
        if keep_logits and second is not None and second.score is not None:
            score2 = SecondScores(second.score, second.page_table, second.seq_lens)
        reduce_splits(out, parts, num_splits, page_table, seq_lens, scores=scores if keep_logits else None,
                      slot_mask=None, mask_bit=1, num_warps=cfg.num_warps, second=score2, **consts)
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
        k2_pages, v2_pages, page_table2, seq_lens2 = second
        two = Region(k2_pages, v2_pages, page_table2, seq_lens2, _format_of(k2_bits, k2_group, k2_params),
                     _format_of(v2_bits, v2_group, v2_params))
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale,
                k_format=QuantFormat(k_bits, k_group, getattr(torch, k_params)),
                v_format=QuantFormat(v_bits, v_group, getattr(torch, v_params)), second=two)


@_quant_decode_op.register_fake
def _(q, k_pages, v_pages, page_table, seq_lens, scale, k_bits, k_group, k_params, v_bits, v_group,
      v_params, second, k2_bits, k2_group, k2_params, v2_bits, v2_group, v2_params):
    return torch.empty_like(q)


@torch.library.custom_op("kvkernels::quant_decode_attention_scored", mutates_args=("score",))
def _quant_decode_scored_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                            seq_lens: Tensor, scale: float, k_bits: int, k_group: int, k_params: str,
                            v_bits: int, v_group: int, v_params: str, score: Tensor, score_mode: str,
                            decay: float, gumbel_key: Tensor | None, temperature: Tensor | None) -> Tensor:
    """One region with the fused score update (``score`` updated in place): an op of its own, since inductor
    failed to lower one op holding both the second region's tensor list and a mutated tensor (torch 2.13).
    The ``scores`` bundle is flattened field by field, as for ``kvkernels::paged_decode_attention``, and no
    argument has a default (the same reason as there)."""
    impl = quant_decode_attention_triton if use_triton(q) else quant_decode_attention_torch
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale,
                k_format=QuantFormat(k_bits, k_group, getattr(torch, k_params)),
                v_format=QuantFormat(v_bits, v_group, getattr(torch, v_params)),
                scores=ScoreUpdate(score, score_mode, decay, gumbel_key, temperature))


@_quant_decode_scored_op.register_fake
def _(q, k_pages, v_pages, page_table, seq_lens, scale, k_bits, k_group, k_params, v_bits, v_group,
      v_params, score, score_mode, decay, gumbel_key, temperature):
    return torch.empty_like(q)


@torch.library.custom_op("kvkernels::quant_decode_attention_scored_two", mutates_args=("score2", "score"))
def _quant_decode_scored_two_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor,
                                seq_lens: Tensor, scale: float, k_bits: int, k_group: int, k_params: str,
                                v_bits: int, v_group: int, v_params: str, k2_pages: Tensor, v2_pages: Tensor,
                                page_table2: Tensor, seq_lens2: Tensor, k2_bits: int, k2_group: int,
                                k2_params: str, v2_bits: int, v2_group: int, v2_params: str, score2: Tensor,
                                score: Tensor, score_mode: str, decay: float, gumbel_key: Tensor | None,
                                temperature: Tensor | None) -> Tensor:
    """Two regions with the fused score update over both (``score`` the first region's, ``score2`` the
    second's, both updated in place): the second region's tensors as arguments of their own (k2_pages,
    v2_pages, page_table2, seq_lens2, its formats as bits / group / parameter dtype name, bits 0 for float
    rows, and score2), not a tensor list as in ``kvkernels::quant_decode_attention``, since inductor failed
    to lower one op holding both a tensor list and a mutated tensor (see
    ``kvkernels::quant_decode_attention_scored``). Then the ``scores`` bundle flattened field by field; no
    argument has a default."""
    impl = quant_decode_attention_triton if use_triton(q) else quant_decode_attention_torch
    second = Region(k2_pages, v2_pages, page_table2, seq_lens2, _format_of(k2_bits, k2_group, k2_params),
                    _format_of(v2_bits, v2_group, v2_params), score2)
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale,
                k_format=QuantFormat(k_bits, k_group, getattr(torch, k_params)),
                v_format=QuantFormat(v_bits, v_group, getattr(torch, v_params)), second=second,
                scores=ScoreUpdate(score, score_mode, decay, gumbel_key, temperature))


@_quant_decode_scored_two_op.register_fake
def _(q, k_pages, v_pages, page_table, seq_lens, scale, k_bits, k_group, k_params, v_bits, v_group,
      v_params, k2_pages, v2_pages, page_table2, seq_lens2, k2_bits, k2_group, k2_params, v2_bits, v2_group,
      v2_params, score2, score, score_mode, decay, gumbel_key, temperature):
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
                           scores: ScoreUpdate | None = None, validate: bool = True) -> Tensor:
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
    scores : :class:`kvkernels.paged_attention.ScoreUpdate`, optional
        The fused per-slot score update of the native decode (H2O's accumulated attention, Keyformer's
        Gumbel score, decayed and count modes), ``score [P, S, Hkv]`` of this pool updated in place from the
        attention over the dequantized rows. With ``second``: one update over both regions' slots from the
        one softmax (``count_low``'s threshold counts both), the second region's scores in ``second.score``
        (required); Gumbel's noise takes the sequence's logical slot, the second region's slot ``j`` at
        ``seq_lens[b] + j``.
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
        if second.score is not None:
            check_tensor("second.score", second.score, ndim=3, dtypes=(torch.float32,), device=q.device,
                         contiguous=True)
            check_shape("second.score", second.score, (p2, page_size, n_kv),
                        "[P2, S, Hkv] of the second pool")
        elif isinstance(scores, ScoreUpdate) and scores.mode != "none":
            raise ValueError(f"scores.mode={scores.mode!r} with a second region updates both regions' "
                             "scores: pass second.score ([P2, S, Hkv] float32, the second region's slot "
                             "scores), as Region(..., score=...)")
        extra = [second.k_pages, second.v_pages, second.page_table, second.seq_lens]
    check_scores(scores, q, (num_pages, page_size, n_kv))
    if scores is not None and scores.score is not None:  # (mode "none": a read-only call, the same op)
        if second is None:
            return torch.ops.kvkernels.quant_decode_attention_scored(
                q, k_pages, v_pages, page_table, seq_lens, float(scale), *_format_args(k_format),
                *_format_args(v_format), *scores)
        if second.score is not None:
            return torch.ops.kvkernels.quant_decode_attention_scored_two(
                q, k_pages, v_pages, page_table, seq_lens, float(scale), *_format_args(k_format),
                *_format_args(v_format), *extra, *_format_args(second.k_format),
                *_format_args(second.v_format), second.score, scores.score, scores.mode, float(scores.decay),
                scores.gumbel_key, scores.temperature)
    two = second if second is not None else Region(k_pages, v_pages, page_table, seq_lens)
    return torch.ops.kvkernels.quant_decode_attention(
        q, k_pages, v_pages, page_table, seq_lens, float(scale), *_format_args(k_format),
        *_format_args(v_format), extra, *_format_args(two.k_format), *_format_args(two.v_format))


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

COMPILE_AXES: dict[str, tuple] = {
    "dtype": (torch.float32, torch.float16, torch.bfloat16),
    "head_dim": (64, 128, 96, 8),  # 96: not a power of two; 8: under tl.dot's minimum of 16 (padded)
    "bits": (2, 4, 8),
    "group": (32, 64),
    "gqa": (1, 4, 8),
    "second": ("none", "float", "4bit"),  # a second region: none, float rows of q's dtype, 4-bit rows
    "splits": (1, 3),  # split-K partials and the shared reduce kernel
    # The fused score update (logits kept; gumbel's noised stats, its noise hashed in the kernel; count_low's
    # visible count). With a second region every mode scores both regions (their logits kept, the reduce
    # kernel's programs for the second region's slots).
    "score": ("none", "accumulate", "gumbel", "count_low"),
    "prefetch": (0, 8),  # PREFETCH_TILES: the loads a tile ahead by hand, off or for every width
    "half": (True, False),  # HALF_ROWS: float16 rows and products for 16-bit queries, or float32 rows
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls the Triton launcher on ``meta`` tensors with one
    configuration of :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    # The float16 rows at the H200 bench's setting (bfloat16 queries, head dim 128, prefetched), each width,
    # alone and with H2O's score update: the pairwise set reaches few of them (most of its float16 rows sit
    # where a head dim or a second region takes another loop).
    bench = [dict(dtype=torch.bfloat16, head_dim=128, bits=bits, group=32, gqa=4, prefetch=8, half=True,
                  score=score) for bits in (2, 4, 8) for score in ("none", "accumulate")]
    for cfg in [*covering(COMPILE_AXES, full=full), *bench]:
        label = "quant_decode_attention " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))


def _meta_launch(dtype: torch.dtype, head_dim: int, bits: int, group: int, gqa: int,
                 second: str = "none", splits: int = 1, score: str = "none", prefetch: int = 0,
                 half: bool = True) -> None:
    with prefetch_tiles(prefetch), half_rows(half):
        _meta_launch_one(dtype, head_dim, bits, group, gqa, second, splits, score)


def _meta_launch_one(dtype: torch.dtype, head_dim: int, bits: int, group: int, gqa: int, second: str,
                     splits: int, score: str) -> None:
    B, P, S, M, Hkv = 3, 40, 16, 12, 2
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    fmt = QuantFormat(bits, math.gcd(group, head_dim))
    pool = t(P, S, Hkv, fmt.row_bytes(head_dim), dt=torch.uint8)
    region = None
    if second != "none":
        fmt2 = None if second == "float" else QuantFormat(4, math.gcd(32, head_dim))
        width = head_dim if fmt2 is None else fmt2.row_bytes(head_dim)
        pool2 = t(P, S, Hkv, width, dt=dtype if fmt2 is None else torch.uint8)
        region = Region(pool2, pool2, t(B, M // 2, dt=torch.int32), t(B, dt=torch.int32), fmt2, fmt2,
                        t(P, S, Hkv, dt=torch.float32) if score != "none" else None)
    scores = None
    if score != "none":
        gumbel = score == "gumbel"
        scores = ScoreUpdate(t(P, S, Hkv, dt=torch.float32), score, 1.0,
                             t(B, Hkv * gqa, dt=torch.int32) if gumbel else None,
                             t(1, dt=torch.float32) if gumbel else None)
    quant_decode_attention_triton(t(B, Hkv * gqa, head_dim, dt=dtype), pool, pool, t(B, M, dt=torch.int32),
                                  t(B, dt=torch.int32), scale=head_dim ** -0.5, k_format=fmt, v_format=fmt,
                                  second=region, scores=scores, num_splits=splits)
