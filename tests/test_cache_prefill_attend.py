"""``prefill_attend``: the model's prompt attention and the policy's prompt scores from one computation of
the attention probabilities (``kvkernels.prefill_attention_scores``) give what ``prefill_attention``
followed by ``prefill_layer(..., lse=...)`` gives: the same attention output and stored K/V, the same scores
up to float rounding, and so the same kept tokens. ``tests/test_cache_policies.py`` checks the second path
against the papers' dense references.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from devices import DEVICE
from kvkernels import prefill_attention
from kvmodels.cache import PagedKVCache, paged_cache
from kvmodels.generate import generate
from kvmodels.head_cache import HeadPagedKVCache
from kvpolicies import compose
from test_cache import FakeRun
from test_cache_policies import _near_tie
from test_generate import V, tiny_llama

# (compose arguments, whether the prompt scores are fused into the attention on CPU)
POLICIES = [
    (("h2o",), True),
    (("a2sf",), True),
    (("squeeze", "h2o"), True),
    (("pyramid", "a2sf"), True),
    (("h2o", "adakv"), True),            # per-head pages (HeadPagedKVCache)
    (("snapkv",), False),                # a 3-row observation window: fused only for prompts up to 6 tokens
    (("tova",), False),                  # the last row alone
    (("keyformer",), False),             # Gumbel noise in the logits
    (("scissorhands",), False),          # counts, not sums
    (("streaming",), False),             # no prompt scores
    (("full",), False),
]
OPTIONS = {"snapkv": {"window": 3, "kernel": 3}}


def _cache(run: FakeRun, names: tuple[str, ...], budget, page_size: int) -> PagedKVCache:
    options = {n: OPTIONS[n] for n in names if n in OPTIONS}
    policy = compose(*names, budget=budget, **options)
    return paged_cache(n_layers=run.n_layers, n_kv_heads=run.n_kv_heads, head_dim=run.head_dim,
                       n_q_heads=run.n_q_heads, max_batch=len(run.prompt_lens),
                       max_tokens=max(run.prompt_lens), page_size=page_size, dtype=run.dtype, device=DEVICE,
                       policy=policy)


@pytest.mark.parametrize("names, fused", POLICIES, ids=["+".join(p[0]) for p in POLICIES])
@given(n_layers=st.integers(1, 2), n_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), page_size=st.sampled_from([1, 4, 16]),
       budget=st.sampled_from([0.25, 0.5, 3]), seed=st.integers(0, 2**16))
def test_prefill_attend_matches_attention_then_prefill_layer(names, fused, n_layers, n_kv, group, lens,
                                                             page_size, budget, seed):
    run = FakeRun(n_layers, n_kv, group, 8, lens, 0, seed)
    one, two = _cache(run, names, budget, page_size), _cache(run, names, budget, page_size)
    for c in (one, two):
        c.start(lens, 0)
    for b, L in enumerate(lens):
        for l in range(n_layers):
            q, k, v = run.prompt[l][b]
            pos = run.positions(b)
            if DEVICE.type == "cpu":  # the path the test exercises: fused exactly where promised
                scoring = one._fused_scoring(l, L)
                assert (scoring is not None) == (fused or (names == ("snapkv",) and L <= 6)), scoring
            got = one.prefill_attend(l, b, q, k, v, pos, scale=run.scale)
            want, lse = prefill_attention(q, k, v, scale=run.scale)
            two.prefill_layer(l, b, q, k, v, pos, scale=run.scale, lse=lse)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = [(l, b) for l in range(n_layers) for b in range(len(lens))]
    contents = [(_heads(one, l, b), _heads(two, l, b)) for l, b in layers]
    for xs, ys in contents:
        for x, y in zip(xs, ys, strict=True):
            for key in ("k", "v", "pos"):
                assert torch.equal(x[key], y[key]), key  # the prompt as given, bit for bit
            torch.testing.assert_close(x["score"], y["score"], rtol=1e-4, atol=1e-6)
    one.finish_prefill()
    two.finish_prefill()
    for (l, b), (pre, _) in zip(layers, contents, strict=True):
        for h, (x, y) in enumerate(zip(_heads(one, l, b), _heads(two, l, b), strict=True)):
            kept_one, kept_two = x["pos"].tolist(), y["pos"].tolist()
            if sorted(kept_one) != sorted(kept_two):  # only where two scores are within rounding
                by_pos = dict(zip(pre[h]["pos"].tolist(), pre[h]["score"].tolist(), strict=True))
                assert _near_tie(by_pos, kept_one, kept_two), (l, b, h, kept_one, kept_two)


def _heads(cache: PagedKVCache, l: int, b: int) -> list[dict[str, torch.Tensor]]:
    """Kept tokens of layer ``l``, sequence ``b``, one dict per KV head (``k``/``v`` ``[n, D]``, ``pos`` and
    ``score`` ``[n]``), on the CPU, for either cache class."""
    if isinstance(cache, HeadPagedKVCache):
        per_head = cache.head_contents(l, b)
    else:
        c = cache.layer_contents(l, b)
        per_head = [{key: x[:, h] for key, x in c.items()} for h in range(cache.n_kv_heads)]
    return [{key: x.cpu() for key, x in d.items()} for d in per_head]


@pytest.mark.parametrize("names", [p[0] for p in POLICIES], ids=["+".join(p[0]) for p in POLICIES])
def test_the_attention_is_asked_for_its_lse_where_it_spares_most_of_a_pass(names):
    """``prefill_attend`` asks ``prefill_attention`` for the lse (on CUDA: torch's flash kernel in place of
    SDPA's pick) where the layer scores at least half the prompt's rows from it: every row of a
    column-sum mode, SnapKV's 3-row window up to 6 tokens, TOVA's last row up to 2; never Gumbel noise,
    counts, or no scores."""
    every_row = any(n in ("h2o", "a2sf") for n in names)
    rows = {("snapkv",): 3, ("tova",): 1}.get(names)
    run = FakeRun(1, 2, 2, 8, [40], 0, seed=1)
    cache = _cache(run, names, 0.5, 4)
    for L in (1, 2, 3, 5, 6, 7, 40):
        want = every_row or (rows is not None and 2 * rows >= L)
        assert cache._lse_pays(0, L) == want, (names, L)


def test_prefill_layer_refuses_scores_the_policy_does_not_take():
    run = FakeRun(1, 2, 2, 8, [20], 0, seed=1)
    q, k, v = run.prompt[0][0]
    cache = _cache(run, ("snapkv",), 0.5, 4)
    cache.start([20], 0)
    with pytest.raises(ValueError, match="scores were given for layer 0"):
        cache.prefill_layer(0, 0, q, k, v, run.positions(0), scale=run.scale, scores=torch.zeros(2, 20))
    h2o = _cache(run, ("h2o",), 0.5, 4)
    h2o.start([20], 0)
    with pytest.raises(ValueError, match="scores"):
        h2o.prefill_layer(0, 0, q, k, v, run.positions(0), scale=run.scale, scores=torch.zeros(3, 20))


@pytest.mark.parametrize("names", [("h2o",), ("squeeze", "a2sf"), ("h2o", "adakv")])
def test_generation_is_the_same_fused_or_not(names, monkeypatch):
    """A tiny Llama generates the same tokens whether the prompt scores come from the fused attention or
    from the separate scorer."""
    model = tiny_llama(seed=3, n_layers=3)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (45, 60, 33)]
    policy = compose(*names, budget=0.4)
    fused = generate(model, prompts, 12, policy).tokens
    monkeypatch.setattr(PagedKVCache, "_fused_scoring", lambda self, l, L: None)
    assert generate(model, prompts, 12, policy).tokens == fused
