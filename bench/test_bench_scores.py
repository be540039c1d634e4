"""Prefill scoring: the ``prefill_scores`` op (Triton on CUDA, the chunked reference on CPU) against a naive
torch scorer that materialises ``softmax(Q K^T)`` for the whole prompt.

    python -m pytest bench/test_bench_scores.py                       # tiny shapes on CPU, real ones on CUDA
    python -m pytest bench/test_bench_scores.py --benchmark-disable   # smoke run, each case once

``test_prefill_attention_with_scores`` times what a scoring prefill adds to the model's prompt attention:
the attention alone, the attention then the scorer (given its ``lse``), and both from one computation of
the probabilities (``prefill_attention_scores``; fused on CPU only). Compare within one run.

``extra_info`` records the shape, the device, the working-set estimate of each method and, on CUDA, the
measured peak allocation of one call. The naive scorer is skipped where its ``[Hq, L, L]`` matrices do
not fit in free device memory.
"""

from __future__ import annotations

import pytest
import torch

from kvkernels.score_update import prefill_attention, prefill_attention_scores, prefill_scores

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
# (L, Hq, Hkv, D)
SHAPES = [(4096, 32, 8, 128), (16384, 32, 8, 128)] if CUDA else [(256, 4, 2, 32), (1024, 4, 2, 32)]
CHUNK = 256


def naive_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """H2O prefill scores the obvious way: dense causal probabilities, mean over the group, column sums."""
    L, Hq, _ = q.shape
    Hkv = k.shape[1]
    logits = torch.einsum("ihd,jhd->hij", q.float(), k.float().repeat_interleave(Hq // Hkv, dim=1)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    probs = logits.masked_fill_(~causal, float("-inf")).softmax(dim=-1)  # [Hq, L, L]
    return probs.view(Hkv, Hq // Hkv, L, L).mean(dim=1).sum(dim=1)  # [Hkv, L]


def _working_bytes(method: str, L: int, Hq: int) -> int:
    """fp32 intermediates held at once: logits + probabilities of all rows (naive), of one chunk (the
    CPU reference), of none (the Triton kernels keep tiles on chip); plus a row max and normaliser."""
    rows = L if method == "naive" else 0 if CUDA else CHUNK
    return 2 * Hq * rows * L * 4 + 2 * Hq * L * 4


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-Hq{}-Hkv{}-D{}".format(*s))
@pytest.mark.parametrize("method", ["op-accumulate", "op-gumbel", "naive"])
def test_prefill_scores(benchmark, shape, method):
    L, Hq, Hkv, D = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(L, Hq, D, device=DEVICE, dtype=DTYPE, generator=gen)
    k = torch.randn(L, Hkv, D, device=DEVICE, dtype=DTYPE, generator=gen)
    scale = D**-0.5
    need = _working_bytes("naive" if method == "naive" else "op", L, Hq)
    if method == "naive" and CUDA and need > 0.8 * torch.cuda.mem_get_info()[0]:
        pytest.skip(f"naive scorer needs ~{need / 2**30:.0f} GiB of [Hq, L, L] matrices")

    if method == "naive":
        run = lambda: naive_scores(q, k, scale)
    else:
        mode = method.removeprefix("op-")
        run = lambda: prefill_scores(q, k, scale=scale, mode=mode, seed=1, chunk=CHUNK)

    def call():
        out = run()
        _sync()
        return out

    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        benchmark.extra_info["peak_bytes_measured"] = torch.cuda.max_memory_allocated() - base
    out = benchmark(call)
    assert out.shape == (Hkv, L) and torch.isfinite(out).all()
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if CUDA else "cpu", dtype=str(DTYPE), L=L, Hq=Hq, Hkv=Hkv, D=D,
        working_bytes_estimate=need, torch=torch.__version__,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-Hq{}-Hkv{}-D{}".format(*s))
@pytest.mark.parametrize("method", ["attention", "attention+scorer", "fused"])
def test_prefill_attention_with_scores(benchmark, shape, method):
    L, Hq, Hkv, D = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(L, Hq, D, device=DEVICE, dtype=DTYPE, generator=gen)
    k, v = (torch.randn(L, Hkv, D, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2))
    scale = D**-0.5

    def call():
        if method == "fused":
            out = prefill_attention_scores(q, k, v, scale=scale, mode="accumulate")[0]
        else:
            out, lse = prefill_attention(q, k, v, scale=scale)
            if method == "attention+scorer":
                prefill_scores(q, k, scale=scale, mode="accumulate", lse=lse)
        _sync()
        return out

    out = benchmark(call)
    assert out.shape == (L, Hq, D) and torch.isfinite(out.float()).all()
    benchmark.extra_info.update(device=torch.cuda.get_device_name() if CUDA else "cpu", dtype=str(DTYPE), L=L,
                                Hq=Hq, Hkv=Hkv, D=D, torch=torch.__version__)
