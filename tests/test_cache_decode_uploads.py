"""Decode-time eviction uploads nothing per step: every compaction call of a decode step reuses device rows
that ``finish_prefill`` uploaded (``PagedKVCache._op_rows``). An upload from host memory waits for the device,
so on a GPU a new one per step stalls the pipeline between CUDA-graph steps (tests/test_gpu.py checks that
no step synchronises at all; this is the part a CPU can check)."""

from __future__ import annotations

import pytest
import torch

from kvmodels.cache import PagedKVCache
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("policy", ["h2o", "streaming", "keyformer", "squeeze+tova", "streaming+minicache"])
def test_decode_steps_reuse_the_rows_finish_prefill_uploaded(policy):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=64,
                              max_seq_len=256)).eval()
    layout = model.cache_layout()
    # Ragged prompts: one over its budget from the start, one that only passes it while decoding.
    prompts = [list(range(1, 60)), list(range(3, 12))]
    cache = PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                         n_q_heads=layout.n_q_heads, max_batch=2, max_tokens=128, dtype=torch.float32,
                         page_size=4, policy=compose(policy, budget=0.3, min_tokens=4))
    with torch.no_grad():
        cache.start([len(p) for p in prompts], 24)
        for b, p in enumerate(prompts):
            model.prefill(torch.tensor(p), cache, b, last_only=True)
        cache.finish_prefill()
        uploaded = dict(cache.compactor.memo)
        positions = torch.tensor([len(p) for p in prompts])
        for t in range(20):
            cache.prepare_decode(t)
            model.decode_step(torch.tensor([5, 6]), positions + t, cache)
            cache.after_step(t)
    assert cache.compactor.memo.keys() == uploaded.keys()
    budgets = cache.plan.rows.budgets  # [Lc, n]
    lens = torch.as_tensor(cache.host.lens[:, :2])
    stored = [l for l in range(layout.n_layers) if cache.layout.width[l]]  # a merged pair's second layer: 0
    assert (lens[stored] == budgets[stored]).all()  # every step evicted back down to the budget
