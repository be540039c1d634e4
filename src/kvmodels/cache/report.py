"""What a paged cache holds, from its host mirror: :class:`CacheReport` (``PagedKVCache.report()``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheReport:
    """Memory held by a :class:`PagedKVCache`, from its host mirror (no device sync).

    Attributes
    ----------
    page_size, page_bytes:
        Slots per page and bytes per page (K and V of every KV head plus the int32 position and the float32
        score of each (slot, head); with MiniCache also the four float32 magnitudes and the uint8 visibility
        mask of each (slot, head), which the pool then holds for every page).
    num_pages:
        Pages in the pool (not counting the trash page).
    bytes_per_layer:
        ``[Lc]`` bytes of the pages each cache layer holds now.
    total_bytes:
        Sum of ``bytes_per_layer``.
    peak_bytes:
        Largest ``total_bytes`` since ``start`` (prefill holds the full prompt before compression).
    full_cache_bytes, full_cache_peak_bytes:
        What an uncompressed cache with the same pages would hold now / at its peak: every token seen by
        every active sequence in every cache layer (a sliding-window layer: its last ``W``, as the model's
        own cache), with K and V in the cache's dtype (unquantized).
    tokens_per_layer:
        ``[Lc][B]`` slots each layer stores for each sequence of the batch (0 for finished sequences); with
        two formats, both regions' (``kvmodels.cache.tiers``).
    layer_budgets:
        ``[Lc][B]`` per-layer slot budgets (``None`` before ``finish_prefill``).
    merged_pairs:
        MiniCache pairs ``(a, b)``. A pair's shared region is listed under ``a`` (its bytes, its slots --
        shared slots once, each layer's private slots -- and the pair's budget ``B_a + B_b``); ``b`` lists 0
        of each, so every column still sums to what the cache holds and the budgets still sum to
        ``Lc * budget_tokens``.
    head_tokens:
        ``[Lc][B][Hkv]`` tokens each KV head holds, from a cache with one row per KV head (``rows="heads"``,
        ``HeadPagedKVCache``: its heads hold different counts, and its ``tokens_per_layer`` and
        ``layer_budgets`` are then means over the heads); else ``None``.
    rows:
        How a stored row holds a token (``kvmodels.cache.storage``: the dtype, or the quantized format and
        its bytes per row); ``quantized`` whether rows are quantized (``full_cache_bytes`` is then the
        unquantized cache's).
    windows:
        The model's sliding windows per cache layer (``PagedKVCache(windows=...)``; empty without any).
    """

    page_size: int
    page_bytes: int
    num_pages: int
    bytes_per_layer: tuple[int, ...]
    total_bytes: int
    peak_bytes: int
    full_cache_bytes: int
    full_cache_peak_bytes: int
    tokens_per_layer: tuple[tuple[float, ...], ...]
    layer_budgets: tuple[tuple[float, ...], ...] | None
    merged_pairs: tuple[tuple[int, int], ...] = ()
    head_tokens: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    rows: str = ""
    quantized: bool = False
    windows: tuple[int, ...] = ()

    @property
    def pages_in_use(self) -> int:
        return self.total_bytes // self.page_bytes

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f"{'layer':>5} {'MiB':>10} {'tokens per sequence':<30} {'budgets':<30}"]
        for l, nbytes in enumerate(self.bytes_per_layer):
            toks = " ".join(str(t) for t in self.tokens_per_layer[l])
            budgets = "-" if self.layer_budgets is None else " ".join(str(t) for t in self.layer_budgets[l])
            lines.append(f"{l:>5} {nbytes * mib:>10.3f} {toks:<30} {budgets:<30}")
        ratio = self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else float("nan")
        lines += [
            f"total {self.total_bytes * mib:.3f} MiB in {self.pages_in_use}/{self.num_pages} pages of "
            f"{self.page_size} slots ({self.page_bytes} B each)" + (f"; {self.rows}" if self.rows else ""),
            f"peak  {self.peak_bytes * mib:.3f} MiB",
            f"full cache {self.full_cache_bytes * mib:.3f} MiB now, "
            f"{self.full_cache_peak_bytes * mib:.3f} MiB peak; held/full = {ratio:.3f}",
        ]
        if self.merged_pairs:
            lines.append(f"merged pairs (stored under the first layer): {list(self.merged_pairs)}")
        return "\n".join(lines)
