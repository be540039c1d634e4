"""Decode attention benchmarks: the paged op vs SDPA / FlexAttention on a gathered dense cache, the fused
score update vs scoring off, and achieved bandwidth against a device-to-device copy of the same bytes.

On CUDA the shapes are the real ones (batch 8, 4k context, Hq=32 / Hkv=8, D=128, bf16). On CPU they are
tiny, so ``pytest bench/ --benchmark-disable`` runs every benchmark once as a smoke test and the file
cannot rot. Nothing here asserts a timing; numbers go to ``benchmark.extra_info``. Compare runs only on
the same device.
"""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
if ON_CUDA:
    SHAPE = dict(batch=8, ctx=4096, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16)
else:
    SHAPE = dict(batch=2, ctx=64, hq=4, hkv=2, d=32, page=16, dtype=torch.float32)


def _sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def _median_seconds(fn, reps: int = 20 if ON_CUDA else 2) -> float:
    """Median wall time of ``fn`` after warm-up, synchronising the device around each call."""
    for _ in range(3 if ON_CUDA else 1):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.fixture(scope="module")
def setup():
    """A full paged cache (every sequence at ``ctx`` tokens, pages shuffled) and its dense gather."""
    s = SHAPE
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, ctx, hq, hkv, d, page = (s[k] for k in ("batch", "ctx", "hq", "hkv", "d", "page"))
    pages_per_seq = math.ceil(ctx / page)
    num_pages = batch * pages_per_seq
    k_pages = torch.randn(num_pages, page, hkv, d, generator=gen).to(DEVICE, s["dtype"])
    v_pages = torch.randn(num_pages, page, hkv, d, generator=gen).to(DEVICE, s["dtype"])
    page_table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(DEVICE, torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, hq, d, generator=gen).to(DEVICE, s["dtype"])
    score = torch.zeros(num_pages, page, hkv, device=DEVICE)
    # Dense baselines get the cache already gathered: [B, Hkv, ctx, D].
    k_dense = k_pages[page_table.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = v_pages[page_table.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    kv_bytes = 2 * batch * ctx * hkv * d * k_pages.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size()  # K and V read once, q read, out written
    # A copy of the same bytes reads and writes them: its bandwidth is 2 * bytes / time.
    src = torch.empty(io_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src))
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=seq_lens, score=score,
                k_dense=k_dense, v_dense=v_dense, scale=d ** -0.5, io_bytes=io_bytes, copy_s=copy_s)


def _flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # older torch
        return None
    # Eager flex is a slow debugging path; on CPU we only smoke-test it, on CUDA it is compiled.
    return torch.compile(flex_attention, fullgraph=True) if ON_CUDA else flex_attention


def _impls(t):
    q4 = t["q"][:, :, None, :]  # [B, Hq, 1, D] for the dense APIs
    flex = _flex()

    def paged(score_mode="none"):
        # The registered op, not the checked wrapper: the wrapper's value checks sync the device, and a
        # compiled decode step (what this kernel serves) skips them. Check once here, eagerly.
        args = (t["q"], t["k_pages"], t["v_pages"], t["page_table"], t["seq_lens"])
        paged_decode_attention(*args, scale=t["scale"], scores=ScoreUpdate(t["score"].clone(), score_mode))
        # The op's flat schema, every argument given (none has a default; see the op's docstring).
        return lambda: torch.ops.kvkernels.paged_decode_attention(
            *args, t["scale"], None, None, None, t["score"], score_mode, 1.0, None, None, None, None, None, 1,
            0)

    return {
        "paged": paged(),
        "paged_scored": paged("accumulate"),  # the fused H2O-style score update
        "sdpa_dense": lambda: F.scaled_dot_product_attention(q4, t["k_dense"], t["v_dense"], scale=t["scale"],
                                                             enable_gqa=True),
        "flex_dense": None if flex is None else (
            lambda: flex(q4, t["k_dense"], t["v_dense"], scale=t["scale"], enable_gqa=True)),
    }


@pytest.mark.parametrize("impl", ["paged", "paged_scored", "sdpa_dense", "flex_dense"])
def test_bench_decode_attention(benchmark, setup, impl):
    fn = _impls(setup)[impl]
    if fn is None:
        pytest.skip("torch.nn.attention.flex_attention is not available in this torch")
    try:
        fn()
    except Exception as e:  # FlexAttention support for a query length of 1 varies by version and device
        if impl != "flex_dense":
            raise
        pytest.skip(f"FlexAttention failed on these shapes: {type(e).__name__}: {e}")
    seconds = _median_seconds(fn)
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if ON_CUDA else "cpu",
        torch=torch.__version__,
        shape={k: str(v) for k, v in SHAPE.items()},
        median_us=seconds * 1e6,
        io_bytes=setup["io_bytes"],
        achieved_gb_s=setup["io_bytes"] / seconds / 1e9,
        copy_gb_s=2 * setup["io_bytes"] / setup["copy_s"] / 1e9,
        pct_of_copy_bandwidth=100 * (setup["io_bytes"] / seconds) / (2 * setup["io_bytes"] / setup["copy_s"]),
    )
    benchmark(lambda: (fn(), _sync()))
