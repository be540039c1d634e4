"""Every Triton kernel variant the launchers can pick compiles for sm_80 and sm_90 on a machine without a
GPU.

The check (``python -m kvkernels.compile_check``) runs in a subprocess: it needs ``TRITON_INTERPRET`` unset,
and this process imported triton with the interpreter on (conftest). Under the oldest supported Triton
CI runs it again (``.ci/oldest-triton``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkernels._triton import covering

pytest.importorskip("triton")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env(tmp_path: Path) -> dict[str, str]:
    """A compiling subprocess's environment: the interpreter off, this tree's sources, its own cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, said explicitly (Triton 3.9 warns)
    return env


def _run(args: list[str], tmp_path: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(tmp_path),
                          timeout=timeout, cwd=tmp_path)


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    """``bench/sass.py``'s JSON rows by case, each case compiled once for the module (the two SASS tests
    share ``int4+h2o/prefetch``) and the missing cases split over one ``bench/sass.py`` process per core
    (each compiles its cases one after another, on one core)."""
    script = str(Path(SRC).parent / "bench" / "sass.py")
    rows: dict[str, dict] = {}

    def get(*cases: str) -> dict[str, dict]:
        missing = [c for c in dict.fromkeys(cases) if c not in rows]
        jobs = max(1, min(len(missing), os.cpu_count() or 1))
        procs = []
        for part in (missing[i::jobs] for i in range(jobs)):
            if part:
                tmp = tmp_path_factory.mktemp("sass")
                procs.append(subprocess.Popen([sys.executable, script, *part, "--json"], env=_env(tmp),
                                              cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
        done = [(proc, *proc.communicate(timeout=1200)) for proc in procs]
        for proc, out, err in done:
            assert proc.returncode == 0, err[-5000:]
            rows.update((r["case"], r) for r in map(json.loads, out.splitlines()))
        return {c: rows[c] for c in cases}

    return get


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm80_and_sm90(tmp_path):
    proc = _run(["-m", "kvkernels.compile_check", "--arch", "80,90"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    assert " 0 failures" in proc.stdout


def test_the_quantized_decode_runs_on_the_tensor_cores_without_spills(sass):
    """``bench/sass.py`` on the H200 bench's shape (bf16, head dim 128, GQA 4): the 4-bit decode, alone,
    with KIVI's float residual as a second region and with H2O's fused score update, compiles for sm_90 to
    tensor-core products (HMMA) with no spilled registers, as the native decode does, and so does the prefill
    scorer's column pass (HGMMA). The first kernel held no HMMA and 344 spilled bytes and ran 36x slower than
    bf16 pages on an H200; this fails on it."""
    cases = ("native", "int4", "int4+float", "int4+h2o", "int4/prefetch", "int4+h2o/prefetch", "prefill")
    rows = sass(*cases)
    for case in cases:
        r = rows[case]
        # the prefill scorer's column pass (64-row tiles) takes sm_90's warpgroup products (HGMMA)
        assert r["hmma"] + r["hgmma"] > 0 and r["stack_bytes"] == 0 and r["ldl"] == r["stl"] == 0, r
        assert r["ffma"] < r["instructions"] // 8, r  # the products are not float32 FMAs
        assert 0 < r["loop"] < r["instructions"], r  # the loop over the tiles, within the kernel


def test_loop_instructions_spans_the_longest_backward_branch():
    """``bench/sass.py``'s ``loop``: the longest span from a backward branch's target to the branch (both
    included; 16 bytes an instruction); forward branches and a branch to itself (the closing trap) are not
    loops."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass", Path(SRC).parent / "bench" / "sass.py")
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    lines = {0x10: "@P0 BRA 0x60 ;", 0x40: "IMAD R1, R2, R3, R4 ;", 0x60: "@!P1 BRA 0x20 ;",
             0x70: "BRA 0x90 ;", 0x80: "@P2 BRA 0x50 ;", 0x90: "BRA 0x90;"}
    text = "\n".join(f"        /*{a:04x}*/              {op}   /* 0x0000 */" for a, op in lines.items())
    assert sass.loop_instructions(text) == (0x60 - 0x20) // 16 + 1 == 5  # not 0x80 -> 0x50 (4)
    assert sass.loop_instructions("\n".join(text.splitlines()[:2])) == 0  # forward branches only
    assert sass.loop_instructions("        /*0090*/                   BRA 0x90;") == 0


def test_float16_rows_decode_codes_without_float32_arithmetic(sass):
    """``bench/sass.py`` at the bench's shape (bf16 queries, float16 parameters, prefetched): with float16
    rows (``quant_attention.HALF_ROWS``, the default) no code is converted to float32 or scaled by a float32
    FMA, and stays within ``MAX_REGISTERS`` without spills, each width; at 2 and 4 bits the kernel's loop
    (what each warp issues per tile) is shorter than with float32 rows ("/f32", which converts and scales
    every code: 64 FMAs per thread per tile). Under Triton 3.6 (what torch 2.11 ships: ``.ci/oldest-triton``
    runs this test) and 3.9 alike; not the whole kernel's count (3.6: 928 against 920 at 2 bits, a longer
    prologue, the loop 579 against 634), nor 8 bits' loop under 3.6 (585 against 569; 471 against 553
    under 3.9): which is faster there is the GPU run's to time (its quant stage, half rows on and off)."""
    from kvkernels.quant_attention import MAX_REGISTERS

    widths = ("int2", "int4", "int8", "int4+h2o")
    rows = sass(*(f"{w}/prefetch{f}" for w in widths for f in ("", "/f32")))
    for w in widths:
        half, f32 = rows[f"{w}/prefetch"], rows[f"{w}/prefetch/f32"]
        assert f32["ffma"] >= 64 and f32["i2f"] + f32["i2fp"] >= 64, f32  # what the test can tell
        assert half["ffma"] < 8 and half["i2f"] == half["i2fp"] == 0, half
        assert w == "int8" or half["loop"] < f32["loop"], (half, f32)
        assert half["registers"] <= MAX_REGISTERS and half["stack_bytes"] == 0 and half["ldl"] == 0, half


def test_lists_a_configuration_for_every_kernel_and_option(tmp_path):
    proc = _run(["-m", "kvkernels.compile_check", "--list"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    labels = proc.stdout.splitlines()
    from kvkernels._modes import SCORE_MODES

    for mode in SCORE_MODES:
        assert any(line.startswith("paged_decode_attention ") and f"score_mode={mode} " in line
                   for line in labels), mode
    for kernel in ("paged_decode_attention", "prefill_scores", "topk_compact", "magnitude_direction_merge",
                   "gumbel_noise_hash"):
        assert any(line.startswith(kernel + " ") for line in labels), kernel
    for dtype in ("torch.float16", "torch.bfloat16", "torch.float32"):
        assert any(f"dtype={dtype}" in line for line in labels if line.startswith("paged_decode_attention "))


def test_a_kernel_that_does_not_compile_is_reported(tmp_path):
    """The check can fail: a kernel calling a ``triton.language`` name that does not exist (what
    ``tl.to_tensor`` was under Triton 3.6) is reported with its cause and the configuration that launched
    it."""
    (tmp_path / "broken_kernels.py").write_text(textwrap.dedent('''
        import torch
        import triton
        import triton.language as tl

        from kvkernels._triton import launch

        @triton.jit
        def _broken(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.no_such_function(offs), mask=offs < n)

        @triton.jit
        def _fine(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)

        def compile_variants(full=False):
            x = torch.empty(64, device="meta")
            yield "fine block=64", lambda: launch(_fine, (1,), x, 64, BLOCK=64)
            yield "broken block=64", lambda: launch(_broken, (1,), x, 64, BLOCK=64)
    '''))
    script = textwrap.dedent('''
        import sys
        sys.path.insert(0, ".")
        import broken_kernels
        from kvkernels import compile_check
        compile_check._modules = lambda: [broken_kernels]
        sys.exit(compile_check.main(["--arch", "90", "--jobs", "1"]))
    ''')
    proc = _run(["-c", script], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 distinct kernel variants for sm_90, 1 failures" in proc.stdout
    assert "FAILED _broken for sm_90" in proc.stdout and "no_such_function" in proc.stdout
    assert "broken block=64" in proc.stdout and "FAILED _fine" not in proc.stdout


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_covering_holds_every_pair_of_values(sizes):
    axes = {f"a{i}": tuple(range(n)) for i, n in enumerate(sizes)}
    configs = covering(axes)
    seen = {(a, c[a], b, c[b]) for c in configs for a, b in itertools.combinations(axes, 2)}
    want = {(a, va, b, vb) for a, b in itertools.combinations(axes, 2) for va in axes[a] for vb in axes[b]}
    assert want <= seen
    assert all(set(c) == set(axes) and all(c[k] in axes[k] for k in c) for c in configs)
    full = covering(axes, full=True)
    assert len(full) == len({tuple(c.values()) for c in full}) == __import__("math").prod(sizes)
