"""Compile every Triton kernel variant the launchers can pick, for a GPU target, without a GPU.

    python -m kvkernels.compile_check                 # sm_80 and sm_90, a pairwise covering set
    python -m kvkernels.compile_check --full          # the whole product of every launcher option
    python -m kvkernels.compile_check --arch 90 --list

Each kernel module lists the options its launcher turns into different kernels (``COMPILE_AXES``) and
yields one thunk per configuration (``compile_variants``) that calls the **real launcher** on ``meta``
tensors inside :func:`kvkernels._triton.record_launches`. So the block sizes, split counts, constexpr
flags and argument specialisations compiled here are exactly the ones a GPU run would launch with, and a
new option added to a launcher is compiled as soon as it is added to its module's axes. Every distinct
variant is compiled by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` through all
stages down to a cubin (Triton ships ``ptxas``).

This catches what the Triton interpreter cannot: a ``triton.language`` function a Triton version lacks,
type errors in lowering, unsupported layouts or dtypes for an architecture. It needs Triton and runs with
``TRITON_INTERPRET`` unset (the interpreter replaces the JIT functions this compiles). The test suite
runs it in a subprocess (``tests/test_compile_check.py``); CI also runs it under the oldest supported
Triton (``.ci/oldest-triton``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ARCHS = (80, 90)


@dataclass(frozen=True)
class Variant:
    """One distinct compilation: a kernel with its specialisation, for one architecture."""

    kernel: Any
    arch: int
    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, int]  # num_warps, num_stages, maxnreg (Launch.options)
    cases: tuple[str, ...]  # the configurations that launch it

    @property
    def key(self) -> str:
        return (f"{self.kernel.__name__} sm_{self.arch} {sorted(self.options.items())} "
                f"{sorted(self.signature.items())} "
                f"{sorted(self.constexprs.items())} {sorted(self.attrs.items())}")


def _modules() -> list[Any]:
    from kvkernels import _noise, merge, paged_attention, quant, quant_attention, score_update
    from kvkernels import topk_compact as _  # noqa: F401  (the package attribute is the op)

    topk = sys.modules["kvkernels.topk_compact"]
    return [_noise, merge, paged_attention, quant, quant_attention, score_update, topk]


def cases(full: bool = False) -> Iterator[tuple[str, Callable[[], object]]]:
    """Every kernel module's ``(label, thunk)`` configurations."""
    for module in _modules():
        yield from module.compile_variants(full)


def collect(archs: tuple[int, ...] = ARCHS, full: bool = False) -> tuple[list[Variant], list[str]]:
    """Run every case's launcher under :func:`record_launches`; return the distinct variants per
    architecture and the failures of the launchers themselves."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    from kvkernels._triton import record_launches

    found: dict[str, Variant] = {}
    failures: list[str] = []
    for label, thunk in cases(full):
        try:
            with record_launches() as launches:
                thunk()
        except Exception:  # noqa: BLE001 -- reported with the case that raised it
            failures.append(f"{label}: the launcher failed before compiling\n{traceback.format_exc()}")
            continue
        for arch in archs:
            backend = backends["nvidia"].compiler(GPUTarget("cuda", arch, 32))
            for launch in launches:
                sig, consts, attrs = launch.specialization(backend)
                variant = Variant(launch.kernel, arch, sig, consts, attrs, launch.options, (label,))
                old = found.get(variant.key)
                if old is not None:
                    variant = Variant(old.kernel, arch, sig, consts, attrs, launch.options,
                                      old.cases + (label,))
                found[variant.key] = variant
    return list(found.values()), failures


_VARIANTS: list[Variant] = []  # read by the forked workers


def _compile_one(i: int) -> tuple[int, str | None, float]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    v = _VARIANTS[i]
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(v.kernel, v.signature, v.constexprs, v.attrs),
                                target=GPUTarget("cuda", v.arch, 32), options=v.options)
        if not kernel.asm.get("cubin"):
            return i, "no cubin produced", time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 -- every failure is reported, not just the first
        return i, _describe(exc), time.perf_counter() - start
    return i, None, time.perf_counter() - start


def _describe(exc: BaseException) -> str:
    """The error and its causes, innermost last: Triton's ``CompilationError`` points at the call site in
    the outer kernel, and its cause names what failed inside (e.g. a missing ``triton.language`` name)."""
    parts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {str(cur).strip()}")
        cur = cur.__cause__ or cur.__context__
    return "\n  caused by ".join(parts)


def run(archs: tuple[int, ...] = ARCHS, full: bool = False, jobs: int = 0, verbose: bool = False) -> int:
    """Compile every variant; print a summary and each failure; return the number of failures."""
    import triton

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("compile_check: TRITON_INTERPRET=1 is set; unset it (the interpreter replaces the "
                         "kernels this compiles)")
    t0 = time.perf_counter()
    variants, failures = collect(archs, full)
    _VARIANTS[:] = variants
    jobs = jobs or min(len(variants), os.cpu_count() or 1) or 1
    results: list[tuple[int, str | None, float]]
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = list(pool.imap_unordered(_compile_one, range(len(variants))))
    else:
        results = [_compile_one(i) for i in range(len(variants))]
    n_cases = sum(1 for _ in cases(full))
    for i, error, seconds in sorted(results):
        v = variants[i]
        if verbose:
            print(f"{'FAIL' if error else 'ok  '} {seconds:5.1f}s {v.kernel.__name__} sm_{v.arch} "
                  f"{v.options} {v.constexprs}")
        if error:
            shown = "\n    ".join(v.cases[:3]) + (f"\n    ... and {len(v.cases) - 3} more" if len(v.cases) > 3
                                                   else "")
            failures.append(f"{v.kernel.__name__} for sm_{v.arch} failed to compile: {error}\n"
                            f"  launched by:\n    {shown}")
    print(f"compile_check: triton {triton.__version__}, {n_cases} launcher configurations, {len(variants)} "
          f"distinct kernel variants for {', '.join(f'sm_{a}' for a in archs)}, {len(failures)} failures, "
          f"{time.perf_counter() - t0:.0f}s")
    for failure in failures:
        print("\nFAILED " + failure)
    return len(failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvkernels.compile_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)),
                        help="comma-separated CUDA compute capabilities (default: 80,90)")
    parser.add_argument("--full", action="store_true",
                        help="the whole product of every launcher option (thousands of variants, hours on 2 "
                             "cores) instead of a pairwise covering set")
    parser.add_argument("--jobs", type=int, default=0, help="compile processes (default: one per core)")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per compiled variant")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use Triton's cache (default: a fresh cache directory, so everything compiles)")
    args = parser.parse_args(argv)
    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        parser.error(f"--arch={args.arch!r} must be comma-separated integers such as 80,90")
    if args.list:
        for label, _ in cases(args.full):
            print(label)
        return 0
    if args.keep_cache:
        return 1 if run(archs, args.full, args.jobs, args.verbose) else 0
    with tempfile.TemporaryDirectory(prefix="kvkernels-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        return 1 if run(archs, args.full, args.jobs, args.verbose) else 0


if __name__ == "__main__":
    sys.exit(main())
