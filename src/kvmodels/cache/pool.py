"""The page pool: the static device buffers every cache layer's pages live in, and the stack of free pages.

Layout: pages ``0 .. num_pages - 1`` are real pages handed out by the free stack; page ``num_pages`` is a
*trash page* that rows without a sequence (finished, or beyond the batch) write into, so ``append`` needs no
branch for them. ``free_pages[num_pages + 1]`` is the kernels' write sink.

Every tensor is allocated once and only ever updated in place, so a compiled decode step never sees a new
shape or address. The pool mirrors the height of its free stack on the host (``free``): lengths never depend
on scores, so the cache can check page availability without a device sync.
"""

from __future__ import annotations

import numpy as np
import torch


def ceil_div(a, b):
    """``ceil(a / b)`` for ints and integer arrays."""
    return -(-a // b)


def per_head_gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [n, Hkv, ...]`` with each KV head's rows taken in the order ``index [n, Hkv]`` gives it (e.g. a
    row's slots sorted by position, per head)."""
    return x.gather(0, index.view(*index.shape, *[1] * (x.dim() - 2)).expand_as(x))


class PagePool:
    """Pages of ``page_size`` slots for ``n_kv_heads`` heads of ``head_dim`` (``[P + 1, S, Hkv, ...]``, the
    last page the trash page) and the free stack.

    Attributes
    ----------
    k_pages, v_pages:
        ``[P + 1, S, Hkv, W]`` keys (after RoPE) and values as the row storage holds them
        (``kvmodels.cache.storage``: ``W = D`` in the cache's dtype, or packed quantized rows of ``W``
        bytes).
    slot_pos, slot_score:
        ``[P + 1, S, Hkv]`` int32 original position and float32 eviction score of each slot.
    free_pages, n_free:
        ``[P + 2]`` int32 stack of free page ids and ``[1]`` int64 its height.
    k_mag, v_mag, slot_mask:
        With ``merged`` (MiniCache) only, else ``None``: ``[2, P + 1, S, Hkv]`` float32 per-slot magnitudes of
        a merged region (member 0 = layer ``a``, 1 = layer ``b``; 1.0 on private slots) and ``[P + 1, S,
        Hkv]`` uint8 visibility of a region's slots (bit 1 = layer ``a``, bit 2 = layer ``b``).
    free:
        Host mirror of ``n_free``.
    page_bytes:
        Bytes one page holds (K and V of every head, the int32 position and float32 score of each (slot,
        head); with merging the four magnitudes and the mask byte as well).
    native_page_bytes:
        What the page would hold with K and V in the cache's dtype (``page_bytes`` unless quantized).
    """

    def __init__(self, num_pages: int, page_size: int, n_kv_heads: int, storage, *, device: torch.device,
                 merged: bool, name: str = "num_pages"):
        self.num_pages, self.page_size, self.device = num_pages, page_size, device
        self.name = name  # the argument that sizes this pool, for its errors
        self.trash_page = num_pages
        P, S, H, W, dev = num_pages + 1, page_size, n_kv_heads, storage.width, device
        self.k_pages = torch.zeros(P, S, H, W, dtype=storage.page_dtype, device=dev)
        self.v_pages = torch.zeros(P, S, H, W, dtype=storage.page_dtype, device=dev)
        self.slot_pos = torch.zeros(P, S, H, dtype=torch.int32, device=dev)
        self.slot_score = torch.zeros(P, S, H, dtype=torch.float32, device=dev)
        self.free_pages = torch.zeros(P + 1, dtype=torch.int32, device=dev)
        self.n_free = torch.zeros(1, dtype=torch.int64, device=dev)
        self.k_mag = self.v_mag = self.slot_mask = None
        extra_bytes = 0
        if merged:
            self.k_mag = torch.ones(2, P, S, H, dtype=torch.float32, device=dev)
            self.v_mag = torch.ones(2, P, S, H, dtype=torch.float32, device=dev)
            self.slot_mask = torch.zeros(P, S, H, dtype=torch.uint8, device=dev)
            extra_bytes = 4 * 4 + 1
        per_slot = 4 + 4 + extra_bytes  # position, score (and the merge's magnitudes and mask)
        self.page_bytes = S * H * (2 * storage.row_bytes + per_slot)
        native_row = storage.head_dim * torch.empty(0, dtype=storage.dtype).element_size()
        self.native_page_bytes = S * H * (2 * native_row + per_slot)
        self.free = num_pages

    def reset(self) -> None:
        """Every page free, every score zero (in place: a compiled step keeps its buffers)."""
        P = self.num_pages
        # Popping from the top of the stack hands out low page ids first.
        self.free_pages[:P].copy_(torch.arange(P - 1, -1, -1, dtype=torch.int32, device=self.device))
        self.free_pages[P:].fill_(-1)
        self.n_free.fill_(P)
        self.slot_score.zero_()
        self.free = P

    def take(self, n: int) -> torch.Tensor:
        """Pop ``n`` pages off the stack (the caller checked ``n <= free``): their int32 ids, a view of the
        stack to copy from before the next push."""
        pages = self.free_pages[self.free - n:self.free]
        self.n_free -= n
        self.free -= n
        return pages

    def give(self, ids: torch.Tensor) -> None:
        """Push the int32 page ids ``ids`` on the stack."""
        n = len(ids)
        self.free_pages[self.free:self.free + n] = ids
        self.n_free += n
        self.free += n

    def write_prompt(self, storage, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scores: torch.Tensor) -> torch.Tensor:
        """Pop the pages ``L`` tokens need (the caller checked they are free) and store them in slot order:
        ``k``/``v`` ``[L, Hkv, D]`` through ``storage.encode``, ``positions [L]``, ``scores [L, Hkv]``.
        Returns the int32 page ids, for the row's page table."""
        L, H = k.shape[:2]
        n_pages = ceil_div(L, self.page_size)
        pages = self.take(n_pages).to(torch.int64)
        pad = n_pages * self.page_size - L

        def paged(x: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [n_pages, S, ...]
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
            return x.reshape(n_pages, self.page_size, *x.shape[1:])

        self.k_pages.index_copy_(0, pages, paged(storage.encode(k)))
        self.v_pages.index_copy_(0, pages, paged(storage.encode(v)))
        self.slot_pos.index_copy_(0, pages, paged(positions.to(torch.int32)[:, None].expand(L, H)))
        self.slot_score.index_copy_(0, pages, paged(scores.to(torch.float32).contiguous()))
        return pages.to(torch.int32)

    def release(self, table: torch.Tensor, lens) -> None:
        """Push the pages the rows of ``table`` (``[..., M]``, a view of a page table) hold -- the first
        ``ceil(lens / S)`` entries of each, ``lens`` the host lengths of the same shape -- in row order, and
        mark the rows empty (-1)."""
        rows = table.reshape(-1, table.shape[-1])
        counts = ceil_div(np.asarray(lens).reshape(-1), self.page_size)
        held = [rows[i, :int(c)] for i, c in enumerate(counts) if c]
        if held:
            self.give(torch.cat(held))
        table.fill_(-1)

    def out_of_pages(self, need: int, what: str) -> RuntimeError:
        return RuntimeError(
            f"cache out of pages: {what} needs {need} more pages but only {self.free} of {self.num_pages} "
            f"are free (page_size={self.page_size}); raise {self.name} or lower max_batch/budget")
