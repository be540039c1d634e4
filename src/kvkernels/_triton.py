"""Triton availability, backend choice and the one place every kernel launch goes through.

On CUDA tensors the ops launch Triton kernels; on CPU tensors they run the torch references. Tests force
the Triton path on CPU by calling the ``*_triton`` launchers directly with ``TRITON_INTERPRET=1`` set
before triton is imported.

Every launcher starts its kernels with :func:`launch`. Inside :func:`record_launches` nothing runs: each
launch is recorded as a :class:`Launch` (kernel, grid, bound arguments, ``num_warps``), so
``kvkernels.compile_check`` can call the real launchers on ``meta`` tensors and compile exactly the
variants they pick for a GPU target, on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

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

#: log2(e), for ``exp(x) = exp2(x * log2(e))`` in kernels: ``tl.exp2`` of a multiply-add compiles to one
#: ``MUFU.EX2`` where ``tl.exp`` adds a range fix-up per value. ``LOG2E_C``: the constexpr jit code reads.
LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E) if HAS_TRITON else None

_RECORDER: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("kvkernels_recorder",
                                                                                default=None)


def use_triton(t: torch.Tensor) -> bool:
    """True when the public op should launch Triton for a tensor on ``t.device``."""
    return HAS_TRITON and t.is_cuda


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("this launcher needs Triton; install it with `pip install 'kvpolicies[gpu]'`")
    if not INTERPRET and not torch.cuda.is_available() and _RECORDER.get() is None:
        raise RuntimeError("Triton launchers need a CUDA device, or TRITON_INTERPRET=1 set before triton is "
                           "imported to run them on CPU through the interpreter")


# (signature, constexprs, attrs) of triton.compiler.ASTSource
_Specialization = tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any]]


@dataclass(frozen=True)
class Launch:
    """One kernel launch exactly as a launcher chose it.

    Attributes
    ----------
    kernel:
        The ``@triton.jit`` function.
    grid:
        Launch grid.
    args:
        Every argument bound to its parameter name (runtime values and constexprs alike).
    num_warps:
        Warps per program.
    num_stages:
        Software-pipelining depth (``None``: Triton's default).
    maxnreg:
        Most registers per thread the compiler may use (``None``: its own choice).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: Mapping[str, Any]
    num_warps: int
    num_stages: int | None = None
    maxnreg: int | None = None

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def options(self) -> dict[str, int]:
        """The compile options of the launch (``triton.compile``'s ``options``)."""
        given = {"num_stages": self.num_stages, "maxnreg": self.maxnreg}
        return {"num_warps": self.num_warps, **{k: v for k, v in given.items() if v is not None}}

    def specialization(self, backend: Any) -> _Specialization:
        """``(signature, constexprs, attrs)`` for ``triton.compiler.ASTSource``, specialised the way a real
        launch specialises (an int equal to 1 becomes a constant; pointers and ints divisible by 16 carry
        ``tt.divisibility``), using Triton's own specialisation function."""
        from triton.runtime.jit import native_specialize_impl

        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], Any] = {}
        for i, param in enumerate(self.kernel.params):
            value = self.args[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
                continue
            ty, key = native_specialize_impl(type(backend), value, False, True, True)
            signature[param.name] = ty
            if ty == "constexpr":
                constexprs[param.name] = value
            elif isinstance(key, str):
                attrs[(i,)] = backend.parse_attr(key)
        return signature, constexprs, attrs


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int = 4, num_stages: int | None = None,
           maxnreg: int | None = None, **kwargs: Any) -> None:
    """``kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg, **kwargs)`` (options
    left at ``None`` not passed), or record it inside :func:`record_launches`."""
    recorder = _RECORDER.get()
    if recorder is None:
        if num_stages is not None:
            kwargs["num_stages"] = num_stages
        if maxnreg is not None:
            kwargs["maxnreg"] = maxnreg
        kernel[grid](*args, num_warps=num_warps, **kwargs)
        return
    names = kernel.arg_names
    if len(args) > len(names):
        raise TypeError(f"{kernel.__name__} takes {len(names)} arguments, got {len(args)} positional")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{kernel.__name__}: missing arguments {missing}")
    recorder.append(Launch(kernel, tuple(grid), bound, num_warps, num_stages, maxnreg))


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within the block, launchers record their launches into the yielded list instead of running them.

    Call the launchers with ``device="meta"`` tensors: they allocate their scratch and pick block sizes,
    split counts and constexpr flags exactly as on a GPU, and no kernel runs.
    """
    if not HAS_TRITON:
        raise RuntimeError("recording launches needs Triton; install it with `pip install 'kvpolicies[gpu]'`")
    launches: list[Launch] = []
    token = _RECORDER.set(launches)
    try:
        yield launches
    finally:
        _RECORDER.reset(token)


def covering(axes: Mapping[str, tuple[Any, ...]], *, full: bool = False) -> list[dict[str, Any]]:
    """Configurations over ``axes`` (name -> values): the whole product with ``full``, else a pairwise
    covering set (every value of every axis, and every pair of values of any two axes, appears in some
    configuration), built greedily and deterministically.

    The compile check uses it: the product of every launcher option is thousands of variants, while
    compile errors come from single options or the interaction of two.
    """
    import itertools

    names = list(axes)
    if full:
        return [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in axes[a] for vb in axes[b]}
    if len(names) == 1:
        return [{names[0]: v} for v in axes[names[0]]]
    configs: list[dict[str, Any]] = []

    def gain(config: dict[str, Any], name: str, value: Any) -> int:
        return sum((a, config[a], name, value) in uncovered if names.index(a) < names.index(name)
                   else (name, value, a, config[a]) in uncovered for a in config)

    def order(p: tuple[str, Any, str, Any]) -> tuple[int, int, int, int]:  # deterministic: axes order
        return names.index(p[0]), names.index(p[2]), axes[p[0]].index(p[1]), axes[p[2]].index(p[3])

    while uncovered:
        a, va, b, vb = min(uncovered, key=order)
        config = {a: va, b: vb}
        for name in names:
            if name not in config:
                gains = [gain(config, name, v) for v in axes[name]]
                config[name] = axes[name][gains.index(max(gains))]  # the first value of the best gain
        config = {n: config[n] for n in names}
        configs.append(config)
        uncovered -= {(x, config[x], y, config[y]) for x, y in itertools.combinations(names, 2)}
    return configs
