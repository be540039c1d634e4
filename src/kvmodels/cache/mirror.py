"""The host mirror of a paged cache's rows: lengths and row states, kept without reading the device.

Lengths never depend on scores (only on prompt lengths, budgets and the step), so the cache tracks them on the
host as it changes them on the device: page availability is checked, compaction calls are keyed and reports
are made without a sync.
"""

from __future__ import annotations

import numpy as np

from .pool import ceil_div


class HostMirror:
    """Per (cache layer, pool row) and per pool row, what the device holds; a new one per batch.

    Attributes
    ----------
    lens:
        ``[Lc, R]`` int64 slots each layer holds for each row, after the current step's append.
    seen:
        ``[R]`` tokens each row's sequence has seen.
    active, parked:
        ``[R]`` bool: rows decoding, and rows sitting out the decode steps (pause: pages kept, nothing
        appended).
    stat_tokens:
        ``[Lc, R]`` tokens behind each (layer, row)'s budget statistic (``cos_sim``): a running mean over
        extensions.
    prefilled:
        ``[Lc, R]`` bool, (layer, row) prefilled (or finished: nothing left to prefill).
    compressed:
        ``[R]`` bool, prompt compressed by ``compress_prompt``.
    peak_pages, full_peak_pages:
        Most pages held since ``start``, and most an uncompressed cache would have held.
    full_caps:
        ``[Lc, 1]`` the most tokens an uncompressed layer holds (a sliding-window layer's window ``W``).
    """

    def __init__(self, n_layers: int, n_rows: int, windows: tuple[int, ...] = ()):
        self.lens = np.zeros((n_layers, n_rows), dtype=np.int64)
        self.seen = np.zeros(n_rows, dtype=np.int64)
        self.active = np.zeros(n_rows, dtype=bool)
        self.parked = np.zeros(n_rows, dtype=bool)
        self.stat_tokens = np.zeros((n_layers, n_rows), dtype=np.int64)
        self.prefilled = np.zeros((n_layers, n_rows), dtype=bool)
        self.compressed = np.zeros(n_rows, dtype=bool)
        self.peak_pages = 0
        self.full_peak_pages = 0
        # [Lc, 1] the most tokens an uncompressed layer holds: a sliding-window layer its window
        big = np.iinfo(np.int64).max
        self.full_caps = np.array([w or big for w in windows] or [big] * n_layers, dtype=np.int64)[:, None]

    def holding(self) -> np.ndarray:
        """``[R]`` bool, rows holding a sequence: decoding (active) or paused."""
        return self.active | self.parked

    def pages_held(self, page_size: int) -> np.ndarray:
        return ceil_div(self.lens, page_size)  # [Lc, R]

    def full_pages(self, page_size: int) -> int:
        """Pages an uncompressed cache would hold now: every token seen by every holding row, in every
        layer (a sliding-window layer: the last ``W``, all its attention reads)."""
        seen = np.minimum(self.seen[self.holding()][None, :], self.full_caps)  # [Lc, rows]
        return int(ceil_div(seen, page_size).sum())

    def track_peak(self, page_size: int) -> None:
        self.peak_pages = max(self.peak_pages, int(self.pages_held(page_size).sum()))
        self.full_peak_pages = max(self.full_peak_pages, self.full_pages(page_size))
