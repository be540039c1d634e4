"""Per-prompt compression (``PagedKVCache.compress_prompt``): compressing each prompt right after its prefill
keeps exactly the tokens that compressing the whole batch at ``finish_prefill`` keeps, and a pool too small
for the batch's whole prompts holds it, as long as one whole prompt fits beside the compressed ones."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvmodels.generate import generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose
from test_cache import FakeRun, check_invariants


def _prefill(run: FakeRun, cache, cos_sim, each: bool) -> None:
    cache.start(run.prompt_lens, run.n_steps, compress_each=each)
    for b in range(len(run.prompt_lens)):
        for l in range(run.n_layers):
            cache.prefill_layer(l, b, *run.prompt[l][b], run.positions(b), scale=run.scale)
            cache.record_cos_sim(l, b, float(cos_sim[l][b]))
        if each:
            cache.compress_prompt(b)
            check_invariants(cache, evict_bound=False)
    cache.finish_prefill()


@given(n_layers=st.integers(1, 4), prompt_lens=st.lists(st.integers(1, 30), min_size=1, max_size=3),
       n_steps=st.integers(0, 3), page_size=st.sampled_from([1, 4, 16]),
       spec=st.sampled_from(["h2o", "snapkv", "streaming", "keyformer", "squeeze+tova", "pyramid+window",
                             "full", "window+minicache"]),
       budget=st.sampled_from([0.1, 0.3, 0.5, 1.0, 5]), seed=st.integers(0, 2**16))
def test_compress_each_keeps_what_finish_prefill_keeps(n_layers, prompt_lens, n_steps, page_size, spec,
                                                        budget, seed):
    if spec.endswith("minicache") and n_layers < 2:
        n_layers = 2
    policy = compose(spec, budget=budget, seed=seed, **({"snapkv": {"window": 3, "kernel": 3}}
                                                          if "snapkv" in spec else {}))
    run = FakeRun(n_layers, 2, 2, 4, prompt_lens, n_steps, seed)
    g = torch.Generator().manual_seed(seed)
    cos_sim = torch.rand(n_layers, len(prompt_lens), generator=g).tolist()
    caches = []
    for each in (False, True):
        cache = run.cache(policy, page_size=page_size, seed=seed)
        _prefill(run, cache, cos_sim, each)
        caches.append(cache)
    for t in range(n_steps):
        outs = [run.decode_step(c, t) for c in caches]
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for cache in caches:
        check_invariants(cache)
    for l in range(n_layers):
        for b in range(len(prompt_lens)):
            one, other = (c.layer_contents(l, b) for c in caches)
            assert one.keys() == other.keys()
            for key in one:
                assert torch.equal(one[key], other[key]), (l, b, key)
    assert caches[0].report().tokens_per_layer == caches[1].report().tokens_per_layer


def test_small_pool_holds_the_batch_only_with_compress_each():
    # Two layers, page 4: a whole prompt of 40 tokens is 10 pages per layer; budget 8 keeps 2 pages.
    run = FakeRun(2, 1, 1, 4, [40, 40, 40], 0, seed=0)
    policy = compose("h2o", budget=8)
    pool = 2 * 10 + 2 * 2 * 2  # one whole prompt beside two compressed ones
    cos = [[0.5] * 3] * 2
    with pytest.raises(RuntimeError, match="cache out of pages.*raise num_pages"):
        run.cache(policy, num_pages=pool).start(run.prompt_lens, 0)
    cache = run.cache(policy, num_pages=pool)
    _prefill(run, cache, cos, each=True)
    check_invariants(cache)
    assert cache.report().tokens_per_layer == ((8, 8, 8), (8, 8, 8))
    # One page short: the third prompt's prefill says so and names the fix.
    cache = run.cache(policy, num_pages=pool - 1)
    with pytest.raises(RuntimeError, match="out of pages: prefill of sequence 2 layer 1.*raise num_pages"):
        _prefill(run, cache, cos, each=True)


def test_compress_prompt_checks_its_call():
    run = FakeRun(2, 1, 1, 4, [9, 9], 0, seed=0)
    cache = run.cache(compose("h2o", budget=4))
    with pytest.raises(RuntimeError, match="compress_prompt called in state"):
        cache.compress_prompt(0)
    cache.start(run.prompt_lens, 0, compress_each=True)
    cache.prefill_layer(0, 0, *run.prompt[0][0], run.positions(0), scale=run.scale)
    with pytest.raises(RuntimeError, match=r"sequence 0 has 1 layer\(s\) not prefilled"):
        cache.compress_prompt(0)
    with pytest.raises(ValueError, match="sequence b=2 is out of range"):
        cache.compress_prompt(2)


def test_generate_fits_a_bigger_batch_in_the_same_pool():
    """What the max-batch benchmark measures, at toy size: a pool sized for 2 whole sequences runs a batch of
    6 at budget 0.2 with the same tokens as an unconstrained pool."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64,
                      max_seq_len=256)
    model = Llama(cfg).eval()
    prompts = torch.randint(0, 64, (6, 160)).tolist()
    policy = compose("streaming", budget=0.2)
    S, new = 16, 8
    pool = cfg.n_layers * 2 * math.ceil((160 + new) / S)  # two whole sequences
    small = generate(model, prompts, new, policy, num_pages=pool, page_size=S)
    big = generate(model, prompts, new, policy, page_size=S)
    assert small.tokens == big.tokens
    with pytest.raises(RuntimeError, match="out of pages"):
        generate(model, prompts, new, compose("full"), num_pages=pool, page_size=S)
