"""Launch parameters of the Triton kernels: defaults, the values measured best per GPU architecture, and an
override for sweeps.

Each launcher asks :func:`launch_config` for its kernel's :class:`LaunchConfig` (the tile along the sequence,
``num_warps``, ``num_stages``). The order: an :func:`override` in force (``bench/gpu.py`` sweeps with it),
then :data:`TUNED` for the tensor's compute capability, then :data:`DEFAULTS`. Under the Triton interpreter
(``TRITON_INTERPRET=1``, the CPU tests) the tile is 16, so small test inputs still cross tile edges.

``bench/gpu.py`` measures every candidate of :data:`SWEEP` on the GPU it runs on and prints the
:data:`TUNED` lines of the best per shape; a developer commits them here with the run's results file under
``bench/results/``. Split-K (``num_splits`` of the decode kernel) is chosen per call from the shape; the
sweep measures it too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvkernels._triton import INTERPRET


@dataclass(frozen=True)
class LaunchConfig:
    """How one Triton kernel is launched.

    Attributes
    ----------
    block:
        Tile length along the sequence (slots per step of the decode kernel; query and key rows of the
        prefill scorer). A power of two >= 16.
    num_warps, num_stages:
        Passed to the launch (``num_stages`` is Triton's software-pipelining depth).
    """

    block: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"block={self.block} must be a power of two >= 16 (tl.dot needs 16)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages={self.num_stages} must be in [1, 8]")


#: The kernels that take a :class:`LaunchConfig`.
KERNELS = ("decode", "prefill_scores", "quant_decode")

DEFAULTS: dict[str, LaunchConfig] = {
    "decode": LaunchConfig(block=64, num_warps=4, num_stages=3),
    "prefill_scores": LaunchConfig(block=64, num_warps=4, num_stages=3),
    # Decode over packed pages (kvkernels.quant_attention): a [block, D] float32 tile is dequantized in
    # registers before the tensor-core product, so half the native decode's tile.
    "quant_decode": LaunchConfig(block=32, num_warps=4, num_stages=3),
}

#: Measured best per ``(kernel, compute capability as major * 10 + minor)``; see ``bench/results/``.
TUNED: dict[tuple[str, int], LaunchConfig] = {
    # NVIDIA H200, torch 2.11 / Triton 3.6, bench/results/nvidia-h200-2026-11-26/run1: the defaults were the
    # best of the configs the time box let the sweep reach (decode: 11 of 27, at B8/B64-L4096 and B1-L32768;
    # prefill scorer: 11 of 12, 0.757 ms at L4096). Sweep again when the kernels change.
    ("decode", 90): LaunchConfig(block=64, num_warps=4, num_stages=3),
    ("prefill_scores", 90): LaunchConfig(block=64, num_warps=4, num_stages=3),
    # Decode over 4-bit pages, B64-L4096 (bench/results/nvidia-h200-2026-11-27/run10): 364 us with the loads
    # prefetched by hand (quant_attention.PREFETCH_TILES), against 416 us without at this config and 386 us at
    # run 8's best (64/4/2, 392 us in run 8; block 16 took twice block 32's time there: a per-tile cost
    # bounds this kernel). Run 1 of 2026-11-28 again at this config, the best of the 24 swept (12 configs,
    # prefetched or not): 4-bit 367 us prefetched (418 without), 8-bit 415 us prefetched (446 without);
    # B8-L4096: 63.6 / 75.6 us.
    ("quant_decode", 90): LaunchConfig(block=32, num_warps=4, num_stages=3),
}

#: What ``bench/gpu.py`` sweeps per kernel (the product of these values).
SWEEP: dict[str, dict[str, tuple[int, ...]]] = {
    "decode": {"block": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4)},
    "prefill_scores": {"block": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)},
    # Run 4 of 2026-11-28 (H200, B64/4k, 4-bit): block 128 no better than 64 (376-377 us at 4 warps vs
    # 383), 8 warps 15-45% slower than 4 at every block, num_stages within 1% (the prefetched loop's loads
    # are issued by hand); 2 warps never measured. Fewer warps per program: fewer to synchronise at each
    # tile's layout conversions, and room for more programs per SM.
    "quant_decode": {"block": (32, 64), "num_warps": (2, 4, 8), "num_stages": (2, 3)},
}

_INTERPRETER = LaunchConfig(block=16, num_warps=4, num_stages=3)
_OVERRIDE: contextvars.ContextVar[dict[str, LaunchConfig] | None] = contextvars.ContextVar(
    "kvkernels_launch_override", default=None)


def _capability(device: torch.device) -> int | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def launch_config(kernel: str, device: torch.device) -> LaunchConfig:
    """The launch parameters ``kernel`` (one of :data:`KERNELS`) uses for tensors on ``device``."""
    if kernel not in DEFAULTS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    over = _OVERRIDE.get()
    if over and kernel in over:
        return over[kernel]
    if INTERPRET:
        return _INTERPRETER
    cc = _capability(device)
    return TUNED.get((kernel, cc), DEFAULTS[kernel]) if cc is not None else DEFAULTS[kernel]


@contextlib.contextmanager
def override(**configs: LaunchConfig) -> Iterator[None]:
    """Within the block, the named kernels launch with these configs (``override(decode=LaunchConfig(...))``).

    Meant for eager sweeps: a compiled step captured in a CUDA graph keeps the kernels it was captured with.
    """
    unknown = set(configs) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"override got unknown kernels {sorted(unknown)}; known: {KERNELS}")
    token = _OVERRIDE.set({**(_OVERRIDE.get() or {}), **configs})
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


#: Candidates a sweep measures right after the default, before the rest of :data:`SWEEP`'s product (a time box
#: cuts a sweep's tail). The decode kernel's: configs no sweep has reached yet (the H200 sweeps of 2026-11-26
#: reached the default and block 32's configs; every later run's box cut its sweep before it started), those
#: whose K/V tiles leave room for more programs per SM first: a program's pipeline buffers take about
#: ``2 * block * D * 2 B * num_stages`` of shared memory (96 KB at the default's 64 / 3, D 128: two programs
#: per H200 SM; 64 KB at 64 / 2: three).
SWEEP_FIRST: dict[str, tuple[LaunchConfig, ...]] = {
    "decode": (LaunchConfig(64, 4, 2), LaunchConfig(64, 8, 2), LaunchConfig(64, 8, 3),
               LaunchConfig(128, 8, 2), LaunchConfig(128, 4, 2), LaunchConfig(64, 2, 2)),
    # The quantized decode's: 2 warps first (never measured; the rest were, run 4 of 2026-11-28).
    "quant_decode": (LaunchConfig(32, 2, 3), LaunchConfig(64, 2, 3), LaunchConfig(32, 2, 2)),
}


def sweep_configs(kernel: str) -> list[LaunchConfig]:
    """Every candidate of :data:`SWEEP` for ``kernel``: the default, then :data:`SWEEP_FIRST`'s, then the
    rest in the product's order."""
    import itertools

    axes = SWEEP[kernel]
    configs = [LaunchConfig(**dict(zip(axes, values))) for values in itertools.product(*axes.values())]
    first = [DEFAULTS[kernel], *(c for c in SWEEP_FIRST.get(kernel, ()) if c in configs)]
    return list(dict.fromkeys(first)) + [c for c in configs if c not in first]
