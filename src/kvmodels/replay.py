"""CUDA graphs of the eager device work a decode step repeats (decode-time eviction).

Between two compiled decode steps the cache evicts: a plan of a few dozen small tensor ops and one move
kernel per pool tensor, every step, with the same tensors and shapes. Launched one by one that costs the
host about a millisecond per step (measured on an H200: streaming at budget 0.2 decoded at 0.72x the full
cache, batch 16, ``bench/results/nvidia-h200-2026-11-26/run3``). Replayed as one CUDA graph it is one launch.

:class:`Replays` runs a function eagerly the first time it sees its key (which also compiles its Triton
kernels), captures it into a CUDA graph the second time, and replays the graph from then on. The function
must be free of host syncs and its key must name everything its launches read from the host: the tensors
it touches must be the same objects, at the same addresses, on every call with that key (the cache's
static buffers, and index rows the caller hands over in ``keep`` so they outlive the graph).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch


class Replays:
    """Per key: eager on first sight, captured on the second, replayed after; eager where graphs are off.

    ``enabled``: only for CUDA devices (elsewhere :meth:`run` just calls the function); the environment
    variable ``KVPOLICIES_EVICTION_GRAPHS=0`` turns graphs off everywhere (to compare, or to debug). A
    capture that fails turns them off for this object, with one warning, and the work runs eagerly.
    ``limit``: the most graphs held (each keeps its scratch memory in a pool the graphs share); a key past
    it stays eager. ``graph_factory``: for tests, an object with ``capturing()`` and ``capture(fn,
    pool)``, which returns something with ``replay()`` and ``pool()``; the default uses
    ``torch.cuda.CUDAGraph``.
    """

    def __init__(self, enabled: bool, limit: int = 8, graph_factory=None):
        self.enabled = enabled and os.environ.get("KVPOLICIES_EVICTION_GRAPHS", "1") != "0"
        self.limit = limit
        self._factory = graph_factory or _CudaGraphs()
        self._graphs: dict[Hashable, tuple[Any, tuple]] = {}  # key -> (its graph, the tensors it keeps)
        self._seen: set[Hashable] = set()
        self._pool = None
        self.failure: str | None = None  # why capturing failed, if it did (graphs are then off)
        self.captures = 0  # graphs captured since the last clear (reported by tests and the bench)
        self.replays = 0

    def run(self, key: Hashable, fn: Callable[[], None], keep: tuple = ()) -> None:
        """Do ``fn()``'s device work: eagerly, or by capturing then replaying the graph for ``key``.
        ``keep``: objects (tensors the graph reads) held as long as the graph is."""
        if not self.enabled or self._factory.capturing():  # inside a caller's capture: record into it
            fn()
            return
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen or len(self._graphs) >= self.limit:
                self._seen.add(key)
                fn()
                return
            try:
                graph = self._factory.capture(fn, self._pool)
            except Exception as e:  # noqa: BLE001 - a capture that fails leaves eager launches, said once
                self.enabled, self.failure = False, f"{type(e).__name__}: {e}"
                warnings.warn(f"kvmodels: decode-time eviction could not be captured as a CUDA graph "
                              f"({self.failure}); it runs eagerly from now on (slower, same tokens)",
                              RuntimeWarning, stacklevel=2)
                fn()
                return
            if self._pool is None:
                self._pool = graph.pool()
            entry = self._graphs[key] = (graph, tuple(keep))
            self.captures += 1
        entry[0].replay()  # a capture only records: this runs the work of this call too
        self.replays += 1

    def clear(self) -> None:
        """Drop every graph (their memory goes back with the pool once none is left)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None
        self.captures = self.replays = 0


class _CudaGraphs:
    @staticmethod
    def capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    @staticmethod
    def capture(fn: Callable[[], None], pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph
