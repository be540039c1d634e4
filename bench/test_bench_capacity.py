"""Maximum batch that fits one fixed KV page pool: full cache vs compressed caches (issue: ">= 4x the
maximum batch that fits at budget 0.2").

The pool is sized for ``FULL_BATCH`` uncompressed sequences of ``PROMPT_LEN + NEW_TOKENS`` tokens; each
policy's largest batch that generates ``NEW_TOKENS`` tokens without running out of pages is found by search
(``generate`` compresses every prompt right after its prefill, so the pool holds one whole prompt at a
time). Capacity is page accounting, identical on every device, so this runs a small random Llama with the
benchmark's real lengths (4k prompt + 512 new tokens by default); ``KVBENCH_PROMPT_LEN`` shrinks it for
smoke runs. Ratios go to ``extra_info``; nothing is asserted about them.

Quantized rows (``kivi``, issue 36: ">= 12x the full cache's batch in the same pool at 0.2 + 4 bits") get the
same pool in **bytes**: as many of their (smaller) pages as fit the full cache's pool bytes. The full cache's
dtype is the model's: ``KVBENCH_DTYPE=bfloat16`` compares against a 16-bit cache (default float32); a
quantized row's parameters and the pool's per-slot position and score weigh less at a real model's head dim,
``KVBENCH_HEAD_DIM=64`` (default 16).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from gpu import largest_batch  # bench/gpu.py (pytest puts bench/ on the path)
from kvmodels.generate import generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose

PROMPT_LEN = int(os.environ.get("KVBENCH_PROMPT_LEN", "4096"))
NEW_TOKENS = max(1, PROMPT_LEN // 8)  # 4096 + 512 by default
FULL_BATCH = 4 if PROMPT_LEN >= 1024 else 1  # smoke runs: a one-sequence pool, batches up to MAX_RATIO
MAX_RATIO = 16  # the search stops at MAX_RATIO x FULL_BATCH (reported as ">=")
PAGE = 16
HEAD_DIM = int(os.environ.get("KVBENCH_HEAD_DIM", "16"))  # 4 query heads of it; 64 or 128: a real model's
KIVI4 = f"kivi(bits=4, group={min(32, HEAD_DIM)}, residual=0)"
POLICIES = [("full", 1.0), ("streaming", 0.2), ("h2o", 0.2), ("squeeze+keyformer", 0.2), ("snapkv", 0.2),
            (f"full+{KIVI4}", 1.0), (f"streaming+{KIVI4}", 0.2), (f"snapkv+{KIVI4}", 0.2)]
CUDA = torch.cuda.is_available()
DTYPE = getattr(torch, os.environ.get("KVBENCH_DTYPE", "float32"))  # the model's and the full cache's dtype


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=4 * HEAD_DIM, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=128,
                      max_seq_len=PROMPT_LEN + NEW_TOKENS)
    return Llama(cfg).to("cuda" if CUDA else "cpu", DTYPE).eval()


def fits(model, batch: int, policy, num_pages: int) -> bool:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, 256, (batch, PROMPT_LEN), generator=g).tolist()
    try:
        generate(model, prompts, NEW_TOKENS, policy, num_pages=num_pages, page_size=PAGE)
    except RuntimeError as e:
        if "out of pages" not in str(e):
            raise
        return False
    return True


def max_batch(model, policy, num_pages: int) -> int:
    """Largest batch up to ``MAX_RATIO * FULL_BATCH`` that fits (doubling from ``FULL_BATCH``, then
    bisection: ``bench/gpu.py``'s search); fitting is monotone in the batch size."""
    cap = MAX_RATIO * FULL_BATCH
    best, _, _ = largest_batch(lambda b: fits(model, b, policy, num_pages), FULL_BATCH, cap)
    return best


def page_bytes(model, policy) -> int:
    """Bytes of one page of ``policy``'s cache for ``model`` (quantized rows make smaller pages)."""
    from kvmodels.cache import PagedKVCache

    layout = model.cache_layout()
    param = next(iter(model.parameters()))
    return PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                        n_q_heads=layout.n_q_heads, max_batch=1, max_tokens=PAGE, page_size=PAGE, num_pages=1,
                        dtype=param.dtype, device=param.device, policy=policy).page_bytes


_full: dict[str, int] = {}


@pytest.mark.parametrize("name,budget", POLICIES, ids=[f"{n}@{b}" for n, b in POLICIES])
def test_bench_max_batch(benchmark, model, name, budget):
    layout = model.cache_layout()
    num_pages = FULL_BATCH * layout.n_layers * math.ceil((PROMPT_LEN + NEW_TOKENS) / PAGE)
    policy = compose(name, budget=budget)
    pool_bytes = num_pages * page_bytes(model, compose("full"))
    num_pages = pool_bytes // page_bytes(model, policy)  # the same bytes in this policy's pages
    best = benchmark.pedantic(max_batch, args=(model, policy, num_pages), rounds=1, iterations=1)
    if name == "full":
        _full["batch"] = best
    info = dict(policy=policy.name, budget=budget, max_batch=best, search_cap=MAX_RATIO * FULL_BATCH,
                num_pages=num_pages, page_size=PAGE, pool_bytes=pool_bytes,
                prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, full_batch_pool=FULL_BATCH,
                device=torch.cuda.get_device_name() if CUDA else "cpu", dtype=str(DTYPE), head_dim=HEAD_DIM)
    if "batch" in _full:
        info["max_batch_vs_full"] = best / _full["batch"]
    benchmark.extra_info.update(info)
