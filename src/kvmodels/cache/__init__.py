"""A paged, ragged KV cache driven by a composed policy (docs/contract.md §1, §4–§6; the layout of this
package is described in docs/contract.md §6.1).

Its parts, one module each:

* ``pool.py``: :class:`PagePool`, the static device buffers (pages, slot positions and scores, MiniCache
  magnitudes) and the stack of free pages, mirrored on the host;
* ``rows.py``: the row layouts, how sequences map to page-table rows (:class:`SequenceRows`, one per sequence;
  :class:`HeadRows`, one per sequence and KV head, for head budgets), a strategy the cache is built with;
* ``mirror.py``: :class:`HostMirror`, the host copy of every row's length and state;
* ``compaction.py``: :class:`Compactor`, the ``topk_compact`` / ``topk_evict`` calls and MiniCache regions;
* ``paged.py``: :class:`PagedKVCache`, the lifecycle (start, finish_prefill, finish_sequence), with its
  phases ``prefill.py`` (prompts), ``decode.py`` (the compiled step and decode-time eviction) and
  ``extend.py`` (pause, extension, restart);
* ``storage.py``: how a row holds a token (the cache's dtype, or packed quantized rows); ``tiers.py``: the
  second region of a cache that keeps tokens in two formats;
* ``report.py``: :class:`CacheReport`; ``contents.py``: the inspection methods (``report``,
  ``head_contents``, ``layer_contents``);
* ``state.py``: ``CacheState``, the phases' base class: declarations of the cache's attributes they read.
"""

from __future__ import annotations

from .compaction import Compaction, Compactor
from .extend import ProbeSpan
from .mirror import HostMirror
from .paged import HeadPagedKVCache, PagedKVCache
from .pool import PagePool
from .report import CacheReport
from .rows import HeadRows, SequenceRows

__all__ = ["CacheReport", "Compaction", "Compactor", "HeadPagedKVCache", "HeadRows", "HostMirror", "PagePool",
           "PagedKVCache", "ProbeSpan", "SequenceRows", "paged_cache"]


def paged_cache(**kw) -> PagedKVCache:
    """The cache ``kw["policy"]`` needs, built from ``PagedKVCache``'s keywords: a :class:`HeadPagedKVCache`
    (rows per KV head) when the policy gives the KV heads of a layer different budgets
    (``policy.heads.per_head``), else a :class:`PagedKVCache`. ``num_pages`` counts pages of every KV head; it
    is scaled to one-head pages."""
    policy = kw.get("policy")
    if policy is None or not policy.heads.per_head:
        return PagedKVCache(**kw)
    if kw.get("num_pages") is not None:
        kw["num_pages"] = kw["num_pages"] * kw["n_kv_heads"]
    return HeadPagedKVCache(**kw)
