"""Ragged paged decode attention with a fused per-slot score update (docs/contract.md §2.1–§2.2).

One query token per sequence attends over that sequence's valid slots in the paged pool. Layout of this
file: the argument bundles (``Alibi``, ``ScoreUpdate``, ``Restore``), the Triton kernels, their launcher
``paged_decode_attention_triton``, the torch reference ``paged_decode_attention_ref`` (the test oracle),
the vectorised torch path ``paged_decode_attention_torch`` the op runs on CPU, the registered custom op
(flat schema) and the public op ``paged_decode_attention``. Only the public op and the bundles are
exported (``__all__``, and the package's); the three implementations take the public op's arguments
(bundles included, inputs assumed checked), so tests, benchmarks and ``compile_check`` call every variant
the way a user calls the op.

Kernel design
-------------
* ``_decode_partial_kernel``: one program per (sequence, KV head, split). It loads the ``G`` query heads of
  the group once and streams its split's K/V tiles through an online softmax, so each K/V byte is read
  once per group, not once per query head. It writes a partial (max, sum, unnormalised output) per query
  head and split. With one split and no score update (the launcher's choice when ``B * Hkv`` programs
  already fill the GPU) its (max, sum) are final: it writes ``out`` itself, and nothing else is launched.
* ``_decode_reduce_kernel`` (split-K or a score update): one program per (sequence and KV head, chunk of
  :data:`SCORE_CHUNK` slots). Every program combines the splits' (max, sum) into the global softmax
  normaliser (a few floats); chunk 0 also combines the partial outputs, a tile of splits at a time, and
  writes ``out``; with a score update each program then scores its chunk's slots as one tile
  (``_score_chunk``). Its loops are a few wide steps, never a sweep of narrow dependent ones: the kernel
  moves a few bytes a slot, and memory latency, not bandwidth, bounded the earlier form.

Why the score update is finished in the reduce step: a slot's contribution is the mean over the group of
``exp(x_g - max_g) / sum_g``, and the normaliser of head ``g`` is only known once every split is done.
The per-head factors differ, so a split cannot pre-combine its G logits into one number. The partial
kernel therefore keeps the fp32 logits of the group in a scratch ``[B, Hq, Lmax]`` (written once, read
once; Gumbel's noised, tempered logits, the noise hashed in the kernel from ``ScoreUpdate.gumbel_key``)
and the reduce kernel turns them into probabilities. That costs ``8 * G`` bytes per slot and KV
head on top of ``4 * D`` bytes of 16-bit K and V (about 6% at G=4, D=128), where recomputing the logits
would re-read K (50%). With ``score_mode="none"`` no scratch is allocated or touched.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from kvkernels import _checks
from kvkernels._modes import SCORE_MODES, update_scores_ref
from kvkernels._noise import gumbel_noise_keyed
from kvkernels._triton import HAS_TRITON, INTERPRET, LOG2E_C, covering, launch, require_triton, use_triton
from kvkernels.tuning import launch_config

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kvkernels._noise import gumbel_keyed_tl
else:  # pragma: no cover - the CPU path never needs triton
    triton = None
    tl = None

# Running max starts finite so that a block with no visible slot gives exp(-inf - m) = 0 rather than NaN;
# no real logit gets near it.
_NEG_BIG = -1e30
_MODE_IDS = {name: i for i, name in enumerate(SCORE_MODES)}  # none=0 accumulate=1 gumbel=2 decay=3 ...

__all__ = ["Alibi", "Restore", "ScoreUpdate", "paged_decode_attention"]


# Argument bundles. NamedTuples, not dataclasses: immutable, and torch.compile(fullgraph=True) traces their
# construction and field reads (the models' compiled decode step builds them) without a graph break.
class Alibi(NamedTuple):
    """ALiBi: adds ``slopes[h] * (slot_pos - q_pos)`` (<= 0) to the logits of query head ``h``.

    ``slopes`` [Hq] float32; ``slot_pos`` [P, S, Hkv] int32, the **original** position of each pool slot
    (so attention over a compacted cache equals attention over the full cache restricted to the kept
    tokens); ``q_pos`` [B] int32, the position of each sequence's query.
    """

    slopes: torch.Tensor
    slot_pos: torch.Tensor
    q_pos: torch.Tensor


class ScoreUpdate(NamedTuple):
    """The fused per-slot score update (docs/contract.md §2.2) of visible valid slots.

    ``score`` [P, S, Hkv] float32, updated **in place**; ``mode`` one of ``SCORE_MODES`` (``"none"``
    passes the tensor without touching it); ``decay`` is lambda for ``"decay"``; ``gumbel_key`` [B, Hq]
    int32 is required for ``"gumbel"``: the noise of query head ``h`` on logical slot ``j`` of sequence
    ``b`` is ``kvkernels.gumbel_noise_keyed(gumbel_key, j + 1)[b, h, j]``, computed by the kernel where it
    is used (a cache passes fresh keys every step, ``kvkernels.decode_keys``); its ``temperature`` is a [1]
    float32 tensor (a tensor, so a changing tau never recompiles a compiled step; None means 1.0).
    """

    score: torch.Tensor
    mode: str = "accumulate"
    decay: float = 1.0
    gumbel_key: torch.Tensor | None = None
    temperature: torch.Tensor | None = None


class Restore(NamedTuple):
    """MiniCache restore of a merged layer pair's shared pages.

    ``k_scale``, ``v_scale`` [P, S, Hkv] float32: per-slot magnitudes, keys are ``k_pages * k_scale``,
    values likewise. ``slot_mask`` [P, S, Hkv] uint8: a slot is visible only if
    ``slot_mask & mask_bit != 0`` (``mask_bit`` in [1, 255]); invisible slots get no probability, no score
    update and do not count in ``n_valid``.
    """

    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    slot_mask: torch.Tensor | None = None
    mask_bit: int = 1


# What an absent bundle unpacks to: no restore; no score tensor, mode "none".
_NO_RESTORE = Restore()
_NO_SCORES: tuple[None, str, float, None, None] = (None, "none", 1.0, None, None)


if HAS_TRITON:
    _NEG_BIG_C = tl.constexpr(_NEG_BIG)  # jit code may only read globals that are constexpr

    @triton.jit
    def _decode_partial_kernel(
        q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr,
        alibi_ptr, slot_pos_ptr, q_pos_ptr, k_scale_ptr, v_scale_ptr, slot_mask_ptr, key_ptr, temp_ptr,
        m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr, logits_ptr, out_ptr, score_ptr,
        scale, mask_bit, decay, max_pages, logits_len, num_splits, chunk,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_KSCALE: tl.constexpr, HAS_VSCALE: tl.constexpr, HAS_MASK: tl.constexpr,
        KEEP_LOGITS: tl.constexpr, GUMBEL: tl.constexpr, HAS_TEMP: tl.constexpr, DOT_PRECISION: tl.constexpr,
        ONE_SPLIT: tl.constexpr, SCORE_MODE: tl.constexpr, G_P2: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < G  # BLOCK_G >= 16 pads small groups so tl.dot has a legal shape
        d_ok = offs_d < D  # BLOCK_D is D rounded up to a power of two
        q_rows = (b * HKV + kvh) * G + offs_g  # [BLOCK_G] row of q / out / stats for each head of the group

        seq_len = tl.load(seq_lens_ptr + b)
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)

        q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_G, BLOCK_D]
        if HAS_ALIBI:
            slopes = tl.load(alibi_ptr + kvh * G + offs_g, mask=g_ok, other=0.0)  # [BLOCK_G]
            q_pos = tl.load(q_pos_ptr + b)
        tau = 1.0
        noise_key = tl.arange(0, G_P2)  # gumbel: the group's query heads' noise keys ([B, Hq] int32)
        if GUMBEL:
            if HAS_TEMP:
                tau = tl.load(temp_ptr)
            noise_key = tl.load(key_ptr + (b * HKV + kvh) * G + noise_key, mask=noise_key < G, other=0)

        m_i = tl.full([BLOCK_G], _NEG_BIG_C, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        gm_i = tl.full([BLOCK_G], _NEG_BIG_C, tl.float32)
        gl_i = tl.zeros([BLOCK_G], tl.float32)
        n_vis = tl.zeros([BLOCK_N], tl.int32)

        for n0 in range(start, end, BLOCK_N):
            slots = n0 + offs_n  # [BLOCK_N] logical slot index within the sequence
            in_seq = slots < end
            page = tl.load(page_table_ptr + b * max_pages + slots // S, mask=in_seq, other=0).to(tl.int64)
            row = (page * S + slots % S) * HKV + kvh  # [BLOCK_N] index into [P, S, Hkv] tensors
            kv_mask = in_seq[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D] tile
            x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            if HAS_KSCALE:
                x = x * tl.load(k_scale_ptr + row, mask=in_seq, other=1.0)[None, :]
            if HAS_ALIBI:
                pos = tl.load(slot_pos_ptr + row, mask=in_seq, other=0)
                x = x + slopes[:, None] * (pos - q_pos).to(tl.float32)[None, :]
            visible = in_seq
            if HAS_MASK:
                bits = tl.load(slot_mask_ptr + row, mask=in_seq, other=0).to(tl.int32)
                visible = visible & ((bits & mask_bit) != 0)
            x = tl.where(visible[None, :], x, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            # exp as exp2 of a multiply-add (one MUFU.EX2 each; tl.exp adds a range fix-up per value)
            alpha = tl.exp2((m_i - m_new) * LOG2E_C)
            p = tl.exp2(x * LOG2E_C - (m_new * LOG2E_C)[:, None])  # [BLOCK_G, BLOCK_N], 0 on invisible
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D] tile
            if HAS_VSCALE:
                p = p * tl.load(v_scale_ptr + row, mask=in_seq, other=0.0)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

            if KEEP_LOGITS:
                gm_i, gl_i, n_vis = _keep_logits(x, gm_i, gl_i, n_vis, logits_ptr, noise_key, 0, q_rows, g_ok,
                                                 slots, in_seq, visible, tau, logits_len, BLOCK_G, BLOCK_N,
                                                 G_P2, GUMBEL)

        _finish_split(out_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr, m_i, l_i, acc, gm_i, gl_i,
                      n_vis, q_rows, g_ok, offs_d, d_ok, b, kvh, split, num_splits, HKV, D, ONE_SPLIT,
                      KEEP_LOGITS, GUMBEL)

    @triton.jit
    def _keep_logits(x, gm_i, gl_i, n_vis, logits_ptr, noise_key, noise_offset, q_rows, g_ok, slots, in_seq,
                     visible, tau, logits_len, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                     G_P2: tl.constexpr, GUMBEL: tl.constexpr):
        """``KEEP_LOGITS``: a tile's logits ``x [BLOCK_G, BLOCK_N]`` (``-inf`` on invisible slots) to the
        scratch by slot for the reduce kernel's score update, and the visible count. ``GUMBEL``: the
        noised, tempered logits ``(x + G) / tau`` instead, the noise hashed here from each head's
        ``noise_key`` and the sequence's logical slot ``noise_offset + slots`` (``gumbel_keyed_tl``; a
        second region's slots follow the first's), with their running max and sum (``gm_i``, ``gl_i``).
        Shared with :mod:`kvkernels.quant_attention`."""
        kept = x
        if GUMBEL:
            # The noise of the group's G_P2 (G rounded up to a power of two) heads only, not of the BLOCK_G
            # rows the tensor-core tile pads a small group to: the padded rows get copies, never used.
            noise = gumbel_keyed_tl(noise_key[:, None], (noise_offset + slots)[None, :])  # [G_P2, BLOCK_N]
            if G_P2 < BLOCK_G:
                noise = tl.reshape(tl.broadcast_to(noise[None, :, :], (BLOCK_G // G_P2, G_P2, BLOCK_N)),
                                   (BLOCK_G, BLOCK_N))
            kept = (x + noise) / tau  # -inf stays -inf
            gm_new = tl.maximum(gm_i, tl.max(kept, axis=1))
            gl_i = gl_i * tl.exp(gm_i - gm_new) + tl.sum(tl.exp(kept - gm_new[:, None]), axis=1)
            gm_i = gm_new
        tl.store(logits_ptr + q_rows[:, None] * logits_len + slots[None, :], kept,
                 mask=g_ok[:, None] & in_seq[None, :])
        n_vis += visible.to(tl.int32)
        return gm_i, gl_i, n_vis

    @triton.jit
    def _finish_split(out_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr, m_i, l_i, acc, gm_i, gl_i,
                      n_vis, q_rows, g_ok, offs_d, d_ok, b, kvh, split, num_splits,
                      HKV: tl.constexpr, D: tl.constexpr, ONE_SPLIT: tl.constexpr, KEEP_LOGITS: tl.constexpr,
                      GUMBEL: tl.constexpr):
        """The end of a partial program (shared with ``kvkernels.quant_attention``). ``ONE_SPLIT``: the whole
        sequence was this program's and nothing is scored (the launcher picks this only without a score
        update), so its (max, sum) are final: it normalises itself, with no partials written and no second
        launch. Otherwise it writes its split's partials (and, ``KEEP_LOGITS``, the visible count and
        gumbel's noised stats) for the reduce kernel."""
        if ONE_SPLIT:
            inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # 0 for an empty sequence
            tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :],
                     (acc * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            stat = q_rows * num_splits + split  # [BLOCK_G] index into [B, Hq, splits]
            tl.store(m_ptr + stat, m_i, mask=g_ok)
            tl.store(l_ptr + stat, l_i, mask=g_ok)
            tl.store(acc_ptr + stat[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
            if KEEP_LOGITS:
                tl.store(nvis_ptr + (b * HKV + kvh) * num_splits + split, tl.sum(n_vis, axis=0))
                if GUMBEL:
                    tl.store(gm_ptr + stat, gm_i, mask=g_ok)
                    tl.store(gl_ptr + stat, gl_i, mask=g_ok)

    @triton.jit
    def _combine_stats(m_ptr, l_ptr, q_rows, g_ok, num_splits, BLOCK_SPLITS: tl.constexpr):
        """Global (max, 1 / sum) per query head from the per-split partials; 1/sum = 0 for an empty row."""
        offs_s = tl.arange(0, BLOCK_SPLITS)
        idx = q_rows[:, None] * num_splits + offs_s[None, :]  # [BLOCK_G, BLOCK_SPLITS]
        ok = g_ok[:, None] & (offs_s[None, :] < num_splits)
        m = tl.load(m_ptr + idx, mask=ok, other=_NEG_BIG_C)
        l = tl.load(l_ptr + idx, mask=ok, other=0.0)
        m_max = tl.max(m, axis=1)
        l_sum = tl.sum(l * tl.exp(m - m_max[:, None]), axis=1)
        inv_l = tl.where(l_sum > 0, 1.0 / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
        return m_max, inv_l

    @triton.jit
    def _decode_reduce_kernel(
        out_ptr, m_ptr, l_ptr, acc_ptr, gm_ptr, gl_ptr, nvis_ptr, logits_ptr,
        score_ptr, page_table_ptr, seq_lens_ptr, slot_mask_ptr, score2_ptr, page_table2_ptr, seq_lens2_ptr,
        mask_bit, decay, max_pages, logits_len, num_splits, max_pages2, n_update1,
        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
        SPLIT_TILE: tl.constexpr, SCORE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, HAS2: tl.constexpr,
    ):
        """One program per (sequence and KV head, chunk): chunk 0 writes ``out``; with a score update each
        program scores one chunk of ``BLOCK_N`` slots in one tile. ``HAS2``
        (:mod:`kvkernels.quant_attention`'s two regions under one softmax): the programs ``chunk >=
        n_update1`` score the second region's chunks, whose logits the partial kernel kept after the first
        region's ``max_pages * S`` slots of each row of the scratch, with the second region's scores and page
        table (no slot mask).

        Every loop here is short (a few iterations of wide, independent loads): this kernel moves a few bytes
        per slot, so a loop of dependent narrow steps leaves it waiting on memory latency. The H200 run of
        2026-11-28 (run 4) timed the earlier form, a 256-slot chunk in tiles of 64 and one split at a time,
        at 14 us per call at B8/4k and 90 us at B64/4k, where its bytes take about 2 and 19 us. The KV head
        varies fastest along the grid's first axis: neighbouring programs update neighbouring floats of
        ``score [P, S, Hkv]`` (a program's own are ``Hkv`` floats apart), so they share its memory sectors."""
        kvh = tl.program_id(0) % HKV
        b = tl.program_id(0) // HKV
        split = tl.program_id(1)

        offs_g = tl.arange(0, BLOCK_G)  # BLOCK_G is G rounded up to a power of two (no tl.dot here)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q_rows = (b * HKV + kvh) * G + offs_g  # [BLOCK_G]
        m_max, inv_l = _combine_stats(m_ptr, l_ptr, q_rows, g_ok, num_splits, BLOCK_SPLITS)

        if split == 0:
            # The splits' partial outputs SPLIT_TILE at a time: one [BLOCK_G, SPLIT_TILE, BLOCK_D] load each.
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            offs_t = tl.arange(0, SPLIT_TILE)
            for s0 in range(0, num_splits, SPLIT_TILE):
                s_ok = g_ok[:, None] & ((s0 + offs_t) < num_splits)[None, :]  # [BLOCK_G, SPLIT_TILE]
                stat = q_rows[:, None] * num_splits + s0 + offs_t[None, :]
                m_s = tl.load(m_ptr + stat, mask=s_ok, other=_NEG_BIG_C)
                part = tl.load(acc_ptr + stat[:, :, None] * D + offs_d[None, None, :],
                               mask=s_ok[:, :, None] & d_ok[None, None, :], other=0.0)
                acc += tl.sum(tl.exp(m_s - m_max[:, None])[:, :, None] * part, axis=1)
            out = acc * inv_l[:, None]  # an empty sequence has inv_l = 0: a zero row
            tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=g_ok[:, None] & d_ok[None, :])

        if SCORE_MODE != 0:
            threshold = 0.0  # a stand-in the other modes never read
            if SCORE_MODE == 2:  # gumbel: the scratch holds the noised logits; their own normaliser
                m_max, inv_l = _combine_stats(gm_ptr, gl_ptr, q_rows, g_ok, num_splits, BLOCK_SPLITS)
            if SCORE_MODE == 5:  # count_low: threshold 1 / (visible slots of this KV head)
                offs_s = tl.arange(0, BLOCK_SPLITS)
                n_valid = tl.sum(tl.load(nvis_ptr + (b * HKV + kvh) * num_splits + offs_s,
                                         mask=offs_s < num_splits, other=0), axis=0)
                threshold = 1.0 / tl.maximum(n_valid, 1).to(tl.float32)
            # The grid's second axis covers the sequence in chunks of BLOCK_N slots, independently of the
            # attention's splits: many short programs, not one serial sweep per (sequence, KV head).
            if HAS2:
                if split < n_update1:
                    _score_chunk(logits_ptr, score_ptr, page_table_ptr, seq_lens_ptr, slot_mask_ptr, q_rows,
                                 g_ok, b, kvh, split, m_max, inv_l, threshold, decay, mask_bit,
                                 max_pages, logits_len, HKV, G, S, BLOCK_N, SCORE_MODE, HAS_MASK)
                else:  # the second region's chunk split - n_update1, its logits after the first's slots
                    _score_chunk(logits_ptr + max_pages * S, score2_ptr, page_table2_ptr, seq_lens2_ptr,
                                 slot_mask_ptr, q_rows, g_ok, b, kvh, split - n_update1, m_max,
                                 inv_l, threshold, decay, mask_bit, max_pages2, logits_len, HKV, G, S,
                                 BLOCK_N, SCORE_MODE, False)
            else:
                _score_chunk(logits_ptr, score_ptr, page_table_ptr, seq_lens_ptr, slot_mask_ptr, q_rows, g_ok,
                             b, kvh, split, m_max, inv_l, threshold, decay, mask_bit, max_pages,
                             logits_len, HKV, G, S, BLOCK_N, SCORE_MODE, HAS_MASK)

    @triton.jit
    def _score_chunk(
        logits_ptr, score_ptr, page_table_ptr, seq_lens_ptr, slot_mask_ptr, q_rows, g_ok, b, kvh, chunk_id,
        m_max, inv_l, threshold, decay, mask_bit, max_pages, logits_len,
        HKV: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
        SCORE_MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    ):
        """The fused score update (docs/contract.md §2.2) of chunk ``chunk_id`` (``BLOCK_N`` slots, one
        tile) of one region of sequence ``b``, KV head ``kvh``, from the group's logits in scratch and the
        final per-head (max, 1 / sum): for gumbel the noised logits and their normaliser; ``threshold = 1 /
        n_valid`` for count_low."""
        slots = chunk_id * BLOCK_N + tl.arange(0, BLOCK_N)
        in_seq = slots < tl.load(seq_lens_ptr + b)
        lmask = g_ok[:, None] & in_seq[None, :]
        x = tl.load(logits_ptr + q_rows[:, None] * logits_len + slots[None, :], mask=lmask,
                    other=float("-inf"))  # [BLOCK_G, BLOCK_N]
        p = tl.exp(x - m_max[:, None]) * inv_l[:, None]
        contrib = tl.sum(p, axis=0) / G  # [BLOCK_N] mean over the group's query heads

        page = tl.load(page_table_ptr + b * max_pages + slots // S, mask=in_seq, other=0).to(tl.int64)
        row = (page * S + slots % S) * HKV + kvh
        visible = in_seq
        if HAS_MASK:
            bits = tl.load(slot_mask_ptr + row, mask=in_seq, other=0).to(tl.int32)
            visible = visible & ((bits & mask_bit) != 0)
        old = tl.load(score_ptr + row, mask=visible, other=0.0)
        if SCORE_MODE <= 2:  # accumulate (1), gumbel (2)
            new = old + contrib
        elif SCORE_MODE == 3:  # decay
            new = decay * old + contrib
        elif SCORE_MODE == 4:  # replace
            new = contrib
        else:  # count_low
            new = old - (contrib < threshold).to(tl.float32)
        tl.store(score_ptr + row, new, mask=visible)

SCORE_CHUNK = 256  # slots per program of the score update, one tile (the interpreter: 32, see below)
_SPLIT_TILE_ELEMS = 8192  # floats of partial output the reduce kernel loads at once (64 a thread at 4 warps)


def _score_chunk_len() -> int:
    """Slots per program (and tile) of the score update: :data:`SCORE_CHUNK` compiled, 32 under the Triton
    interpreter, so the CPU tests' short sequences still cross chunk edges."""
    return 32 if INTERPRET else SCORE_CHUNK


def _split_plan(batch: int, n_kv_heads: int, max_len: int, block_n: int, device: torch.device,
                num_splits: int) -> tuple[int, int]:
    """``(num_splits, chunk)`` of a split decode over ``max_len`` slots: ``num_splits`` as given, or (0)
    enough (sequence, KV head, split) programs to fill the GPU twice, each split >= 256 slots; ``chunk`` the
    slots per split, a multiple of ``block_n`` so only the last tile of a split is partial. Shared with
    :mod:`kvkernels.quant_attention`."""
    if num_splits <= 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        want = math.ceil(2 * sms / max(1, batch * n_kv_heads))
        num_splits = max(1, min(want, math.ceil(max_len / max(256, block_n)), 64))
    return num_splits, max(block_n, math.ceil(max(1, max_len) / num_splits / block_n) * block_n)


def paged_decode_attention_triton(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float, alibi: Alibi | None = None, scores: ScoreUpdate | None = None,
    restore: Restore | None = None, num_splits: int = 0,
) -> torch.Tensor:
    """Triton launcher for :func:`paged_decode_attention` (same arguments; inputs assumed checked)."""
    require_triton()
    batch, n_q_heads, head_dim = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = n_q_heads // n_kv_heads
    max_pages = page_table.shape[1]
    max_len = max_pages * page_size  # static: the scratch shape never depends on the lengths' values

    cfg = launch_config("decode", q.device)  # tile, warps and stages: kvkernels.tuning
    block_n = cfg.block
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_splits, chunk = _split_plan(batch, n_kv_heads, max_len, block_n, q.device, num_splits)

    k_scale, v_scale, slot_mask, mask_bit = _NO_RESTORE if restore is None else restore
    score, score_mode, decay, gumbel_key, temperature = _NO_SCORES if scores is None else scores
    mode_id = _MODE_IDS[score_mode]
    keep_logits = mode_id != 0 and score is not None
    gumbel = keep_logits and mode_id == _MODE_IDS["gumbel"]
    # One program per (sequence, KV head) finishes alone, no partials and one launch, when nothing is scored.
    # A score update always runs in the second kernel, over many short chunks of slots (SCORE_CHUNK) in
    # parallel: as one sweep at the end of each (sequence, KV head) program it was a serial, latency-bound
    # loop (+56% on the decode at batch 8 and 64 on an H200, bench/results/nvidia-h200-2026-11-26).
    one_split = num_splits == 1 and not keep_logits
    parts = _partials(q, n_kv_heads, num_splits, max_len, one_split=one_split, keep_logits=keep_logits,
                      gumbel=gumbel)
    dummy = parts.dummy

    def opt(t: torch.Tensor | None) -> torch.Tensor:
        return dummy if t is None else t

    out = torch.empty_like(q)
    consts = dict(HKV=n_kv_heads, G=group, D=head_dim, S=page_size, BLOCK_G=block_g, BLOCK_D=block_d,
                  BLOCK_N=block_n)
    grid = (batch, n_kv_heads, num_splits)
    launch(
        _decode_partial_kernel, grid,
        q, k_pages, v_pages, page_table, seq_lens,
        *((dummy, dummy, dummy) if alibi is None else alibi), opt(k_scale), opt(v_scale), opt(slot_mask),
        gumbel_key if gumbel else dummy, opt(temperature),
        parts.m, parts.l, parts.acc, parts.gm, parts.gl, parts.nvis, parts.logits, out,
        opt(score) if keep_logits else dummy,
        float(scale), int(mask_bit), float(decay), max_pages, max_len, num_splits, chunk,
        HAS_ALIBI=alibi is not None, HAS_KSCALE=k_scale is not None, HAS_VSCALE=v_scale is not None,
        HAS_MASK=slot_mask is not None, KEEP_LOGITS=keep_logits, GUMBEL=gumbel,
        HAS_TEMP=temperature is not None,
        # fp32 caches get exact fp32 products (no TF32) so they match the fp32 reference.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ONE_SPLIT=one_split, SCORE_MODE=mode_id if keep_logits else 0, G_P2=triton.next_power_of_2(group),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **consts,
    )
    if not one_split:
        reduce_splits(out, parts, num_splits, page_table, seq_lens, scores=scores if keep_logits else None,
                      slot_mask=slot_mask, mask_bit=mask_bit, num_warps=cfg.num_warps, **consts)
    return out


class _Partials(NamedTuple):
    """Scratch of a split decode: per (sequence, query head, split) the running max ``m``, sum ``l`` and
    unnormalised output ``acc [..., D]`` (float32); for a score update the logits ``[B, Hq, Lmax]``, the
    visible slots per (sequence, KV head, split) ``nvis`` (count_low) and gumbel's noised ``gm`` / ``gl``.
    Absent ones are ``dummy`` (one float the kernels never read)."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    gm: torch.Tensor
    gl: torch.Tensor
    nvis: torch.Tensor
    logits: torch.Tensor
    dummy: torch.Tensor


def _partials(q: torch.Tensor, n_kv_heads: int, num_splits: int, max_len: int, *, one_split: bool,
              keep_logits: bool, gumbel: bool) -> _Partials:
    """The scratch a decode launch of ``q [B, Hq, D]`` writes (shapes static: ``max_len`` is the page
    table's width in slots, never the lengths' values)."""
    batch, n_q_heads, head_dim = q.shape
    dev, f32 = q.device, torch.float32
    dummy = torch.empty(1, device=dev, dtype=f32)
    split = (batch, n_q_heads, num_splits)
    m = dummy if one_split else torch.empty(split, device=dev, dtype=f32)
    return _Partials(
        m=m, l=dummy if one_split else torch.empty_like(m),
        acc=dummy if one_split else torch.empty(*split, head_dim, device=dev, dtype=f32),
        gm=torch.empty_like(m) if gumbel and not one_split else dummy,
        gl=torch.empty_like(m) if gumbel and not one_split else dummy,
        nvis=(torch.empty(batch, n_kv_heads, num_splits, device=dev, dtype=torch.int32)
              if keep_logits and not one_split else dummy),
        logits=torch.empty(batch, n_q_heads, max_len, device=dev, dtype=f32) if keep_logits else dummy,
        dummy=dummy)


class SecondScores(NamedTuple):
    """A second region's share of a split decode's score update (:func:`reduce_splits`): its slot scores
    ``score [P2, S, Hkv]`` float32 (updated in place), ``page_table [B, M2]`` and ``seq_lens [B]`` int32. The
    partial kernel keeps its logits in each scratch row after the first region's ``M * S`` slots."""

    score: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor


def reduce_splits(out: torch.Tensor, parts: _Partials, num_splits: int, page_table: torch.Tensor,
                  seq_lens: torch.Tensor, *, scores: ScoreUpdate | None, slot_mask: torch.Tensor | None,
                  mask_bit: int, num_warps: int, second: SecondScores | None = None, **consts: int) -> None:
    """The second launch of a split decode: ``out`` from the splits' partials and, with ``scores``, the
    score update over chunks of :data:`SCORE_CHUNK` slots in parallel, each chunk one tile. Shared with
    :mod:`kvkernels.quant_attention`, whose partial kernel writes the same scratch; with ``second`` (its two
    regions under one softmax) more programs score the second region's slots from the logits after the
    first region's in the scratch (the visible count ``nvis`` and Gumbel's noised statistics cover both).
    ``consts`` are the partial kernel's; this kernel has no tensor-core product, so it pads the group only
    to a power of two and takes its own tile along the slots."""
    batch, n_kv_heads = out.shape[0], consts["HKV"]
    score, score_mode, decay = (None, "none", 1.0) if scores is None else scores[:3]
    mode_id = _MODE_IDS[score_mode] if score is not None else 0
    two = second if second is not None and mode_id != 0 else None
    has2 = two is not None
    dummy = parts.dummy
    max_len = page_table.shape[1] * consts["S"]
    score_chunk = _score_chunk_len()
    n_update = max(1, math.ceil(max_len / score_chunk)) if mode_id else 1
    n_update2 = math.ceil(two.page_table.shape[1] * consts["S"] / score_chunk) if two is not None else 0
    if two is None:
        two = SecondScores(dummy, page_table, seq_lens)
    block_g = triton.next_power_of_2(consts["G"])
    block_d = consts["BLOCK_D"]
    # Partial outputs combined a tile of splits at a time, a tile of at most _SPLIT_TILE_ELEMS floats (the
    # interpreter: 2 splits, so the tests' 3 splits cross a tile's edge).
    split_tile = 2 if INTERPRET else _SPLIT_TILE_ELEMS // (block_g * block_d)
    split_tile = max(1, min(triton.next_power_of_2(num_splits), split_tile))
    launch(
        _decode_reduce_kernel, (batch * n_kv_heads, n_update + n_update2),
        out, parts.m, parts.l, parts.acc, parts.gm, parts.gl, parts.nvis, parts.logits,
        dummy if score is None else score, page_table, seq_lens, dummy if slot_mask is None else slot_mask,
        two.score, two.page_table, two.seq_lens, int(mask_bit), float(decay), page_table.shape[1],
        parts.logits.shape[-1], num_splits, two.page_table.shape[1], n_update,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits), SPLIT_TILE=split_tile, SCORE_MODE=mode_id,
        HAS_MASK=slot_mask is not None, HAS2=has2, num_warps=num_warps,
        **{**consts, "BLOCK_G": block_g, "BLOCK_N": score_chunk},
    )


def _masked_softmax(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``visible``; a row with nothing visible is all zeros."""
    p = torch.softmax(x.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.where(visible, p, torch.zeros_like(p))  # all-masked rows came out NaN


def paged_decode_attention_ref(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float, alibi: Alibi | None = None, scores: ScoreUpdate | None = None,
    restore: Restore | None = None, num_splits: int = 0,
) -> torch.Tensor:
    """Pure-torch reference for :func:`paged_decode_attention`: one sequence at a time, in fp32.

    ``num_splits`` is accepted for signature parity and ignored (the result does not depend on it).
    """
    k_scale, v_scale, slot_mask, mask_bit = _NO_RESTORE if restore is None else restore
    score, score_mode, decay, gumbel_key, temperature = _NO_SCORES if scores is None else scores
    batch, n_q_heads, _ = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = n_q_heads // n_kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        slots = torch.arange(n, device=q.device)
        pages = page_table[b, slots // page_size].long()  # [n]
        offs = slots % page_size  # [n]
        k = k_pages[pages, offs].float()  # [n, Hkv, D]
        v = v_pages[pages, offs].float()  # [n, Hkv, D]
        if k_scale is not None:
            k = k * k_scale[pages, offs][..., None]
        if v_scale is not None:
            v = v * v_scale[pages, offs][..., None]
        visible = torch.ones(n, n_kv_heads, dtype=torch.bool, device=q.device)  # [n, Hkv]
        if slot_mask is not None:
            visible = (slot_mask[pages, offs] & mask_bit) != 0

        # Query head h reads KV head h // group.
        k_q = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v_q = v.repeat_interleave(group, dim=1)  # [n, Hq, D]
        visible_q = visible.repeat_interleave(group, dim=1).T  # [Hq, n]
        x = scale * torch.einsum("hd,nhd->hn", q[b].float(), k_q)  # [Hq, n]
        if alibi is not None:
            key_pos = alibi.slot_pos[pages, offs].repeat_interleave(group, dim=1).T  # [Hq, n]
            x = x + alibi.slopes[:, None].float() * (key_pos - alibi.q_pos[b]).float()
        p = _masked_softmax(x, visible_q)  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", p, v_q).to(q.dtype)

        if score_mode == "none" or score is None:
            continue
        if score_mode == "gumbel":
            assert gumbel_key is not None
            tau = 1.0 if temperature is None else temperature.float()
            noise = gumbel_noise_keyed(gumbel_key[b], n)  # [Hq, n] by logical slot
            p = _masked_softmax((x + noise) / tau, visible_q)
        contrib = p.view(n_kv_heads, group, n).mean(dim=1)  # [Hkv, n]
        old = score[pages, offs].T  # [Hkv, n]
        n_valid = visible.sum(dim=0)[:, None]  # [Hkv, 1]
        new = update_scores_ref(old, contrib, score_mode, decay=decay, n_valid=n_valid)
        score[pages, offs] = torch.where(visible.T, new, old).T
    return out


def paged_decode_attention_torch(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float, alibi: Alibi | None = None, scores: ScoreUpdate | None = None,
    restore: Restore | None = None, num_splits: int = 0,
) -> torch.Tensor:
    """Vectorised torch path of :func:`paged_decode_attention` (what the op runs on CPU); same arguments.

    The whole batch in a few batched ops instead of :func:`paged_decode_attention_ref`'s loop over
    sequences: gather the first ``ceil(max(seq_lens) / S)`` pages of every sequence through the page
    table into ``[B, N, Hkv, D]``, mask slots past each length, and compute the ``G`` query heads of a
    group against their one KV head (``q`` viewed as ``[B, Hkv, G, D]``; K/V are never expanded to the
    query heads). Reading the longest length is one host read; on CPU it costs nothing, and the op is
    opaque to ``torch.compile``, so it never becomes a graph break. ``num_splits`` is ignored.
    """
    k_scale, v_scale, slot_mask, mask_bit = _NO_RESTORE if restore is None else restore
    score, score_mode, decay, gumbel_key, temperature = _NO_SCORES if scores is None else scores
    batch, n_q_heads, head_dim = q.shape
    page_size, n_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = n_q_heads // n_kv_heads
    width = int(seq_lens.max()) if batch else 0  # longest sequence: only its pages are gathered
    if width == 0:
        return torch.zeros_like(q)
    n_pages = -(-width // page_size)
    n_slots = n_pages * page_size  # N
    # Table entries past a sequence's own pages are unused (-1 after a free): clamp them to any real page;
    # every slot they yield is masked out below.
    pages = page_table[:, :n_pages].long().clamp(0, k_pages.shape[0] - 1)  # [B, n_pages]
    valid = torch.arange(n_slots, device=q.device) < seq_lens[:, None]  # [B, N]

    def gather(pool: torch.Tensor) -> torch.Tensor:  # [P, S, Hkv, ...] -> [B, N, Hkv, ...], a copy
        # index_select, not pool[pages]: the same copy, ~20x faster on CPU (contiguous page rows).
        return pool.index_select(0, pages.flatten()).view(batch, n_slots, *pool.shape[2:])

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [B, N, Hkv] -> [B, Hkv, 1, N], broadcast over G
        return t.permute(0, 2, 1)[:, :, None, :]

    k = gather(k_pages)  # [B, N, Hkv, D]
    v = gather(v_pages)  # [B, N, Hkv, D], a copy: zeroing its invalid slots below touches no pool
    # Unused slots may hold anything (NaN) and 0 * NaN would poison the output, so zero them. They all lie
    # at or past the shortest length: only that tail is touched (for one sequence, < S slots).
    shortest = int(seq_lens.min())
    v[:, shortest:].masked_fill_(~valid[:, shortest:, None, None], 0.0)
    visible = valid[:, None, None, :]  # [B, 1, 1, N]
    if slot_mask is not None:
        visible = visible & ((per_head(gather(slot_mask)) & mask_bit) != 0)  # [B, Hkv, 1, N]

    qg = q.view(batch, n_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    x = scale * torch.einsum("bhgd,bnhd->bhgn", qg.float(), k.float())  # [B, Hkv, G, N] fp32 logits
    if k_scale is not None:  # scale * q.(k * s) == s * (scale * q.k)
        x = x * per_head(gather(k_scale))
    if alibi is not None:
        rel = (per_head(gather(alibi.slot_pos)) - alibi.q_pos[:, None, None, None]).float()  # [B, Hkv, 1, N]
        x = x + alibi.slopes.view(n_kv_heads, group, 1).float() * rel
    p = _masked_softmax(x, visible)  # [B, Hkv, G, N]
    pv = p
    if v_scale is not None:  # restore v = v_pages * v_scale through the probabilities (N, not N*D, mults)
        pv = torch.where(visible, p * per_head(gather(v_scale)), 0.0)
    out = torch.einsum("bhgn,bnhd->bhgd", pv, v.float())  # [B, Hkv, G, D]
    out = out.reshape(batch, n_q_heads, head_dim).to(q.dtype)

    if score_mode == "none" or score is None:
        return out
    if score_mode == "gumbel":
        assert gumbel_key is not None
        tau = 1.0 if temperature is None else temperature.float()
        noise = gumbel_noise_keyed(gumbel_key, n_slots).view(batch, n_kv_heads, group, n_slots)
        p = _masked_softmax((x + noise) / tau, visible)
    contrib = p.mean(dim=2).transpose(1, 2)  # [B, N, Hkv]
    visible = visible.expand(batch, n_kv_heads, 1, n_slots)[:, :, 0].transpose(1, 2)  # [B, N, Hkv]
    # Only valid slots are written: each is a distinct pool slot, so the scatter has no duplicates.
    rows = (pages[:, :, None] * page_size + torch.arange(page_size, device=q.device)).flatten(1)[valid]  # [V]
    flat = score.view(-1, n_kv_heads)  # [P * S, Hkv]
    old = flat[rows]  # [V, Hkv]
    n_valid = visible.sum(dim=1, keepdim=True).expand(batch, n_slots, n_kv_heads)[valid]  # [V, Hkv]
    new = update_scores_ref(old, contrib[valid], score_mode, decay=decay, n_valid=n_valid)
    flat[rows] = torch.where(visible[valid], new, old)
    return out


@torch.library.custom_op("kvkernels::paged_decode_attention", mutates_args=("score",))
def _paged_decode_attention_op(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, alibi_slopes: torch.Tensor | None,
    slot_pos: torch.Tensor | None, q_pos: torch.Tensor | None,
    score: torch.Tensor | None, score_mode: str, decay: float,
    gumbel_key: torch.Tensor | None, temperature: torch.Tensor | None,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    slot_mask: torch.Tensor | None, mask_bit: int, num_splits: int,
) -> torch.Tensor:
    """The registered op (no input checks): Triton on CUDA tensors, the vectorised torch path elsewhere.

    An op schema takes tensors, scalars and strings, not NamedTuples, so the public op passes its bundles
    flattened, field by field in this order: ``alibi`` (slopes as ``alibi_slopes``, slot_pos, q_pos),
    ``scores`` (score, mode as ``score_mode``, decay, gumbel_key, temperature), ``restore`` (k_scale,
    v_scale, slot_mask, mask_bit); no ``alibi_slopes`` means no ALiBi, no ``score`` no score update. The
    tensors cannot be keyword-only in an op schema. The op bundles them again for the implementation.

    No argument has a default: torch < 2.13 drops trailing arguments equal to their defaults before its
    ADInplaceOrView kernel bumps the mutated ``score`` by position, which raised ``IndexError`` for an
    eager call without scores (torch 2.11 on an H200, ``bench/results/nvidia-h200-2026-11-26``).
    """
    alibi = None
    if alibi_slopes is not None:
        assert slot_pos is not None and q_pos is not None  # the public op checked the bundle
        alibi = Alibi(alibi_slopes, slot_pos, q_pos)
    scores = None if score is None else ScoreUpdate(score, score_mode, decay, gumbel_key, temperature)
    impl = paged_decode_attention_triton if use_triton(q) else paged_decode_attention_torch
    return impl(q, k_pages, v_pages, page_table, seq_lens, scale=scale, alibi=alibi, scores=scores,
                restore=Restore(k_scale, v_scale, slot_mask, mask_bit), num_splits=num_splits)


@_paged_decode_attention_op.register_fake
def _(q, *args, **kwargs):
    return torch.empty_like(q)  # [B, Hq, D]; score's in-place update needs no fake output


def _check_bundle(name: str, value: object, kind: Any) -> None:
    """``value`` is None or a ``kind`` bundle (not, say, a tensor, or a plain tuple of the fields)."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a kvkernels.{kind.__name__}({', '.join(kind._fields)}) or None, got "
                        f"{type(value).__name__}")


def check_scores(scores: ScoreUpdate | None, q: torch.Tensor, slots: tuple[int, int, int]) -> None:
    """The ``scores`` bundle of a decode over a pool of ``slots = (P, S, Hkv)`` (metadata only, no device
    sync): each field's error names it (``scores.mode``, ``scores.gumbel_key``). Shared with
    :mod:`kvkernels.quant_attention`."""
    _check_bundle("scores", scores, ScoreUpdate)
    if scores is None:
        return
    ck, dev, batch = _checks.check_tensor, q.device, q.shape[0]
    mode = scores.mode
    _checks.check_choice("scores.mode", mode, SCORE_MODES)
    if scores.score is not None:
        ck("scores.score", scores.score, ndim=3, dtypes=(torch.float32,), device=dev, contiguous=True)
        _checks.check_shape("scores.score", scores.score, slots, "[P, S, Hkv] of the pool")
    elif mode != "none":
        raise ValueError(f"scores.mode={mode!r} updates scores in place: pass scores.score "
                         "([P, S, Hkv] float32)")
    if mode == "gumbel":
        key = scores.gumbel_key
        if key is None:
            raise ValueError("scores.mode='gumbel' needs scores.gumbel_key ([B, Hq] int32: each sequence's "
                             "and query head's noise key this step, e.g. kvkernels.decode_keys(seed, step, "
                             "layers, B, Hq)[layer])")
        ck("scores.gumbel_key", key, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=True)
        _checks.check_shape("scores.gumbel_key", key, (batch, q.shape[1]), "[B, Hq]")
    if scores.temperature is not None:
        ck("scores.temperature", scores.temperature, ndim=1, dtypes=(torch.float32,), device=dev,
           contiguous=True)
        _checks.check_shape("scores.temperature", scores.temperature, (1,), "a 1-element tensor")


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, *, scale, alibi, scores, restore,
                  num_splits) -> None:
    """Metadata checks (no device sync): ranks, shapes, dtypes, devices, contiguity, the bundles' fields.
    A bundle field's error names it as ``bundle.field`` (``scores.mode``, ``alibi.slot_pos``)."""
    ck = _checks.check_tensor
    ck("q", q, ndim=3, dtypes=_checks.FLOAT_DTYPES, contiguous=True)
    dev = q.device
    batch, n_q_heads, head_dim = q.shape
    ck("k_pages", k_pages, ndim=4, dtypes=(q.dtype,), device=dev, contiguous=True)
    num_pages, page_size, n_kv_heads, kd = k_pages.shape
    if kd != head_dim:
        raise ValueError(f"k_pages head dim is {kd} but q has head dim {head_dim}; they must match")
    if n_kv_heads == 0 or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"q has {n_q_heads} heads, which is not a multiple of the {n_kv_heads} KV heads of "
                         "k_pages; GQA needs Hq = G * Hkv")
    ck("v_pages", v_pages, ndim=4, dtypes=(q.dtype,), device=dev, contiguous=True)
    _checks.check_shape("v_pages", v_pages, tuple(k_pages.shape), "same as k_pages")
    ck("page_table", page_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=True)
    _checks.check_shape("page_table", page_table, (batch, None), "[B, M]")
    ck("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    _checks.check_shape("seq_lens", seq_lens, (batch,), "[B]")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 picks a heuristic), got {num_splits}")
    _check_bundle("alibi", alibi, Alibi)
    _check_bundle("restore", restore, Restore)

    def per_slot(name: str, t: object, dtype: torch.dtype) -> None:
        t = ck(name, t, ndim=3, dtypes=(dtype,), device=dev, contiguous=True)
        _checks.check_shape(name, t, (num_pages, page_size, n_kv_heads), "[P, S, Hkv] of the pool")

    check_scores(scores, q, (num_pages, page_size, n_kv_heads))
    if restore is not None:
        if not 1 <= restore.mask_bit <= 255:
            raise ValueError(f"restore.mask_bit must be in [1, 255] (a bit of the uint8 restore.slot_mask), "
                             f"got {restore.mask_bit}")
        for name, t, dtype in (("k_scale", restore.k_scale, torch.float32),
                               ("v_scale", restore.v_scale, torch.float32),
                               ("slot_mask", restore.slot_mask, torch.uint8)):
            if t is not None:
                per_slot(f"restore.{name}", t, dtype)
    if alibi is not None:
        ck("alibi.slopes", alibi.slopes, ndim=1, dtypes=(torch.float32,), device=dev, contiguous=True)
        _checks.check_shape("alibi.slopes", alibi.slopes, (n_q_heads,), "[Hq]")
        if alibi.slot_pos is None or alibi.q_pos is None:
            raise ValueError("alibi needs alibi.slot_pos ([P, S, Hkv] int32, the slots' original positions) "
                             "and alibi.q_pos ([B] int32)")
        per_slot("alibi.slot_pos", alibi.slot_pos, torch.int32)
        ck("alibi.q_pos", alibi.q_pos, ndim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
        _checks.check_shape("alibi.q_pos", alibi.q_pos, (batch,), "[B]")


def paged_decode_attention(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, *, scale: float, alibi: Alibi | None = None, scores: ScoreUpdate | None = None,
    restore: Restore | None = None, num_splits: int = 0,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a ragged paged KV cache.

    Parameters
    ----------
    q : [B, Hq, D] float32 / float16 / bfloat16
        Queries of the current step.
    k_pages, v_pages : [P, S, Hkv, D], same dtype as ``q``
        The page pool (keys after RoPE, values). ``Hq`` must be a multiple of ``Hkv``.
    page_table : [B, M] int32
        Pool page of each sequence's ``i``-th page; entries at or past ``ceil(seq_lens / S)`` are never read.
    seq_lens : [B] int32
        Valid slots per sequence (0 gives a zero output row).
    scale : float
        Logit multiplier, usually ``D ** -0.5``.
    alibi : Alibi, optional
        ``Alibi(slopes [Hq] f32, slot_pos [P, S, Hkv] i32, q_pos [B] i32)``: adds
        ``slopes[h] * (slot_pos - q_pos)`` to the logits.
    scores : ScoreUpdate, optional
        ``ScoreUpdate(score [P, S, Hkv] f32, mode="accumulate", decay=1.0, gumbel_key=None,
        temperature=None)``: ``score`` is updated in place according to ``mode`` (one of ``SCORE_MODES``,
        docs/contract.md §2.2) for visible valid slots only; ``mode="none"`` leaves it untouched.
    restore : Restore, optional
        ``Restore(k_scale=None, v_scale=None, slot_mask=None, mask_bit=1)``: MiniCache restore, keys are
        ``k_pages * k_scale`` and values ``v_pages * v_scale``; a slot is visible only if
        ``slot_mask & mask_bit != 0``.
    num_splits : int
        Split-K factor for the Triton kernel; 0 picks one from the shape and the device.

    Returns
    -------
    out : [B, Hq, D], dtype of ``q``

    Bad input raises ``ValueError`` / ``TypeError`` naming the argument or bundle field and the fix, before
    anything is written.
    """
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, scale=scale, alibi=alibi, scores=scores,
                  restore=restore, num_splits=num_splits)
    slopes, slot_pos, q_pos = (None, None, None) if alibi is None else alibi
    score, score_mode, decay, gumbel_key, temperature = _NO_SCORES if scores is None else scores
    k_scale, v_scale, slot_mask, mask_bit = _NO_RESTORE if restore is None else restore
    if not torch.compiler.is_compiling():  # value checks read device memory (a sync): eager only
        _checks.check_seq_lens(seq_lens)
        _checks.check_page_table(page_table, seq_lens, k_pages.shape[0], k_pages.shape[1])
    elif score is None:
        # Inductor (torch 2.13) cannot lower this op with its mutable argument None ("getitem is not an
        # OpOverload"); an empty score with score_mode "none" is never read or written.
        score = torch.empty(0, 1, 1, device=q.device)
    # Every argument positionally, none defaulted (see the op's docstring: torch < 2.13 on CUDA).
    return _paged_decode_attention_op(
        q, k_pages, v_pages, page_table, seq_lens, float(scale), slopes, slot_pos, q_pos, score,
        score_mode, float(decay), gumbel_key, temperature, k_scale, v_scale, slot_mask, int(mask_bit),
        int(num_splits))


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

# Every option the launcher turns into a different kernel: each score mode, ALiBi, MiniCache restore (with
# either mask bit: an int argument equal to 1 is specialised as a constant), split-K, GQA group sizes,
# every dtype the op accepts and head dims that are and are not powers of two.
COMPILE_AXES: dict[str, tuple] = {
    "score_mode": SCORE_MODES,
    "alibi": (False, True),
    "restore": (None, 1, 2),
    "num_splits": (1, 4),
    "group": (1, 2, 4, 8),
    "dtype": _checks.FLOAT_DTYPES,
    "head_dim": (64, 128, 96),
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls :func:`paged_decode_attention_triton` on ``meta`` tensors
    with one configuration of :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "paged_decode_attention " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))


def _meta_launch(score_mode: str, alibi: bool, restore: int | None, num_splits: int, group: int,
                 dtype: torch.dtype, head_dim: int) -> None:
    """One launch on ``meta`` tensors shaped like a cache's (3 sequences, 2 KV heads, pages of 16)."""
    B, Hkv, S, P, M = 3, 2, 16, 40, 12
    Hq = Hkv * group
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    gumbel = score_mode == "gumbel"
    paged_decode_attention_triton(
        t(B, Hq, head_dim, dt=dtype), t(P, S, Hkv, head_dim, dt=dtype), t(P, S, Hkv, head_dim, dt=dtype),
        t(B, M, dt=torch.int32), t(B, dt=torch.int32), scale=head_dim ** -0.5,
        alibi=Alibi(t(Hq), t(P, S, Hkv, dt=torch.int32), t(B, dt=torch.int32)) if alibi else None,
        scores=ScoreUpdate(t(P, S, Hkv), score_mode, 0.9, t(B, Hq, dt=torch.int32) if gumbel else None,
                           t(1) if gumbel else None) if score_mode != "none" else None,
        restore=Restore(t(P, S, Hkv), t(P, S, Hkv), t(P, S, Hkv, dt=torch.uint8), mask_bit=restore)
        if restore else None,
        num_splits=num_splits)
