"""Input checks shared by every kernel wrapper.

Each check raises ``ValueError`` / ``TypeError`` whose message names the argument and says how to fix
it. Checks run in the public wrapper before anything is written, never inside a kernel, so bad input
cannot corrupt the cache. They only read shapes, dtypes and devices (no device sync) unless a function
says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and layout; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed} "
                        f"(convert with {name}.to(...))")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}; move it with "
                         f"{name}.to({str(device)!r})")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels index its storage directly); "
                         f"pass {name}.contiguous()")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str = "") -> None:
    """Check ``t.shape`` against ``expected`` (``None`` matches any size)."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        exp = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        hint = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {exp}{hint}, got {list(t.shape)}")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(choices)}")


def check_page_table(page_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int,
                     page_size: int) -> None:
    """Check that every page a sequence uses is inside the pool. Reads values (one sync on CUDA)."""
    max_pages = page_table.shape[1]
    need = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    if bool((need > max_pages).any()):
        b = int(torch.nonzero(need > max_pages)[0, 0])
        raise ValueError(f"seq_lens[{b}]={int(seq_lens[b])} needs {int(need[b])} pages but page_table has "
                         f"only {max_pages} columns; allocate a wider page_table")
    cols = torch.arange(max_pages, device=page_table.device)
    used = cols[None, :] < need[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"page_table[{b}, {j}]={int(page_table[b, j])} points outside the pool of "
                         f"{num_pages} pages; every used entry must be in [0, {num_pages})")


def check_seq_lens(seq_lens: torch.Tensor) -> None:
    """Check lengths are non-negative. Reads values (one sync on CUDA)."""
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {int(seq_lens.min())}")
