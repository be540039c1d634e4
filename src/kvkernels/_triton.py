"""Triton availability and backend choice, in one place.

On CUDA tensors the ops launch Triton kernels; on CPU tensors they run the torch references. Tests force
the Triton path on CPU by calling the ``*_triton`` launchers directly with ``TRITON_INTERPRET=1`` set
before triton is imported.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is an optional extra: the CPU path never needs it.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the public op should launch Triton for a tensor on ``t.device``."""
    return HAS_TRITON and t.is_cuda


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("this launcher needs Triton; install it with `pip install 'kvpolicies[gpu]'`")
    if not INTERPRET and not torch.cuda.is_available():
        raise RuntimeError("Triton launchers need a CUDA device, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run them on CPU through the interpreter")
