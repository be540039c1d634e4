"""What a decode kernel compiles to on a Hopper GPU, read without a GPU: registers, spills, instruction mix.

    python bench/sass.py                    # every case below, sm_90, the H200 bench shape (B64, L4096)
    python bench/sass.py native int4 --json # some cases, one JSON line each

Each case calls the real launcher on ``meta`` tensors (``kvkernels._triton.record_launches``, as
``kvkernels.compile_check`` does), compiles the first kernel it launches for ``sm_90`` down to a cubin
with the ``ptxas`` Triton ships, and reads it back with ``cuobjdump``: registers per thread, stack bytes
(spilled registers), how many tensor-core (``HMMA``), float32 FMA, global-load, asynchronous-copy and
local-memory (spill) instructions the kernel holds, and how many its longest loop holds (``loop``: in a
decode kernel, what each warp issues per tile of the sequence). Static counts, not timings: they tell a
kernel on the CUDA cores from one on the tensor cores, and a kernel that spills from one that does not,
before a device is lent.

The first quantized decode kernel (issue 36) ran 36x slower than bf16 pages on an H200
(``bench/results/nvidia-h200-2026-11-26/run6``); here it read 255 registers and 344 spilled bytes, with
1090 float32 FMAs and no HMMA; the native kernel 122 registers, no spills, HMMA and asynchronous copies.
``TRITON_INTERPRET`` must be unset.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

# The H200 bench's quant stage shape: Llama-3-8B heads (32 query, 8 KV, dim 128), bf16, pages of 16, 4k.
BATCH, HQ, HKV, D, PAGE, CONTEXT = 64, 32, 8, 128, 16, 4096
# int4+float: KIVI's float residual as a second region; +h2o: the fused score update (logits kept);
# +keyformer: Gumbel's, its noise hashed in the kernel.
# "/prefetch": kvkernels.quant_attention.PREFETCH_TILES on (the loads a tile ahead by hand); without it, off.
# "/f32": kvkernels.quant_attention.HALF_ROWS off (codes to float32, float32 multiply-add, rounded to bf16);
# without it, on (codes decoded straight to float16, the products in float16).
# "prefill": the prefill scorer's column pass (H2O's accumulate mode, the row log-sum-exp given, as the cache
# runs it on CUDA after the flash kernel), one 4k prompt of the same heads (head dim 128);
# "prefill+keyformer": Keyformer's prompt scores (Gumbel noise at temperature 1), whose row pass (the noised
# normaliser) is its first kernel and whose column pass is "@reduce".
# "@reduce": the second kernel of the launch (``_decode_reduce_kernel``: the score update's, or split-K's
# combine); "native/32k": one sequence of 32768 tokens in 32 splits, the kernels stage's split-K shape.
CASES = ("native", "native+h2o", "native+keyformer", "int8", "int4", "int2", "int4+float", "int4+h2o",
         "int8/prefetch", "int4/prefetch", "int4+h2o/prefetch", "int2/prefetch", "int8/prefetch/f32",
         "int4/prefetch/f32", "int4+h2o/prefetch/f32", "int2/prefetch/f32", "prefill", "prefill+keyformer",
         "prefill+keyformer@reduce", "native+h2o@reduce", "native+keyformer@reduce", "native/32k@reduce")
# hmma: mma.sync tensor-core products; hgmma: sm_90's warpgroup ones (wgmma: the prefill scorer's tiles).
# Shared-memory stores/loads, barriers, shuffles: layout conversions; I2F/I2FP: integer to float conversions
# (I2FP the ALU form sm_90 uses for 32-bit codes), F2FP: packing float32 into 16-bit pairs.
OPS = {"hmma": "HMMA", "hgmma": "HGMMA", "ffma": "FFMA", "ldg": "LDG", "ldgsts": "LDGSTS", "ldl": "LDL",
       "stl": "STL", "sts": "STS", "lds": "LDS", "ldsm": "LDSM", "bar": "BAR", "shfl": "SHFL", "prmt": "PRMT",
       "i2f": "I2F", "i2fp": "I2FP", "f2fp": "F2FP"}


def _launch(case: str) -> None:
    """The launcher of ``case`` on meta tensors at the bench shape (one split, as at batch 64)."""
    import torch

    from kvkernels import quant_attention
    from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention_triton
    from kvkernels.quant import QuantFormat
    from kvkernels.quant_attention import Region, quant_decode_attention_triton

    case = case.removesuffix("@reduce")
    case, f32 = case.removesuffix("/f32"), case.endswith("/f32")
    case, long = case.removesuffix("/32k"), case.endswith("/32k")
    case, prefetch = case.removesuffix("/prefetch"), case.endswith("/prefetch")

    meta, bf16 = torch.device("meta"), torch.bfloat16
    if case.startswith("prefill"):
        from kvkernels.score_update import prefill_scores_triton

        q = torch.empty(CONTEXT, HQ, D, dtype=bf16, device=meta)
        k = torch.empty(CONTEXT, HKV, D, dtype=bf16, device=meta)
        if case.endswith("+keyformer"):  # the noised normaliser needs its own row pass: no lse
            prefill_scores_triton(q, k, scale=D ** -0.5, mode="gumbel", seed=0, temperature=1.0)
            return
        lse = torch.empty(HQ, CONTEXT, dtype=torch.float32, device=meta)
        prefill_scores_triton(q, k, scale=D ** -0.5, mode="accumulate", lse=lse)
        return
    batch, context, splits = (1, 32768, 32) if long else (BATCH, CONTEXT, 1)
    pages, width = batch * context // PAGE, context // PAGE

    def t(*shape: int, dt: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device=meta)

    q, table, lens = t(batch, HQ, D, dt=bf16), t(batch, width, dt=torch.int32), t(batch, dt=torch.int32)
    scores = None
    if case.endswith("+h2o"):
        scores = ScoreUpdate(t(pages, PAGE, HKV, dt=torch.float32), "accumulate")
    if case.endswith("+keyformer"):  # Gumbel noise hashed in the kernel from one key per sequence
        keys, tau = t(batch, HQ, dt=torch.int32), t(1, dt=torch.float32)
        scores = ScoreUpdate(t(pages, PAGE, HKV, dt=torch.float32), "gumbel", 1.0, keys, tau)
    if case.startswith("native"):
        pool = t(pages, PAGE, HKV, D, dt=bf16)
        paged_decode_attention_triton(q, pool, pool, table, lens, scale=D ** -0.5, scores=scores,
                                      num_splits=splits)
        return
    fmt = QuantFormat(int(case[3]), 32)
    pool = t(pages, PAGE, HKV, fmt.row_bytes(D), dt=torch.uint8)
    second = None
    if case.endswith("+float"):
        residual = t(BATCH * 8, PAGE, HKV, D, dt=bf16)
        second = Region(residual, residual, t(BATCH, 8, dt=torch.int32), lens)
    with quant_attention.prefetch_tiles(8 if prefetch else 0), quant_attention.half_rows(not f32):
        quant_decode_attention_triton(q, pool, pool, table, lens, scale=D ** -0.5, k_format=fmt,
                                      v_format=fmt, second=second, scores=scores, num_splits=1)


def loop_instructions(sass: str) -> int:
    """Instructions in the longest loop of ``sass`` (``cuobjdump -sass`` text): the span from a backward
    branch's target to the branch, both included; 0 without one (a branch to itself, the kernel's closing
    trap, is not a loop). In a decode kernel that is the loop over the sequence's tiles: what one tile costs
    each warp to issue, inner branches included whether taken or not."""
    addr = r"/\*([0-9a-f]{4,})\*/"
    best = 0
    for m in re.finditer(addr + r"\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at:
            best = max(best, (at - target) // 16 + 1)
    return best


def stats(case: str, arch: int = 90) -> dict:
    """Registers, stack bytes and instruction counts of ``case``'s first kernel (``@reduce``: its last)
    compiled for ``sm_{arch}``."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvkernels._triton import record_launches

    if case not in CASES:
        raise ValueError(f"case={case!r} is not one of {CASES}")
    with record_launches() as launches:
        _launch(case)
    first = launches[-1 if case.endswith("@reduce") else 0]
    target = GPUTarget("cuda", arch, 32)
    sig, consts, attrs = first.specialization(backends["nvidia"].compiler(target))
    options = first.options
    kernel = triton.compile(ASTSource(first.kernel, sig, consts, attrs), target=target, options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(
        r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    reg, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return dict(case=case, kernel=first.kernel.__name__, arch=arch, triton=triton.__version__,
                num_warps=first.num_warps, num_stages=first.num_stages, maxnreg=first.maxnreg, registers=reg,
                stack_bytes=stack,
                instructions=sum(ops.values()), loop=loop_instructions(sass),
                **{name: ops[op] for name, op in OPS.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=list(CASES), help=f"any of {', '.join(CASES)}")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1 is set; unset it (the interpreter replaces the kernels it compiles)")
    rows = [stats(c, args.arch) for c in args.cases]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    cols = ["case", "kernel", "registers", "stack_bytes", "instructions", "loop", *OPS]
    print(f"sm_{args.arch}, triton {rows[0]['triton']}, B{BATCH} Hq{HQ} Hkv{HKV} D{D} pages of {PAGE}, "
          f"{CONTEXT} tokens")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
