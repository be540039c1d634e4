"""Per-head pages (Ada-KV): :class:`HeadPagedKVCache`, a ``PagedKVCache`` with one row per (sequence, KV
head).

The cache lives in :mod:`kvmodels.cache` (the row layout is ``kvmodels.cache.rows.HeadRows``); this module
keeps the import path ``from kvmodels.head_cache import HeadPagedKVCache``.

``PagedKVCache`` stores a token in slot ``i`` of a page for every KV head at once (pages ``[S, Hkv, D]``), so
the heads of a layer always hold the same number of slots. A head-budget policy such as ``adakv``
(``kvpolicies.heads``) gives them different counts; holding those in shared slots would mean masking the
shorter heads' empty slots, which costs memory instead of saving it (docs/design-adakv.md measures it). With
rows per KV head every (sequence, KV head) pair has its own page table, length and budget, in pages of one
head, so a head that keeps ``n`` tokens holds ``ceil(n / S)`` pages (docs/contract.md §4.1).
"""

from __future__ import annotations

from kvmodels.cache import HeadPagedKVCache

__all__ = ["HeadPagedKVCache"]
