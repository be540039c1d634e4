"""Compaction of a paged cache: the calls to ``topk_compact`` / ``topk_evict`` that keep each row at its
budget, and the MiniCache regions a merged pair of layers is stored as (docs/contract.md §5).

One call covers many (layer, row) pairs of the shared pool at once: their page tables stacked are one batch to
the kernel. A call is split in its device work (no host sync; the same ``key``, the same launches on the same
tensors, so decode-time eviction can replay it as a CUDA graph) and its host mirror update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# From the submodule: importing ``kvkernels.topk_compact`` binds the package attribute of that name to the
# submodule, which hides the package's lazily exported function of the same name.
from kvkernels.topk_compact import topk_compact, topk_evict

from .pool import PagePool, ceil_div


def op_rows_key(layers, seqs, *rows: np.ndarray) -> tuple:
    return (tuple(layers), tuple(seqs), *(np.ascontiguousarray(r).tobytes() for r in rows))


@dataclass(frozen=True)
class Compaction:
    """One compaction call (:meth:`Compactor.compaction`): ``device()`` does its tensor work (no host sync),
    ``commit()`` updates the host mirror; ``key`` names the device work (same key, same launches on the same
    tensors) and ``rows`` are the device rows it reads."""

    key: tuple
    rows: tuple
    device: Callable[[], None]
    commit: Callable[[], None]


class Compactor:
    """Compaction calls on the rows of ``page_table [Lc, R, M]`` / ``seq_lens [Lc, R]`` in ``pool``.

    ``layout`` is the policy's ``MergeLayout`` (storage width of each layer: 1 plain, 2 a merged pair's
    region, 0 the pair's second layer). Host lengths (``lens [Lc, R]``, the cache's host mirror) are passed to
    each call. ``memo`` holds the device copies of the calls' index and budget rows (:meth:`op_rows`).
    """

    def __init__(self, pool: PagePool, page_table: torch.Tensor, seq_lens: torch.Tensor, layout):
        self.pool, self.page_table, self.seq_lens, self.layout = pool, page_table, seq_lens, layout
        self.page_size, self.device = pool.page_size, pool.device
        self.memo: dict[tuple, tuple] = {}

    def reset(self) -> None:
        self.memo.clear()

    def width_groups(self, layers) -> dict[int, list[int]]:
        """``layers`` by storage width, one compaction call each: 1 plain layers, 2 merged pairs' regions (a
        pair's second layer, width 0, stores nothing)."""
        width = self.layout.width
        return {w: ls for w in (1, 2) if (ls := [l for l in layers if width[l] == w])}

    def compact(self, lens: np.ndarray, layers: list[int], seqs: list[int], budgets: np.ndarray,
                n_sink: np.ndarray, n_recent: np.ndarray, extra: list[torch.Tensor] | None = None, *,
                in_place: bool = False) -> None:
        """``topk_compact`` (or, ``in_place``, ``topk_evict``) storage layers ``layers`` x rows ``seqs`` in
        one op call, to host ``budgets [len(layers), len(seqs)]`` (with the forced counts beside them), and
        update the host mirror without a sync (:meth:`compaction`, run now)."""
        call = self.compaction(lens, layers, seqs, budgets, n_sink, n_recent, extra, in_place=in_place)
        call.device()
        call.commit()

    def compaction(self, lens: np.ndarray, layers: list[int], seqs: list[int], budgets: np.ndarray,
                   n_sink: np.ndarray, n_recent: np.ndarray, extra: list[torch.Tensor] | None = None, *,
                   in_place: bool = False) -> Compaction:
        """One compaction call, split in its device work and its host mirror update (of ``lens`` and the
        pool's free count).

        The pool is shared, so the rows' page tables stacked into ``[len(layers) * len(seqs), M]`` are one
        batch to the kernel (an eviction over 30 layers is one call, not 30); the free stack receives the
        pages in layer-major order, as one call per layer would push them.

        Nothing here reads the device (a decode step evicts through this every step): the table columns in
        use come from the host mirror, the index and budget tensors are uploaded once per distinct call
        (:meth:`op_rows`), and the op skips its value checks (the plan checked the budgets). The device
        work touches only static buffers and those rows, so the call's ``key`` names it for a CUDA graph.
        """
        pool = self.pool
        host = np.ix_(layers, seqs)
        rows = self.op_rows(layers, seqs, budgets, n_sink, n_recent)
        ix, budgets_t, n_sink_t, n_recent_t = rows
        cols = int(ceil_div(lens[host].max(initial=0), self.page_size))
        extra = extra or []
        # Decode-time eviction is a few tokens over budget: the op then selects instead of sorting.
        kw = {"max_excess": max(1, int((lens[host] - budgets).max(initial=1)))} if in_place else {}
        op = topk_evict if in_place else topk_compact

        def device() -> None:
            table = self.page_table[ix[0], ix[1], :cols].contiguous()  # [L, n, cols], written back below
            seq_lens = self.seq_lens[ix]
            op(pool.k_pages, pool.v_pages, pool.slot_pos, pool.slot_score, table.flatten(0, 1),
               seq_lens.view(-1), budgets_t, n_sink_t, n_recent_t, pool.free_pages, pool.n_free, extra=extra,
               validate=False, **kw)
            self.page_table[ix[0], ix[1], :cols], self.seq_lens[ix] = table, seq_lens

        def commit() -> None:
            old = lens[host]
            new = np.minimum(old, budgets)
            pool.free += int((ceil_div(old, self.page_size) - ceil_div(new, self.page_size)).sum())
            lens[host] = new

        key = (op_rows_key(layers, seqs, budgets, n_sink, n_recent), cols, in_place, len(extra), *kw.values())
        return Compaction(key, rows, device, commit)

    def op_rows(self, layers: list[int], seqs: list[int], *rows: np.ndarray) -> tuple:
        """Device copies of a compaction call's index (``(layers [L, 1], seqs [1, n])``) and of its host rows
        ``[L, n]`` (flattened, int32), uploaded once per distinct call: an upload from host memory waits
        for the device, and decode-time eviction repeats the same call every step."""
        key = op_rows_key(layers, seqs, *rows)
        if key not in self.memo:
            if len(self.memo) > 64:  # prefill calls differ per prompt; keep the memo small
                self.memo.clear()
            ix = (torch.tensor(layers, device=self.device)[:, None],
                  torch.tensor(seqs, device=self.device)[None])
            dev = [torch.as_tensor(r).to(self.device, torch.int32).flatten() for r in rows]
            self.memo[key] = (ix, *dev)
        return self.memo[key]

    def region_extra(self) -> list[torch.Tensor]:
        """Per-slot tensors that move with a region's slots (topk_compact ``extra``)."""
        pool = self.pool
        assert pool.k_mag is not None and pool.v_mag is not None and pool.slot_mask is not None
        return [pool.k_mag[0], pool.k_mag[1], pool.v_mag[0], pool.v_mag[1], pool.slot_mask]

    def compress_calls(self, lens: np.ndarray, plan, n: int, layers: list[int] | None = None,
                       in_place: bool = False, keep_order: bool = False,
                       rows: list[int] | None = None) -> list[Compaction]:
        """The calls that compact every storage layer (of ``layers``) holding more than ``plan``'s budget for
        rows ``0 .. n - 1`` (of ``rows`` only when given: the others' budgets are raised to what they hold,
        which the op leaves as it is), one call per storage width (plain layers, merged regions), not yet run.

        ``in_place`` (decode-time eviction): plain layers evict with ``topk_evict``, which keeps the same
        tokens but moves only the kept slots past the budget, not every kept token after an evicted one.
        ``keep_order`` (Keyformer) stays on ``topk_compact``: its decode noise is indexed by slot, and kept
        slot order is what the reference policies index it by. Merged regions stay in order
        too.
        """
        budgets, n_sink, n_recent = (x.numpy() for x in plan.rows)  # [Lc, n] each
        if rows is not None:
            others = np.setdiff1d(np.arange(n), rows)
            budgets = budgets.copy()
            budgets[:, others] = np.maximum(budgets[:, others], lens[:, others])
        calls = []
        for w, ls in self.width_groups(range(len(lens)) if layers is None else layers).items():
            if not (lens[ls, :n] > budgets[ls]).any():
                continue
            # Every layer of this width, over budget or not (the op leaves the others as they are): one call
            # per width whose device rows finish_prefill uploaded (op_rows), so no decode step uploads.
            calls.append(self.compaction(lens, ls, list(range(n)), budgets[ls], n_sink[ls], n_recent[ls],
                                         extra=self.region_extra() if w == 2 else [],
                                         in_place=in_place and w == 1 and not keep_order))
        return calls

    def merge_pair(self, lens: np.ndarray, n: int, merge, a: int, b: int, keep: np.ndarray,
                   n_sink: np.ndarray, n_recent: np.ndarray) -> None:
        """Turn the prefilled layers ``a`` and ``b`` of rows ``0 .. n - 1`` into one region keeping ``keep
        [n]``
        tokens per row, forced ``n_sink``/``n_recent [n]`` (the plan's ``joint`` row). Per row:

        1. Joint selection: both layers must hold the same tokens, so each slot's score becomes the sum of
           the two layers' scores and both layers keep the same ``N`` tokens (``plan.joint``: ``min(L, R //
           2)``, all ``L`` without prompt compression), forced sinks / recent window ``forced(N)``.
        2. The merge policy's ``region`` (MiniCache's: ``kvkernels.merge_region``) builds the region:
           ``magnitude_direction_merge`` of K and of V over the ``N`` kept tokens (per token and KV head).
           The ``ceil(retain_ratio * N)`` tokens per head with the largest angle ``max(theta_K, theta_V)``
           (one count for K and V, so every head holds the same number of slots) are retained: stored
           privately for each layer with their original K/V and magnitude 1.
        3. The region, in token order: a merged token is one *shared* slot (unit direction, magnitudes in
           ``k_mag``/``v_mag``, ``slot_mask`` 3); a retained token is two slots, ``a``'s (mask 1) then
           ``b``'s (mask 2). Shared slots score ``s_a + s_b``, private slots their own layer's score. The
           region (``N + n_retained`` slots) reuses the first pages of ``a`` and ``b``; the rest, and every
           table entry of ``b``, go back to the pool.
        """
        pool, S = self.pool, self.page_size
        assert pool.k_mag is not None and pool.v_mag is not None and pool.slot_mask is not None
        own_score = pool.slot_score
        if (lens[a, :n] > keep).any():
            # Joint selection on the summed scores; each layer's own score rides along in a copy of the
            # score pool (not in a magnitude pool: that holds the regions of pairs merged before this one).
            own_score = pool.slot_score.clone()
            for i in range(n):
                pa, pb = (self.page_table[l, i, :ceil_div(int(lens[l, i]), S)].long() for l in (a, b))
                total = pool.slot_score[pa] + pool.slot_score[pb]
                pool.slot_score[pa] = total
                pool.slot_score[pb] = total
            both = lambda x: np.stack([x, x])  # noqa: E731 -- the same row for layers a and b
            self.compact(lens, [a, b], list(range(n)), both(keep), both(n_sink), both(n_recent),
                         extra=[own_score])

        for i in range(n):
            N = int(lens[a, i])
            pa, pb = (self.page_table[l, i, :ceil_div(N, S)].long() for l in (a, b))

            def rows(t: torch.Tensor, pages: torch.Tensor, N=N) -> torch.Tensor:
                return t[pages].flatten(0, 1)[:N]  # [N, Hkv, ...], a copy

            ka, kb, va, vb = rows(pool.k_pages, pa), rows(pool.k_pages, pb), rows(pool.v_pages, pa), \
                rows(pool.v_pages, pb)
            sa, sb = rows(own_score, pa), rows(own_score, pb)  # [N, Hkv]
            region = merge.region(ka, kb, va, vb, rows(pool.slot_pos, pa), sa, sb)
            n_slots = region["k"].shape[0]
            n_pages = ceil_div(n_slots, S)
            owned = torch.cat([pa, pb])  # n_slots <= 2N, so the two layers' pages are enough
            pages, released = owned[:n_pages], owned[n_pages:]
            pad = n_pages * S - n_slots
            for name, t in (("k", pool.k_pages), ("v", pool.v_pages), ("pos", pool.slot_pos),
                            ("score", pool.slot_score), ("k_mag_a", pool.k_mag[0]),
                            ("k_mag_b", pool.k_mag[1]), ("v_mag_a", pool.v_mag[0]),
                            ("v_mag_b", pool.v_mag[1]), ("mask", pool.slot_mask)):
                x = region[name]
                x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
                t.index_copy_(0, pages, x.reshape(n_pages, S, *x.shape[1:]))
            pool.give(released.to(torch.int32))
            self.page_table[a, i] = -1
            self.page_table[b, i] = -1
            self.page_table[a, i, :n_pages] = pages.to(torch.int32)
            self.seq_lens[a, i] = n_slots
            self.seq_lens[b, i] = 0
            lens[a, i] = n_slots
            lens[b, i] = 0
