"""The paged cache's inspection (:class:`InspectSteps`, mixed into ``PagedKVCache`` like its prefill, decode
and extend steps): ``report`` (a :class:`CacheReport` from the host mirror, no device sync), and
``head_contents`` / ``layer_contents``, which read the pool token by token (for tests and debugging)."""

from __future__ import annotations

import torch

from kvkernels.merge import merge_restore

from .pool import ceil_div, per_head_gather
from .report import CacheReport
from .rows import check_sequence
from .state import CacheState


class InspectSteps(CacheState):
    """What the cache holds, as a :class:`CacheReport` and token by token; reads only the cache's
    attributes."""

    def head_contents(self, l: int, b: int) -> list[dict[str, torch.Tensor]]:
        """Kept tokens of layer ``l``, sequence ``b``, one dict per KV head, in position order: ``k``/``v``
        ``[n_h, D]``, ``pos`` ``[n_h]`` int32, ``score`` ``[n_h]`` float32 (syncs; for tests). The heads may
        hold different counts (rows per KV head)."""
        return [{name: x[:, h] for name, x in self._row_contents(l, row).items()}
                for row in self.rows.rows(check_sequence(b, self.n_sequences))
                for h in range(self.n_kv_heads)]

    def layer_contents(self, l: int, b: int) -> dict[str, torch.Tensor]:
        """Kept tokens of layer ``l``, sequence ``b`` in position order per KV head (for tests and debugging;
        syncs). Decode-time eviction in place leaves slots out of position order; this view sorts them.

        Returns ``k``/``v`` ``[n, Hkv, D]``, ``pos`` ``[n, Hkv]`` int32 and ``score`` ``[n, Hkv]`` float32,
        ``n = seq_lens[l, b]``. For a layer of a merged pair these are the slots of the pair's region in slot
        order (a region is always compacted in order), with ``k``/``v`` restored through this layer's
        magnitudes, plus ``visible`` ``[n, Hkv]`` bool (the slots this layer attends to; the others are the
        other layer's private slots).
        """
        self.rows.check_layer_contents()
        return self._row_contents(l, b)

    def _row_contents(self, l: int, b: int) -> dict[str, torch.Tensor]:
        """:meth:`layer_contents` of pool row ``b``."""
        self._check_layer(l)
        s = self.layout.storage[l]
        n = int(self.seq_lens[s, b])
        pages = self.page_table[s, b, :ceil_div(n, self.page_size)].to(torch.int64)

        def rows(pool: torch.Tensor) -> torch.Tensor:
            return pool[pages].flatten(0, 1)[:n]

        decode = self.storage.decode  # quantized rows come back dequantized, in the cache's dtype
        out = {"k": decode(rows(self.k_pages)), "v": decode(rows(self.v_pages)), "pos": rows(self.slot_pos),
               "score": rows(self.slot_score)}
        if self.key_scale is not None:  # channel-separable keys: stored as k / c
            out["k"] = out["k"] * self.key_scale[s, b].to(out["k"].dtype)
        if self.layout.merged[l]:
            assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
            m = self.layout.member[l]
            out["k"] = merge_restore(out["k"], rows(self.k_mag[m]))
            out["v"] = merge_restore(out["v"], rows(self.v_mag[m]))
            out["visible"] = (rows(self.slot_mask) & self.layout.mask_bit(l)) != 0
            return out
        order = torch.sort(out["pos"].long(), dim=0, stable=True).indices  # [n, Hkv]
        return {name: per_head_gather(x, order) for name, x in out.items()}

    def report(self) -> CacheReport:
        """Bytes and tokens held now, the peak since ``start`` and the uncompressed equivalent (per sequence:
        with rows per KV head, the means over a sequence's heads and ``head_tokens``)."""
        n = self.batch_size
        host = self.host
        per_layer = host.pages_held(self.page_size).sum(axis=1) * self.page_bytes
        peak = host.peak_pages * self.page_bytes
        rows = self.storage.describe()
        if self.side is not None:  # both regions; the peak is each region's own peak, summed (a bound)
            per_layer = per_layer + self.side.pages_held() * self.side.pool.page_bytes
            peak += self.side.peak_pages * self.side.pool.page_bytes
            rows += f" and {self.side.storage.describe()}"
        if self.key_scale is not None:  # (its [rows, Hkv, D] float32 factors are not in the page bytes)
            rows += "; keys over per-channel factors (ZipCache's channel-separable keys)"
        tokens = host.lens if self.side is None else host.lens + self.side.lens  # both regions' tokens
        full_pages = host.full_pages(self.page_size)
        budgets = None
        if self.plan is not None:  # the storage layers' budgets: a region's under its owner, 0 under b
            budgets = tuple(tuple(int(x) for x in row) for row in self.plan.rows.budgets.tolist())
        return self.rows.report(CacheReport(
            page_size=self.page_size, page_bytes=self.page_bytes, num_pages=self.num_pages,
            bytes_per_layer=tuple(int(x) for x in per_layer), total_bytes=int(per_layer.sum()),
            peak_bytes=peak,
            full_cache_bytes=full_pages * self.pool.native_page_bytes,
            full_cache_peak_bytes=host.full_peak_pages * self.pool.native_page_bytes,
            rows=rows, quantized=self.storage.quantized or self.side is not None,
            tokens_per_layer=tuple(tuple(int(x) for x in row[:n]) for row in tokens),
            layer_budgets=budgets, merged_pairs=self.layout.pairs, windows=self.windows), self.n_sequences)
