"""The device the suite runs on, and tolerances that follow the device and dtype.

``KVPOLICIES_TEST_DEVICE=cuda TRITON_INTERPRET=0`` (``nox -s gpu``) runs every kernel, cache, model,
compile and transformers test on CUDA tensors, with the Triton kernels compiled; the default runs them on CPU,
the Triton launchers through the interpreter. Test data is drawn on the CPU (seeded ``torch.Generator``s
give the same data on every device) and moved to :data:`DEVICE` where a kernel, cache or model reads it.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("KVPOLICIES_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"
# The Triton interpreter has no bf16; compiled kernels on a GPU do.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16) if ON_GPU else (torch.float32, torch.float16)


def to_device(*tensors: torch.Tensor | None, device: torch.device = DEVICE):
    """Each tensor moved to ``device`` (``None`` stays ``None``); one tensor in, one out."""
    moved = tuple(None if t is None else t.to(device) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def max_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest absolute difference, computed in float64 on the CPU; 0 for empty tensors."""
    if x.numel() == 0:
        return 0.0
    return (x.detach().cpu().double() - truth.detach().cpu().double()).abs().max().item()


def allowed_error(plain: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> float:
    """What a kernel may be off from ``truth`` (a float64 reference): twice the error of the plain-torch
    computation ``plain`` at the kernel's precision, plus a few units in the last place of ``dtype`` at the
    scale of the values (so an exactly-representable case still leaves room for a different summation
    order). The bound follows the device and dtype instead of one constant."""
    scale = max(1.0, truth.detach().abs().max().item()) if truth.numel() else 1.0
    return 2 * max_error(plain, truth) + 4 * torch.finfo(dtype).eps * scale


def assert_within(x: torch.Tensor, truth: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype) -> None:
    """``x`` is within :func:`allowed_error` of the float64 ``truth``."""
    err, allowed = max_error(x, truth), allowed_error(plain, truth, dtype)
    assert err <= allowed, f"error {err:.3g} > allowed {allowed:.3g} (2x plain torch at {dtype} + 4 eps)"


def on_device(fn, device: torch.device = DEVICE):
    """``fn`` called with its tensor arguments (lists of tensors too) moved to ``device``; its tensor
    results (or tuple of them) come back on the CPU, so tests compare them with CPU oracles."""
    def move(x, dev):
        if isinstance(x, torch.Tensor):
            return x.to(dev)
        if isinstance(x, (list, tuple)):
            return type(x)(move(v, dev) for v in x)
        return x

    def wrapped(*args, **kwargs):
        out = fn(*move(args, device), **{k: move(v, device) for k, v in kwargs.items()})
        return move(out, torch.device("cpu"))

    return wrapped
