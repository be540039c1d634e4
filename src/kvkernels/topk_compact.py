"""Top-k compaction of a paged KV cache layer (docs/contract.md §2.4).

Per (sequence, KV head) keep ``budgets[b]`` slots -- the first ``n_sink[b]`` and last ``n_recent[b]``
always, the rest by descending score, ties to the lower slot -- move them to the front in their original
order, and push the pages past ``ceil(budget / S)`` onto the free stack.

The Triton launcher plans the move with torch on the device (one stable sort per row, no host sync) and
moves the bytes with one Triton kernel per pool tensor (pure loads and stores masked to the row width, so
K/V rows may be floats or uint8 packed rows of any width: a quantized pool's codes, scales and zero points,
issue 36); page release is one more Triton launch (``_release_pages_kernel``: the released pages pushed on
the free stack, their table entries cleared, the new lengths stored), so every shape is static and nothing
reads the device back. On CPU the op runs the same plan in batched torch (:func:`topk_compact_torch`);
:func:`topk_compact_ref` loops per (sequence, head) as the oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvkernels._checks import FLOAT_DTYPES, check_page_table, check_seq_lens, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _move_slots_kernel(
        x_ptr, src_map_ptr, page_table_ptr, n_move_ptr,
        stride_xp, stride_xs, stride_xh,
        stride_mb, stride_mh, stride_tb,
        n_heads, width,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """x[page(d), d % S, h, w] = x[page(j), j % S, h, w] with j = src_map[b, h, d], for d < n_move[b].

        One program per (sequence, KV head, chunk of the last dim). It is in-place safe: kept sources are
        increasing (``j >= d``), so a later tile only reads slots ``>= its first d``, which no earlier tile
        wrote; inside a tile a row may read a slot another row of the same tile writes, hence the barrier
        between the tile's loads and its stores (the interpreter runs whole-tile ops in order anyway).
        Slots already in place (``j == d``, e.g. the sinks) are not touched.
        """
        pid = tl.program_id(0)
        b = pid // n_heads
        h = pid % n_heads
        w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        w_mask = w < width
        n_move = tl.load(n_move_ptr + b)
        for start in range(0, n_move, BLOCK_N):
            d = start + tl.arange(0, BLOCK_N)
            in_range = d < n_move
            j = tl.load(src_map_ptr + b * stride_mb + h * stride_mh + d, mask=in_range, other=0)
            rows = in_range & (j != d)
            table_row = page_table_ptr + b * stride_tb  # page ids go to int64: pool offsets can pass 2**31
            src_page = tl.load(table_row + j // PAGE_SIZE, mask=rows, other=0).to(tl.int64)
            dst_page = tl.load(table_row + d // PAGE_SIZE, mask=rows, other=0).to(tl.int64)
            src = src_page * stride_xp + (j % PAGE_SIZE) * stride_xs + h * stride_xh  # [BLOCK_N]
            dst = dst_page * stride_xp + (d % PAGE_SIZE) * stride_xs + h * stride_xh  # [BLOCK_N]
            mask = rows[:, None] & w_mask[None, :]
            vals = tl.load(x_ptr + src[:, None] + w[None, :], mask=mask)  # [BLOCK_N, BLOCK_W]
            tl.debug_barrier()
            tl.store(x_ptr + dst[:, None] + w[None, :], vals, mask=mask)


    @triton.jit
    def _kth_smallest(key, valid, k, n):
        """The ``k``-th smallest (0-based) of the distinct ``key`` values where ``valid``, by bisection over
        the keys' range [0, 2**49): -1 when ``k < 0``, 2**62 when ``k >= n`` (so ``key < it`` is all)."""
        lo = tl.full((), 0, tl.int64)
        hi = tl.full((), (1 << 49) - 1, tl.int64)
        for _ in range(49):
            mid = (lo + hi) >> 1
            enough = tl.sum((valid & (key <= mid)).to(tl.int32), axis=0) >= k + 1
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        lo = tl.where(k < 0, -1, lo)
        return tl.where(k >= n, 1 << 62, lo)

    @triton.jit
    def _evict_excess_kernel(
        k_ptr, v_ptr, pos_ptr, score_ptr, table_ptr, lens_ptr, budgets_ptr, n_sink_ptr, n_recent_ptr,
        stride_kp, stride_ks, stride_kh, stride_sp, stride_ss, stride_tb, width, kv_width,
        PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """:func:`topk_evict` of one (sequence ``b``, KV head ``h``) row by selection instead of sorting: for
        rows a few tokens over their budget (decode-time eviction), cost ``O(W * (excess + 100))``.

        Ranks by the key ``(position, slot)`` (distinct, the reference's stable order): the sinks are the keys
        below the ``n_sink``-th smallest, the recent window the keys from the ``(n - n_recent)``-th on (both
        found by bisection). The evicted tokens are the non-forced ones picked lowest score first (NaN as
        -inf; a tie evicts the later key first), one per round. Then the i-th evicted slot below the budget
        takes the i-th kept slot at or past it, in slot order: K, V, position and score copied unchanged (K/V
        rows of ``kv_width`` elements, floats or packed uint8 bytes alike: loads and stores only, masked).
        """
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(lens_ptr + b).to(tl.int64)
        budget = tl.load(budgets_ptr + b).to(tl.int64)
        if n > budget:
            n_sink = tl.load(n_sink_ptr + b).to(tl.int64)
            n_recent = tl.load(n_recent_ptr + b).to(tl.int64)
            j = tl.arange(0, BLOCK_W).to(tl.int64)
            valid = (j < n) & (j < width)
            table_row = table_ptr + b * stride_tb
            page = tl.load(table_row + j // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            slot = page * stride_sp + (j % PAGE_SIZE) * stride_ss + h  # per-slot tensors: [P, S, Hkv]
            pos = tl.load(pos_ptr + slot, mask=valid, other=0).to(tl.int64)
            score = tl.load(score_ptr + slot, mask=valid, other=0.0)
            score = tl.where(score != score, float("-inf"), score)  # NaN ranks lowest
            key = tl.where(valid, (pos + (1 << 31)) * (1 << 17) + j, 1 << 62)
            first_recent = _kth_smallest(key, valid, n - n_recent, n)
            forced = valid & ((key < _kth_smallest(key, valid, n_sink, n)) | (key >= first_recent))
            normal = valid & ~forced
            quota = tl.maximum(budget - n_sink - n_recent, 0)
            n_evict = tl.maximum(tl.sum(normal.to(tl.int64), axis=0) - quota, 0)
            evicted = j < 0  # all False
            for _ in range(0, n_evict):
                cand = normal & ~evicted
                low = tl.min(tl.where(cand, score, float("inf")), axis=0)
                last = tl.max(tl.where(cand & (score == low), key, -1), axis=0)
                evicted = evicted | (key == last)
            hole = evicted & (j < budget)
            mover = valid & ~evicted & (j >= budget)
            d_off = tl.arange(0, BLOCK_D)
            d_mask = d_off < kv_width
            for _ in range(0, tl.sum(hole.to(tl.int32), axis=0)):
                dst = tl.min(tl.where(hole, j, BLOCK_W), axis=0)
                src = tl.min(tl.where(mover, j, BLOCK_W), axis=0)
                hole = hole & (j != dst)
                mover = mover & (j != src)
                src_page = tl.load(table_row + src // PAGE_SIZE).to(tl.int64)
                dst_page = tl.load(table_row + dst // PAGE_SIZE).to(tl.int64)
                src_kv = src_page * stride_kp + (src % PAGE_SIZE) * stride_ks + h * stride_kh + d_off
                dst_kv = dst_page * stride_kp + (dst % PAGE_SIZE) * stride_ks + h * stride_kh + d_off
                tl.store(k_ptr + dst_kv, tl.load(k_ptr + src_kv, mask=d_mask), mask=d_mask)
                tl.store(v_ptr + dst_kv, tl.load(v_ptr + src_kv, mask=d_mask), mask=d_mask)
                src_slot = src_page * stride_sp + (src % PAGE_SIZE) * stride_ss + h
                dst_slot = dst_page * stride_sp + (dst % PAGE_SIZE) * stride_ss + h
                tl.store(pos_ptr + dst_slot, tl.load(pos_ptr + src_slot))
                tl.store(score_ptr + dst_slot, tl.load(score_ptr + src_slot))  # raw: NaN stays NaN


    @triton.jit
    def _release_pages_kernel(table_ptr, lens_ptr, budgets_ptr, free_ptr, n_free_ptr, batch, cols, stride_tb,
                              PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
        """:func:`_release_pages_torch` in one program (the free stack's order is sequence by sequence), the
        new lengths ``new = min(seq_lens[b], budgets[b])`` (the plans' ``new_lens``): pages ``[ceil(new/S),
        min(ceil(len/S), cols))`` of each sequence pushed on the free stack in (b, column) order, their
        table entries set to -1, and ``seq_lens = new``. A sequence's released pages are one run of columns,
        so each block of sequences loops over the longest run (one page or none after a decode step's
        eviction) instead of the table's width."""
        top = tl.load(n_free_ptr)
        for b0 in range(0, batch, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ok = b < batch
            old = tl.load(lens_ptr + b, mask=ok, other=0)
            new = tl.minimum(tl.load(budgets_ptr + b, mask=ok, other=0).to(tl.int64), old.to(tl.int64))
            first = (new + PAGE_SIZE - 1) // PAGE_SIZE
            last = tl.minimum((old.to(tl.int64) + PAGE_SIZE - 1) // PAGE_SIZE, cols)
            count = tl.where(ok, tl.maximum(last - first, 0), 0)
            start = top + tl.cumsum(count, axis=0) - count  # each sequence's first slot on the stack
            row = table_ptr + b.to(tl.int64) * stride_tb
            for j0 in range(0, tl.max(count, axis=0), BLOCK_M):
                j = j0 + tl.arange(0, BLOCK_M)
                release = j[None, :] < count[:, None]
                entry = row[:, None] + first[:, None] + j[None, :]
                page = tl.load(entry, mask=release, other=-1)
                tl.store(free_ptr + start[:, None] + j[None, :], page, mask=release)
                tl.store(entry, tl.full([BLOCK_B, BLOCK_M], -1, page.dtype), mask=release)
            tl.store(lens_ptr + b, new.to(old.dtype), mask=ok)
            top += tl.sum(count, axis=0)
        tl.store(n_free_ptr, top)


def _ceil_div(a, b):
    return (a + b - 1) // b


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def _select_ref(scores: Tensor, budget: int, n_sink: int, n_recent: int) -> Tensor:
    """Logical indices (increasing) of the ``budget`` slots one head keeps out of ``len(scores)``."""
    idx = torch.arange(scores.numel(), device=scores.device)
    forced = (idx < n_sink) | (idx >= scores.numel() - n_recent)
    candidates = idx[~forced]
    cand_scores = scores[candidates]
    cand_scores = torch.where(torch.isnan(cand_scores), float("-inf"), cand_scores)  # NaN ranks lowest
    # A stable descending sort keeps equal scores in slot order: the lower slot wins a tie.
    order = torch.sort(cand_scores, descending=True, stable=True).indices
    chosen = candidates[order[: budget - int(forced.sum())]]
    return torch.sort(torch.cat([idx[forced], chosen])).values


def _compress_ref(page_table: Tensor, seq_lens: Tensor, budgets: Tensor, free_pages: Tensor, n_free: Tensor,
                  page_size: int, rearrange: Callable[[int, Tensor, Tensor, int], None]) -> None:
    """The references' loop: for each sequence ``b`` over its budget, ``rearrange(b, slot_page, slot_off,
    budget)`` puts the kept slots below the budget (``slot_page``, ``slot_off`` ``[L]``: each logical slot's
    page and offset); then the pages past the budget go on the free stack and the length becomes the
    budget."""
    top = int(n_free[0])
    for b in range(page_table.shape[0]):
        length, budget = int(seq_lens[b]), int(budgets[b])
        if length <= budget:
            continue
        n_pages = _ceil_div(length, page_size)
        slot_page = page_table[b, :n_pages].long().repeat_interleave(page_size)[:length]  # [L]
        slot_off = torch.arange(length, device=page_table.device) % page_size  # [L]
        rearrange(b, slot_page, slot_off, budget)
        for col in range(_ceil_div(budget, page_size), n_pages):
            free_pages[top] = page_table[b, col]
            top += 1
            page_table[b, col] = -1
        seq_lens[b] = budget
    n_free[0] = top


def topk_compact_ref(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (),
) -> None:
    """Pure-torch reference of :func:`topk_compact` (same signature, same effect; loops on the host)."""
    pool = [k_pages, v_pages, slot_pos, slot_score, *extra]

    def rearrange(b: int, slot_page: Tensor, slot_off: Tensor, budget: int) -> None:
        for h in range(k_pages.shape[2]):
            keep = _select_ref(slot_score[slot_page, slot_off, h], budget, int(n_sink[b]), int(n_recent[b]))
            for x in pool:
                # The right side is an advanced-index gather, i.e. a copy, so overlapping slots are safe.
                x[slot_page[:budget], slot_off[:budget], h] = x[slot_page[keep], slot_off[keep], h]

    _compress_ref(page_table, seq_lens, budgets, free_pages, n_free, k_pages.shape[1], rearrange)


# ----------------------------------------------------------------------------------------------------
# Triton launcher
# ----------------------------------------------------------------------------------------------------

def _plan_moves(slot_score: Tensor, page_table: Tensor, seq_lens: Tensor, budgets: Tensor, n_sink: Tensor,
                n_recent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Device-side selection, no host sync.

    Returns ``src_map [B, Hkv, M*S + 1]`` int32 (``src_map[b, h, d]`` = logical slot that moves to slot
    ``d``), ``n_move [B]`` int32 (slots to move; 0 for sequences within budget) and ``new_lens [B]`` int64.
    """
    batch, max_pages = page_table.shape
    page_size, n_heads = slot_score.shape[1], slot_score.shape[2]
    max_len = max_pages * page_size
    lens, budget = seq_lens.long(), budgets.long()
    compress = lens > budget
    new_lens = torch.where(compress, budget, lens)

    # Unused table entries hold -1: read page 0 there, the slots are masked as invalid below.
    scores = slot_score[page_table.long().clamp_min(0)]  # [B, M, S, Hkv]
    scores = scores.reshape(batch, max_len, n_heads).transpose(1, 2)  # [B, Hkv, M*S]
    scores = torch.where(torch.isnan(scores), float("-inf"), scores)  # NaN ranks lowest

    j = torch.arange(max_len, device=slot_score.device)
    valid = j < lens[:, None]  # [B, M*S]
    forced = valid & ((j < n_sink.long()[:, None]) | (j >= (lens - n_recent.long())[:, None]))
    normal = (valid & ~forced)[:, None, :].expand(batch, n_heads, max_len)  # [B, Hkv, M*S]

    # Stable descending sort: ties keep slot order, so the lower slot wins. Only non-forced valid slots
    # compete, for the budget left after the forced ones (a score of +-inf cannot displace a forced slot).
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [B, Hkv, M*S]
    normal_sorted = normal.gather(-1, order)
    rank = normal_sorted.cumsum(-1) - 1
    quota = (budget - n_sink.long() - n_recent.long())[:, None, None]
    keep = torch.zeros_like(normal).scatter_(-1, order, normal_sorted & (rank < quota))
    keep |= forced[:, None, :]

    # Kept slot j goes to d = (number of kept slots before j); the rest scatter into the sink column.
    dest = torch.where(keep, keep.cumsum(-1) - 1, max_len)
    src_map = torch.zeros(batch, n_heads, max_len + 1, dtype=torch.int32, device=slot_score.device)
    src_map.scatter_(-1, dest, j.to(torch.int32).expand(batch, n_heads, max_len).contiguous())
    n_move = torch.where(compress, budget, 0).to(torch.int32)
    return src_map, n_move, new_lens


def compaction_plan(scores: Tensor, lens: Tensor, budgets: Tensor, n_sink: Tensor,
                    n_recent: Tensor) -> tuple[Tensor, Tensor]:
    """The selection :func:`topk_compact` makes, for callers that move the bytes in a layout of their own
    (the vLLM plugin's blocks): ``scores [B, Hkv, M]`` of each sequence's slots (past ``lens[b]`` ignored),
    ``lens``, ``budgets``, ``n_sink``, ``n_recent`` ``[B]``. Returns ``src [B, Hkv, M]`` int64, the slot whose
    token lands in slot ``d`` (for ``d < n_move[b]``), and ``n_move [B]`` int64: ``budgets[b]`` where the
    sequence is over its budget, else 0 (nothing moves). The same plan the op runs, ties to the lower slot."""
    batch, _, width = scores.shape
    table = torch.arange(batch, device=scores.device)[:, None]  # sequence b is page b, of `width` slots
    src_map, n_move, _ = _plan_moves(scores.transpose(1, 2), table, lens, budgets, n_sink, n_recent)
    return src_map[..., :width].long(), n_move.long()


def _release_pages_triton(page_table: Tensor, seq_lens: Tensor, budgets: Tensor, free_pages: Tensor,
                          n_free: Tensor, page_size: int) -> None:
    """:func:`_release_pages_torch` with ``new_lens = min(seq_lens, budgets)`` (what both plans compute) as
    one Triton launch (:func:`_release_pages_kernel`). The torch version's ~15 small kernels took ~40 us of
    device time per layer and decode step on an H200 (run 4 of 2026-11-28: the cache's eviction, 46 us in
    all, of which the selection kernel 1 us)."""
    batch, cols = page_table.shape
    launch(_release_pages_kernel, (1,), page_table, seq_lens, budgets, free_pages, n_free, batch, cols,
           page_table.stride(0), PAGE_SIZE=page_size,
           BLOCK_B=min(128, max(16, triton.next_power_of_2(batch))), BLOCK_M=16, num_warps=4)


def _release_pages_torch(page_table: Tensor, seq_lens: Tensor, new_lens: Tensor, free_pages: Tensor,
                         n_free: Tensor, page_size: int) -> None:
    """Push pages ``[ceil(new_len/S), ceil(len/S))`` of each sequence on the free stack, in (b, column)
    order, set their table entries to -1 and store the new lengths. Static shapes, no host sync."""
    num_pages = free_pages.shape[0] - 1
    col = torch.arange(page_table.shape[1], device=page_table.device)
    old_np = _ceil_div(seq_lens.long(), page_size)
    new_np = _ceil_div(new_lens, page_size)
    release = (col >= new_np[:, None]) & (col < old_np[:, None])  # [B, M]
    count = release.sum(1)  # [B]
    first = n_free + count.cumsum(0) - count  # [B] stack index of each sequence's first released page
    slot = torch.where(release, first[:, None] + release.cumsum(1) - 1, num_pages)  # sink P when not released
    free_pages.scatter_(0, slot.flatten(), page_table.flatten())
    n_free += count.sum()
    page_table.masked_fill_(release, -1)
    seq_lens.copy_(new_lens)


def topk_compact_triton(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (),
) -> None:
    """Triton launcher of :func:`topk_compact` (no input checks; one move kernel per pool tensor)."""
    require_triton()
    batch = page_table.shape[0]
    num_pages, page_size, n_heads = k_pages.shape[:3]
    if batch == 0 or num_pages == 0:  # nothing stored (an empty pool means every length is 0)
        return
    src_map, n_move, _ = _plan_moves(slot_score, page_table, seq_lens, budgets, n_sink, n_recent)
    _move_slots(k_pages, v_pages, slot_pos, slot_score, extra, src_map, page_table, n_move)
    _release_pages_triton(page_table, seq_lens, budgets, free_pages, n_free, page_size)


def _move_slots(k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor,
                extra: list[Tensor] | tuple[Tensor, ...], src_map: Tensor, page_table: Tensor,
                n_move: Tensor) -> None:
    """One :func:`_move_slots_kernel` launch per pool tensor: slot ``d < n_move[b]`` of row ``(b, h)`` takes
    slot ``src_map[b, h, d]``'s values."""
    num_pages, page_size, n_heads = k_pages.shape[:3]
    for x in (k_pages, v_pages, slot_pos, slot_score, *extra):
        # [P, S, Hkv, W]: W = D for float K/V, the packed row's bytes for uint8 K/V, 1 for per-slot tensors
        x4 = x.view(num_pages, page_size, n_heads, -1)
        width = x4.shape[3]
        block_w = min(triton.next_power_of_2(width), 64)
        grid = (page_table.shape[0] * n_heads, triton.cdiv(width, block_w))
        launch(
            _move_slots_kernel, grid,
            x4, src_map, page_table, n_move,
            x4.stride(0), x4.stride(1), x4.stride(2),
            src_map.stride(0), src_map.stride(1), page_table.stride(0),
            n_heads, width,
            PAGE_SIZE=page_size, BLOCK_N=64, BLOCK_W=block_w,
        )


# ----------------------------------------------------------------------------------------------------
# Batched torch path (CPU)
# ----------------------------------------------------------------------------------------------------

def topk_compact_torch(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (),
) -> None:
    """Batched torch implementation of :func:`topk_compact` (no input checks), the op's CPU path.

    Same selection plan as the Triton launcher, over all sequences and heads at once, but only as wide
    as the pages in use; the bytes move with one gather into a temporary and one scatter per pool tensor.
    It reads host values (eager only; the op is opaque to ``torch.compile``).
    """
    batch = page_table.shape[0]
    num_pages, page_size, n_heads = k_pages.shape[:3]
    # Nothing stored (an empty pool means every length is 0) or every sequence within its budget.
    if batch == 0 or num_pages == 0 or not bool((seq_lens.long() > budgets.long()).any()):
        return
    width = _ceil_div(int(seq_lens.max()), page_size) * page_size  # W: slots of the widest sequence
    table = page_table[:, : width // page_size].long()  # [B, W/S]
    src_map, n_move, new_lens = _plan_moves(slot_score, table, seq_lens, budgets, n_sink, n_recent)
    src = src_map[..., :width].long()  # [B, Hkv, W]: logical slot that lands in slot d
    d = torch.arange(width, device=k_pages.device)
    # Slots already in place (the sinks, the prefix before the first eviction) are not touched.
    move = (d < n_move[:, None, None]) & (src != d)  # [B, Hkv, W]
    b_idx, h_idx, d_idx = move.nonzero(as_tuple=True)  # [N] each
    j_idx = src[b_idx, h_idx, d_idx]
    # Rows of the pool seen as [P*S*Hkv, D]: one index per moved (slot, head) keeps the copies row-wise.
    src_row = (table[b_idx, j_idx // page_size] * page_size + j_idx % page_size) * n_heads + h_idx  # [N]
    dst_row = (table[b_idx, d_idx // page_size] * page_size + d_idx % page_size) * n_heads + h_idx  # [N]
    for x in (k_pages, v_pages, slot_pos, slot_score, *extra):
        rows = x.view(num_pages * page_size * n_heads, -1)  # [P*S*Hkv, D]: D bytes packed, 1 per-slot
        # Gather into a temporary first, so sources that an earlier destination overwrites are still read.
        rows.index_copy_(0, dst_row, rows.index_select(0, src_row))
    _release_pages_torch(page_table, seq_lens, new_lens, free_pages, n_free, page_size)


# ----------------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------------

@torch.library.custom_op(
    "kvkernels::topk_compact",
    mutates_args=("k_pages", "v_pages", "slot_pos", "slot_score", "page_table", "seq_lens", "free_pages",
                  "n_free", "extra"),
)
def _topk_compact_op(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor],
) -> None:
    impl = topk_compact_triton if use_triton(k_pages) else topk_compact_torch
    impl(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent, free_pages,
         n_free, extra)


@_topk_compact_op.register_fake
def _(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent, free_pages,
      n_free, extra) -> None:
    return None


_INDEX_DTYPES = (torch.int32, torch.int64)
# K/V storage: floats, or uint8 packed rows (a quantized pool: codes + scale and zero point bytes, any width).
KV_DTYPES = (*FLOAT_DTYPES, torch.uint8)


def _check_inputs(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent,
                  free_pages, n_free, extra, validate: bool = True) -> None:
    check_tensor("k_pages", k_pages, ndim=4, dtypes=KV_DTYPES, contiguous=True)
    dev = k_pages.device
    num_pages, page_size, n_heads, _ = k_pages.shape
    check_tensor("v_pages", v_pages)
    if v_pages.dtype != k_pages.dtype:
        v_dtype, k_dtype = (str(t.dtype).replace("torch.", "") for t in (v_pages, k_pages))
        raise TypeError(f"v_pages has dtype {v_dtype} but k_pages has dtype {k_dtype}; K and V "
                        f"must be stored alike (both the same float dtype, or both uint8 packed rows)")
    check_tensor("v_pages", v_pages, device=dev, contiguous=True)
    check_shape("v_pages", v_pages, k_pages.shape, "same as k_pages")
    slot_shape = (num_pages, page_size, n_heads)
    check_tensor("slot_pos", slot_pos, dtypes=(torch.int32,), device=dev, contiguous=True)
    check_shape("slot_pos", slot_pos, slot_shape, "[P, S, Hkv]")
    check_tensor("slot_score", slot_score, dtypes=(torch.float32,), device=dev, contiguous=True)
    check_shape("slot_score", slot_score, slot_shape, "[P, S, Hkv]")
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,), device=dev, contiguous=True)
    batch = page_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), device=dev, contiguous=True)
    check_shape("seq_lens", seq_lens, (batch,), "[B], one length per page_table row")
    for name, t in (("budgets", budgets), ("n_sink", n_sink), ("n_recent", n_recent)):
        check_tensor(name, t, dtypes=_INDEX_DTYPES, device=dev, contiguous=True)
        check_shape(name, t, (batch,), "[B], one entry per sequence")
    check_tensor("free_pages", free_pages, dtypes=(torch.int32,), device=dev, contiguous=True)
    check_shape("free_pages", free_pages, (num_pages + 1,), "[P + 1]: the free stack plus a write sink")
    check_tensor("n_free", n_free, dtypes=(torch.int64,), device=dev)
    check_shape("n_free", n_free, (1,))
    for i, x in enumerate(extra):
        check_tensor(f"extra[{i}]", x, device=dev, contiguous=True)
        check_shape(f"extra[{i}]", x, slot_shape, "[P, S, Hkv], one value per slot")

    if not validate or torch.compiler.is_compiling():  # value checks read the device (a sync)
        return
    if batch and bool((budgets < 1).any()):
        raise ValueError(f"budgets must be >= 1 for every sequence, got {budgets.tolist()}")
    if batch and bool(((n_sink < 0) | (n_recent < 0)).any()):
        raise ValueError(f"n_sink and n_recent must be >= 0, got {n_sink.tolist()} and {n_recent.tolist()}")
    if batch and bool((n_sink.long() + n_recent.long() > budgets.long()).any()):
        raise ValueError(f"n_sink + n_recent must be <= budgets (forced slots count inside the budget), got "
                         f"n_sink={n_sink.tolist()}, n_recent={n_recent.tolist()}, "
                         f"budgets={budgets.tolist()}; raise the budget or shrink the sink / recent window")
    check_seq_lens(seq_lens)
    check_page_table(page_table, seq_lens, num_pages, page_size)
    if not 0 <= int(n_free[0]) <= num_pages:
        raise ValueError(f"n_free={int(n_free[0])} must be in [0, {num_pages}] (the free stack holds at most "
                         f"P pages)")


def topk_compact(k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
                 seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor,
                 n_free: Tensor, extra: list[Tensor] | None = None, *, validate: bool = True) -> None:
    """Keep the top ``budgets[b]`` slots of each (sequence, KV head) in one cache layer, in place.

    Per (sequence ``b``, KV head ``h``): nothing changes when ``seq_lens[b] <= budgets[b]``. Otherwise
    the first ``n_sink[b]`` and last ``n_recent[b]`` slots are kept (forced), plus the highest-scoring
    other slots up to ``budgets[b]`` in all (ties: the lower slot wins; NaN scores rank lowest). Kept
    slots move to the front in their original order with K, V, positions, scores and ``extra`` values
    bit-identical; pages past ``ceil(budgets[b] / S)`` go onto the free stack (in sequence, then
    page-table column order) and their table entries become -1; ``seq_lens[b]`` becomes ``budgets[b]``.

    Parameters
    ----------
    k_pages, v_pages : Tensor ``[P, S, Hkv, D]`` float32 / float16 / bfloat16, or ``[P, S, Hkv, W]`` uint8
        The paged pool (mutated), K and V of one dtype and shape. uint8 holds one packed row of ``W`` bytes
        per (slot, KV head), any width (a quantized pool: codes plus scale and zero point bytes); rows
        move as raw bytes, never read as numbers.
    slot_pos : Tensor ``[P, S, Hkv]`` int32
        Original token position per slot (mutated).
    slot_score : Tensor ``[P, S, Hkv]`` float32
        Eviction score per slot (mutated).
    page_table : Tensor ``[B, M]`` int32
        This layer's page table (mutated: released entries become -1).
    seq_lens : Tensor ``[B]`` int32
        Tokens per sequence in this layer (mutated).
    budgets, n_sink, n_recent : Tensor ``[B]`` int32 or int64
        Slots to keep, forced leading and trailing slots; ``budgets >= 1`` and
        ``n_sink + n_recent <= budgets``.
    free_pages : Tensor ``[P + 1]`` int32
        Free page stack; index ``P`` is a write sink (mutated).
    n_free : Tensor ``[1]`` int64
        Number of valid entries in ``free_pages`` (mutated).
    extra : list of Tensor ``[P, S, Hkv]``, optional
        Further per-slot tensors (any dtype) moved with the slots, e.g. MiniCache magnitudes or masks.
    validate : bool, default True
        Check the values (budgets, forced counts, lengths, page table, free stack) eagerly. Each check reads
        the device, a host sync; a caller that built them itself (the cache, every decode step) passes
        False. Shapes, dtypes and devices are always checked (no sync).

    Raises
    ------
    TypeError, ValueError
        On a bad shape, dtype, device or layout, or (eagerly; skipped under ``torch.compile``) on
        ``budgets < 1``, ``n_sink + n_recent > budgets`` or a page table that points outside the pool.
        Nothing is written when an error is raised. With ``validate=False`` the value checks are the
        caller's.
    """
    extra = list(extra or [])
    _check_inputs(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent,
                  free_pages, n_free, extra, validate)
    torch.ops.kvkernels.topk_compact(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets,
                                     n_sink, n_recent, free_pages, n_free, extra)


# ----------------------------------------------------------------------------------------------------
# Eviction in place: the same tokens kept, only the evicted slots refilled
# ----------------------------------------------------------------------------------------------------

def topk_evict_ref(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (),
) -> None:
    """Pure-torch reference of :func:`topk_evict` (loops on the host, written for clarity)."""
    pool = [k_pages, v_pages, slot_pos, slot_score, *extra]

    def rearrange(b: int, slot_page: Tensor, slot_off: Tensor, budget: int) -> None:
        for h in range(k_pages.shape[2]):
            # The row in position order is what topk_compact sees; select there, then map back to slots.
            by_pos = torch.sort(slot_pos[slot_page, slot_off, h].long(), stable=True).indices  # [L]
            keep_ord = _select_ref(slot_score[slot_page, slot_off, h][by_pos], budget, int(n_sink[b]),
                                   int(n_recent[b]))
            kept = set(by_pos[keep_ord].tolist())
            holes = [d for d in range(budget) if d not in kept]
            movers = [j for j in range(budget, len(slot_page)) if j in kept]
            assert len(holes) == len(movers)
            for d, j in zip(holes, movers):
                for x in pool:
                    x[slot_page[d], slot_off[d], h] = x[slot_page[j], slot_off[j], h]

    _compress_ref(page_table, seq_lens, budgets, free_pages, n_free, k_pages.shape[1], rearrange)


def _plan_evict(slot_score: Tensor, slot_pos: Tensor, table: Tensor, seq_lens: Tensor, budgets: Tensor,
                n_sink: Tensor, n_recent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Which slots each (sequence, head) refills and from where, no host sync.

    ``table [B, W/S]`` covers the ``W`` slots in use. Returns ``holes [B, Hkv, W]`` (evicted slots below
    the budget), ``movers [B, Hkv, W]`` (kept slots at or past it), equal in number per (b, h) and paired in
    slot order, and ``new_lens [B]`` int64.
    """
    batch, n_cols = table.shape
    page_size, n_heads = slot_score.shape[1], slot_score.shape[2]
    width = n_cols * page_size
    lens, budget = seq_lens.long(), budgets.long()
    compress = lens > budget
    new_lens = torch.where(compress, budget, lens)
    rows = table.long().clamp_min(0)  # unused entries (-1) read page 0; those slots are invalid below

    def view(x: Tensor) -> Tensor:  # [P, S, Hkv] -> [B, Hkv, W]
        return x[rows].reshape(batch, width, n_heads).transpose(1, 2)

    j = torch.arange(width, device=slot_score.device)
    valid = (j < lens[:, None])[:, None, :].expand(batch, n_heads, width)  # [B, Hkv, W]
    # The row in position order (invalid slots last): rank[b, h, j] = place of slot j in that order.
    key = torch.where(valid, view(slot_pos).long(), torch.iinfo(torch.int64).max)
    by_pos = torch.sort(key, dim=-1, stable=True).indices  # [B, Hkv, W]: ordered index -> slot
    rank = torch.empty_like(by_pos).scatter_(-1, by_pos, j.expand(batch, n_heads, width).contiguous())
    first_recent = (lens - n_recent.long())[:, None, None]
    forced = valid & ((rank < n_sink.long()[:, None, None]) | (rank >= first_recent))
    normal = valid & ~forced
    scores = torch.where(torch.isnan(view(slot_score)), float("-inf"), view(slot_score))  # NaN ranks lowest
    # Descending by score over the position-ordered row, stable: the earlier token wins a tie.
    order = torch.sort(scores.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices
    slots = by_pos.gather(-1, order)  # [B, Hkv, W]: slots from best to worst
    normal_sorted = normal.gather(-1, slots)
    quota = (budget - n_sink.long() - n_recent.long())[:, None, None]
    keep = torch.zeros_like(normal).scatter_(-1, slots, normal_sorted & (normal_sorted.cumsum(-1) <= quota))
    keep |= forced
    below = j < budget[:, None]  # [B, W]
    holes = compress[:, None, None] & below[:, None, :] & ~keep
    movers = compress[:, None, None] & ~below[:, None, :] & keep
    return holes, movers, new_lens


def topk_evict_torch(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (),
) -> None:
    """Batched torch implementation of :func:`topk_evict` (no input checks), on any device.

    The plan reads every slot's score and position once; the bytes that move are only the kept slots past
    the budget, one gather and one scatter per pool tensor.
    """
    batch = page_table.shape[0]
    num_pages, page_size, n_heads = k_pages.shape[:3]
    if batch == 0 or num_pages == 0 or not bool((seq_lens.long() > budgets.long()).any()):
        return
    width = _ceil_div(int(seq_lens.max()), page_size) * page_size
    table = page_table[:, : width // page_size].long()  # [B, W/S]
    holes, movers, new_lens = _plan_evict(slot_score, slot_pos, table, seq_lens, budgets, n_sink, n_recent)
    # Both enumerate (b, h) blocks in the same order with equal counts: the i-th hole takes the i-th mover.
    b_idx, h_idx, d_idx = holes.nonzero(as_tuple=True)
    j_idx = movers.nonzero(as_tuple=True)[2]
    src_row = (table[b_idx, j_idx // page_size] * page_size + j_idx % page_size) * n_heads + h_idx
    dst_row = (table[b_idx, d_idx // page_size] * page_size + d_idx % page_size) * n_heads + h_idx
    for x in (k_pages, v_pages, slot_pos, slot_score, *extra):
        rows = x.view(num_pages * page_size * n_heads, -1)  # [P*S*Hkv, D]: D bytes packed, 1 per-slot
        rows.index_copy_(0, dst_row, rows.index_select(0, src_row))  # sources and destinations are disjoint
    _release_pages_torch(page_table, seq_lens, new_lens, free_pages, n_free, page_size)


def _pair_holes(holes: Tensor, movers: Tensor) -> Tensor:
    """``src_map [B, Hkv, W]`` int32 for the move kernel: the ``i``-th hole of a (sequence, head) row takes
    its ``i``-th mover, every other slot ``d`` maps to itself (not moved). Static shapes, no host sync."""
    width = holes.shape[-1]
    d = torch.arange(width, device=holes.device).expand_as(holes)  # [B, Hkv, W]
    mover_rank = torch.where(movers, movers.cumsum(-1) - 1, width)  # sink column W for non-movers
    by_rank = torch.zeros(*holes.shape[:-1], width + 1, dtype=torch.int64, device=holes.device)
    by_rank.scatter_(-1, mover_rank, d.contiguous())  # [B, Hkv, W + 1]: i-th mover's slot
    paired = by_rank.gather(-1, (holes.cumsum(-1) - 1).clamp_min(0))  # [B, Hkv, W]
    return torch.where(holes, paired, d).to(torch.int32).contiguous()


# Rows at most this many tokens over their budget (the caller's bound, ``max_excess``) and at most this many
# slots wide are evicted by selection (_evict_excess_kernel), not by the sort-based plan.
EVICT_EXCESS_MAX = 16
EVICT_EXCESS_WIDTH = 4096


def _evict_excess(k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
                  seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor,
                  n_free: Tensor) -> None:
    """One :func:`_evict_excess_kernel` program per (sequence, KV head), then the page release."""
    batch, cols = page_table.shape
    num_pages, page_size, n_heads, kv_width = k_pages.shape  # kv_width: D, or W bytes of a packed row
    width = cols * page_size
    block_w = max(16, triton.next_power_of_2(width))
    launch(
        _evict_excess_kernel, (batch, n_heads),
        k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), slot_pos.stride(0), slot_pos.stride(1),
        page_table.stride(0), width, kv_width,
        PAGE_SIZE=page_size, BLOCK_W=block_w, BLOCK_D=triton.next_power_of_2(kv_width),
        num_warps=4 if block_w <= 1024 else 8,
    )
    _release_pages_triton(page_table, seq_lens, budgets, free_pages, n_free, page_size)


def topk_evict_triton(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor] | tuple[Tensor, ...] = (), max_excess: int = 0,
) -> None:
    """Triton launcher of :func:`topk_evict` (no input checks): the batched torch plan over the page table's
    whole width (so nothing reads a length back to the host: pass only the table columns in use, as the
    cache does), then one move kernel per pool tensor that copies each mover into its hole, then the same
    page release as :func:`topk_compact`. Holes lie below the budget and movers at or past it, so no slot is
    both read and written. With ``max_excess`` (rows at most that many tokens over budget) up to
    :data:`EVICT_EXCESS_MAX`, no ``extra`` and rows up to :data:`EVICT_EXCESS_WIDTH` slots, one selection
    kernel replaces the plan (same result)."""
    require_triton()
    batch = page_table.shape[0]
    num_pages, page_size, n_heads = k_pages.shape[:3]
    if batch == 0 or num_pages == 0 or page_table.shape[1] == 0:
        return
    if (0 < max_excess <= EVICT_EXCESS_MAX and not extra
            and page_table.shape[1] * page_size <= EVICT_EXCESS_WIDTH):
        _evict_excess(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent,
                      free_pages, n_free)
        return
    holes, movers, _ = _plan_evict(slot_score, slot_pos, page_table.long(), seq_lens, budgets, n_sink,
                                   n_recent)
    src_map = _pair_holes(holes, movers)  # [B, Hkv, W]
    n_move = torch.where(seq_lens.long() > budgets.long(), budgets.long(), 0).to(torch.int32)
    _move_slots(k_pages, v_pages, slot_pos, slot_score, extra, src_map, page_table, n_move)
    _release_pages_triton(page_table, seq_lens, budgets, free_pages, n_free, page_size)


@torch.library.custom_op(
    "kvkernels::topk_evict",
    mutates_args=("k_pages", "v_pages", "slot_pos", "slot_score", "page_table", "seq_lens", "free_pages",
                  "n_free", "extra"),
)
def _topk_evict_op(
    k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
    seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor, n_free: Tensor,
    extra: list[Tensor], max_excess: int,
) -> None:
    if use_triton(k_pages):
        topk_evict_triton(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink,
                          n_recent, free_pages, n_free, extra, max_excess)
    else:
        topk_evict_torch(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink,
                         n_recent, free_pages, n_free, extra)


@_topk_evict_op.register_fake
def _(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent, free_pages,
      n_free, extra, max_excess) -> None:
    return None


def topk_evict(k_pages: Tensor, v_pages: Tensor, slot_pos: Tensor, slot_score: Tensor, page_table: Tensor,
               seq_lens: Tensor, budgets: Tensor, n_sink: Tensor, n_recent: Tensor, free_pages: Tensor,
               n_free: Tensor, extra: list[Tensor] | None = None, *, validate: bool = True,
               max_excess: int | None = None) -> None:
    """Keep the tokens :func:`topk_compact` keeps, moving only the kept slots past the budget.

    Attention does not depend on slot order (each slot stores its token's position), so decode-time
    eviction need not move every kept token. Per (sequence ``b``, KV head ``h``) with
    ``seq_lens[b] > budgets[b]``: the forced tokens are the ``n_sink[b]`` of lowest and the ``n_recent[b]``
    of highest stored *position* (not slot); the rest compete by score (ties: the lower position wins; NaN
    ranks lowest), exactly as :func:`topk_compact` on the row sorted by position. Each evicted slot below
    ``budgets[b]`` is refilled by a kept slot at or past it (paired in slot order), so ``seq_lens[b]``
    becomes ``budgets[b]`` with every kept token's K, V (float or packed uint8 rows), position, score and
    ``extra`` values bit-identical; pages past ``ceil(budgets[b] / S)`` go onto the free stack as in
    :func:`topk_compact`. Evicting ``k`` tokens moves at most ``k`` slots per (sequence, head). Slot order
    afterwards is not position order.

    Parameters, errors: as :func:`topk_compact`, and

    max_excess : int, optional
        A bound the caller knows (from its own bookkeeping, without reading the device) on
        ``seq_lens - budgets`` over every row, e.g. 1 for eviction after every decode step. Up to
        :data:`EVICT_EXCESS_MAX` it lets the Triton path select the few evicted tokens per row in one kernel
        instead of sorting every row; the result is the same. A bound that does not hold is an error with
        ``validate`` (else undefined).
    """
    extra = list(extra or [])
    _check_inputs(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets, n_sink, n_recent,
                  free_pages, n_free, extra, validate)
    if max_excess is not None:
        if not isinstance(max_excess, int) or isinstance(max_excess, bool) or max_excess < 1:
            raise ValueError(f"max_excess must be a positive int (a bound on seq_lens - budgets) or None, "
                             f"got {max_excess!r}")
        if validate and not torch.compiler.is_compiling() and page_table.shape[0]:
            over = int((seq_lens.long() - budgets.long()).max())
            if over > max_excess:
                raise ValueError(f"max_excess={max_excess} but a row is {over} tokens over its budget; pass "
                                 f"max_excess >= {over} or None")
    torch.ops.kvkernels.topk_evict(k_pages, v_pages, slot_pos, slot_score, page_table, seq_lens, budgets,
                                   n_sink, n_recent, free_pages, n_free, extra, max_excess or 0)


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

# The launcher runs one move kernel per pool tensor: K/V in every dtype and head dim, the int32 positions,
# the float32 scores and, with MiniCache, the float32 magnitudes and the uint8 mask (the ``extra`` tensors).
COMPILE_AXES: dict[str, tuple] = {
    "dtype": FLOAT_DTYPES,
    "head_dim": (64, 128, 96),
    "n_kv_heads": (1, 8),
    "minicache": (False, True),
}


# The selection kernel of decode-time eviction: K/V dtype and head dim, and the row width (its register tile).
EXCESS_AXES: dict[str, tuple] = {
    "dtype": FLOAT_DTYPES,
    "head_dim": (64, 128, 96),
    "width": (64, 1024, EVICT_EXCESS_WIDTH),
}

# Quantized pools (issue 36): K/V as uint8 packed rows, ``head_dim`` here being the row's bytes (40: head dim
# 64 at 4 bits, group 32), neither a power of two nor a multiple of 16. The payload is only loaded and stored,
# so it interacts with no float axis: a few configurations of its own instead of a value on every axis (the
# per-slot tensors' kernels are those of the float configurations).
PACKED_AXES: dict[str, tuple] = {
    "dtype": (torch.uint8,),
    "head_dim": (40,),
    "n_kv_heads": (1, 8),
    "minicache": (False,),
}
PACKED_EXCESS_AXES: dict[str, tuple] = {
    "dtype": (torch.uint8,),
    "head_dim": (40,),
    "width": (64, EVICT_EXCESS_WIDTH),
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls :func:`topk_compact_triton` (or, for the selection kernel,
    :func:`topk_evict_triton` with ``max_excess=1``) on ``meta`` tensors with one configuration of
    :data:`COMPILE_AXES` / :data:`EXCESS_AXES` (a pairwise covering set, or all with ``full``), then of
    :data:`PACKED_AXES` / :data:`PACKED_EXCESS_AXES` (uint8 packed K/V rows)."""
    for cfg in [*covering(COMPILE_AXES, full=full), *covering(PACKED_AXES, full=full)]:
        label = "topk_compact " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))
    for cfg in [*covering(EXCESS_AXES, full=full), *covering(PACKED_EXCESS_AXES, full=full)]:
        label = "topk_evict max_excess=1 " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch_excess(**cfg))


def _meta_launch_excess(dtype: torch.dtype, head_dim: int, width: int) -> None:
    B, S, H = 3, 16, 8
    M = width // S
    P = B * M + 1
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype = torch.int32) -> Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    topk_evict_triton(t(P, S, H, head_dim, dt=dtype), t(P, S, H, head_dim, dt=dtype), t(P, S, H),
                      t(P, S, H, dt=torch.float32), t(B, M), t(B), t(B), t(B), t(B), t(P + 1),
                      t(1, dt=torch.int64), [], 1)


def _meta_launch(dtype: torch.dtype, head_dim: int, n_kv_heads: int, minicache: bool) -> None:
    B, P, S, M = 3, 40, 16, 12
    meta = torch.device("meta")

    def t(*shape: int, dt: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    slot = (P, S, n_kv_heads)
    extra = [t(*slot) for _ in range(4)] + [t(*slot, dt=torch.uint8)] if minicache else []
    topk_compact_triton(t(*slot, head_dim, dt=dtype), t(*slot, head_dim, dt=dtype), t(*slot, dt=torch.int32),
                        t(*slot), t(B, M, dt=torch.int32), t(B, dt=torch.int32), t(B, dt=torch.int32),
                        t(B, dt=torch.int32), t(B, dt=torch.int32), t(P + 1, dt=torch.int32),
                        t(1, dt=torch.int64), extra)
