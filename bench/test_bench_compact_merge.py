"""Compaction and MiniCache merge.

* ``topk_compact`` (in place on the paged pool: select, move kept slots to the front, free pages) against
  the dense way: ``torch.topk`` per head, sort the kept indices, ``gather`` K and V into fresh tensors.
* ``magnitude_direction_merge`` (Triton on CUDA) against the eager torch reference.

    python -m pytest bench/test_bench_compact_merge.py                       # tiny on CPU, real on CUDA
    python -m pytest bench/test_bench_compact_merge.py --benchmark-disable   # smoke run, each case once

On CPU the ops run their torch references (the compaction reference loops over heads on the host), so the
CPU numbers are a smoke test, not a kernel measurement. ``extra_info`` records the shape, the device and
the K/V bytes each call reads and writes, so GB/s can be compared with the copy bandwidth.
"""

from __future__ import annotations

import pytest
import torch

from kvkernels.merge import magnitude_direction_merge, magnitude_direction_merge_ref
from kvkernels.topk_compact import topk_compact

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.float16 if CUDA else torch.float32
PAGE_SIZE = 16
# (B, Hkv, D, L, budget)
COMPACT_SHAPES = [(8, 8, 128, 4096, 1024), (32, 8, 128, 4096, 512)] if CUDA else [(2, 2, 16, 256, 64)]
# (N, H, D)
MERGE_SHAPES = [(32768, 8, 128), (131072, 8, 128)] if CUDA else [(512, 2, 32)]


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _pool(batch: int, n_heads: int, dim: int, length: int):
    """A layer whose sequences each hold ``length`` tokens on scattered pages, plus its dense twin."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pages_per_seq = length // PAGE_SIZE
    num_pages = batch * pages_per_seq
    k = torch.randn(num_pages, PAGE_SIZE, n_heads, dim, device=DEVICE, dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    score = torch.rand(num_pages, PAGE_SIZE, n_heads, device=DEVICE, generator=gen)
    pos = torch.zeros(num_pages, PAGE_SIZE, n_heads, device=DEVICE, dtype=torch.int32)
    table = torch.randperm(num_pages, device=DEVICE, generator=gen).to(torch.int32).view(batch, pages_per_seq)
    return k, v, pos, score, table


@pytest.mark.parametrize("shape", COMPACT_SHAPES, ids=lambda s: "B{}-Hkv{}-D{}-L{}-keep{}".format(*s))
@pytest.mark.parametrize("method", ["op", "dense-topk-gather"])
def test_compact(benchmark, shape, method):
    batch, n_heads, dim, length, budget = shape
    k, v, pos, score, table = _pool(batch, n_heads, dim, length)
    i32 = lambda x: torch.full((batch,), x, device=DEVICE, dtype=torch.int32)
    kv_bytes = 2 * 2 * batch * budget * n_heads * dim * k.element_size()  # kept K and V, read + write
    benchmark.extra_info.update(device=str(torch.cuda.get_device_name() if CUDA else "cpu"),
                                dtype=str(DTYPE), kept_kv_bytes_moved=kv_bytes)

    if method == "op":
        def setup():  # compaction mutates the pool: every round starts from a fresh copy
            args = (k.clone(), v.clone(), pos.clone(), score.clone(), table.clone(), i32(length), i32(budget),
                    i32(4), i32(budget // 8), torch.zeros(k.shape[0] + 1, device=DEVICE, dtype=torch.int32),
                    torch.zeros(1, device=DEVICE, dtype=torch.int64))
            _sync()
            return args, {}

        def fn(*args):
            topk_compact(*args)
            _sync()

        benchmark.pedantic(fn, setup=setup, rounds=10 if CUDA else 3, warmup_rounds=1)
    else:
        # The dense layout the pool replaces: [B, Hkv, L, D], the same tokens in logical order.
        dense_k = k[table.long()].reshape(batch, length, n_heads, dim).transpose(1, 2).contiguous()
        dense_v = v[table.long()].reshape(batch, length, n_heads, dim).transpose(1, 2).contiguous()
        dense_s = score[table.long()].reshape(batch, length, n_heads).transpose(1, 2).contiguous()

        def fn():
            idx = torch.topk(dense_s, budget, dim=-1).indices.sort(dim=-1).values[..., None]  # [B, Hkv, b, 1]
            idx = idx.expand(-1, -1, -1, dim)
            out = dense_k.gather(2, idx), dense_v.gather(2, idx)
            _sync()
            return out

        benchmark(fn)


@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=lambda s: "N{}-H{}-D{}".format(*s))
@pytest.mark.parametrize("method", ["op", "eager-torch"])
def test_merge(benchmark, shape, method):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x_a = torch.randn(*shape, device=DEVICE, dtype=DTYPE, generator=gen)
    x_b = torch.randn(*shape, device=DEVICE, dtype=DTYPE, generator=gen)
    impl = magnitude_direction_merge if method == "op" else magnitude_direction_merge_ref
    benchmark.extra_info.update(device=str(torch.cuda.get_device_name() if CUDA else "cpu"), dtype=str(DTYPE),
                                bytes_read_written=3 * x_a.numel() * x_a.element_size())

    def fn():
        out = impl(x_a, x_b, t=0.5, retain_ratio=0.05)
        _sync()
        return out

    benchmark(fn)
