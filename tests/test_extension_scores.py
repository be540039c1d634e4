"""``EvictionPolicy.extension_scores``: the one place where kvmodels' ``extend_attend`` turns an extension's
attention into scores (equivalence tests between two routes through it cannot see a mistake in it). Checked
against what the scores mean, not against the same code:

* a prompt cut in two, its first part scored as a prompt (``prompt_scores``) and its second fed as an
  extension over all of the first, scores every token as the whole prompt does (the rows the policy scores,
  its pooling, its decay), for every eviction policy that scores a prompt, ragged cuts and GQA included;
* a reconstruction pass (``probe=(lo, hi)``) replaces exactly the scores of the kept tokens at positions
  ``lo <= p < hi`` by the largest probability a pass row gives them, written here as a dense softmax.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from kvpolicies import compose

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = ["h2o", "snapkv(window=4, kernel=3)", "snapkv(window=3, per_head=False)", "tova",
            "a2sf(decay=0.9)",
            "keyformer(tau_init=2.0)", "scissorhands", "kvzip", "chunkkv(window=4, chunk=3)"]


def tensors(L: int, Hkv: int, G: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, Hkv * G, D, generator=g)
    k = torch.randn(L, Hkv, D, generator=g)
    v = torch.randn(L, Hkv, D, generator=g)
    return q, k, v


@example(name="snapkv(window=4, kernel=3)", L=9, cut=5, Hkv=2, G=2, seed=0)
@example(name="a2sf(decay=0.9)", L=6, cut=1, Hkv=1, G=3, seed=1)
@example(name="h2o", L=1, cut=0, Hkv=1, G=1, seed=0)
@given(name=st.sampled_from(POLICIES), L=st.integers(1, 24), cut=st.integers(0, 23), Hkv=st.integers(1, 2),
       G=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_an_extension_scores_as_the_prompt_it_completes(name, L, cut, Hkv, G, seed):
    ev = compose(name).eviction
    m = min(cut, L - 1)  # kept tokens; the extension takes the other n >= 1
    n = L - m
    # Window votes come from the extension's own rows: equal to the prompt's when it holds the window.
    assume(ev.prefill_window(n) == ev.prefill_window(L))
    assume(ev.prefill_kwargs(n) == ev.prefill_kwargs(L))
    q, k, v = tensors(L, Hkv, G, 8, seed)
    scale = 8**-0.5
    whole = ev.prompt_scores(q, k, scale=scale, seed=7)  # [Hkv, L]
    kept_scores = ev.prompt_scores(q[:m], k[:m], scale=scale, seed=7) if m else torch.zeros(Hkv, 0)
    pos = torch.arange(L)
    out, got = ev.extension_scores(q[m:], k[m:], v[m:], pos[m:], k[:m], v[:m], pos[:m, None].expand(m, Hkv),
                                   kept_scores, scale=scale, seed=7)
    assert got is not None and got.shape == (Hkv, L)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    # ...and attends as a dense causal softmax over the whole prompt does.
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(G, dim=1)) * scale
    logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v.repeat_interleave(G, dim=1))
    torch.testing.assert_close(out, dense[m:], rtol=1e-5, atol=1e-5)


def test_an_extension_scores_nothing_when_told_not_to_or_without_a_prefill_mode():
    q, k, v = tensors(5, 1, 1, 8, 0)
    pos = torch.arange(5)
    old = torch.rand(1, 3)
    for ev, scoring in ((compose("h2o").eviction, False), (compose("streaming").eviction, True)):
        _, got = ev.extension_scores(q[3:], k[3:], v[3:], pos[3:], k[:3], v[:3], pos[:3, None], old,
                                     scale=1.0, scoring=scoring)
        assert got is None


@example(m=6, n=3, lo=2, hi=4, seed=0)
@example(m=1, n=1, lo=0, hi=None, seed=0)
@given(m=st.integers(1, 12), n=st.integers(1, 6), lo=st.integers(0, 12),
       hi=st.one_of(st.none(), st.integers(0, 14)), seed=st.integers(0, 2**16))
def test_a_reconstruction_pass_replaces_the_scores_inside_its_span_only(m, n, lo, hi, seed):
    ev = compose("kvzip(skip=0)").eviction  # probe_skip None: every kept token scored
    Hkv, G = 2, 2
    q, k, v = tensors(m + n, Hkv, G, 8, seed)
    old = torch.rand(Hkv, m, generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(m + n)
    kept_pos = pos[:m, None].expand(m, Hkv)
    _, got = ev.extension_scores(q[m:], k[m:], v[m:], pos[m:], k[:m], v[:m], kept_pos, old, scale=0.5,
                                 probe=(lo, hi))
    assert got is not None and got.shape == (Hkv, m)
    # The pass rows' causal softmax over kept + pass tokens; a kept token's score: its largest probability
    # from any pass row and any query head of its KV head's group.
    logits = torch.einsum("qhd,khd->hqk", q[m:], k.repeat_interleave(G, dim=1)) * 0.5
    logits = logits.masked_fill(torch.ones(n, m + n, dtype=torch.bool).triu(m + 1), float("-inf"))
    p = logits.softmax(-1)[:, :, :m]  # [Hq, n, m]
    best = p.unflatten(0, (Hkv, G)).amax(dim=(1, 2))  # [Hkv, m]
    inside = (pos[:m] >= lo) & (pos[:m] < (m if hi is None else hi))
    want = torch.where(inside, best, old)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@example(m=4, n=3, window=2, Hkv=1, G=1, seed=0)  # the smallest window: each token sees itself and one more
@given(m=st.integers(0, 12), n=st.integers(1, 8), window=st.integers(2, 16), Hkv=st.integers(1, 2),
       G=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_an_extension_in_a_sliding_window_attends_as_the_windowed_prompt(m, n, window, Hkv, G, seed):
    """``sliding_window=W``: each new token attends to the keys at positions ``> its own - W``, kept ones
    (whatever their slots' order) and new ones, as a dense softmax under transformers' sliding mask over the
    whole sequence does."""
    L = m + n
    q, k, v = tensors(L, Hkv, G, 8, seed)
    scale = 8**-0.5
    order = torch.randperm(m, generator=torch.Generator().manual_seed(seed))  # kept rows out of order
    pos = torch.arange(L)
    out, _ = compose("h2o").eviction.extension_scores(
        q[m:], k[m:], v[m:], pos[m:], k[:m][order], v[:m][order], pos[:m][order, None].expand(m, Hkv),
        torch.zeros(Hkv, m), scale=scale, sliding_window=window)
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(G, dim=1)) * scale
    i = torch.arange(L)
    outside = (i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - window)  # [query, key]
    dense = torch.einsum("hqk,khd->qhd", logits.masked_fill(outside, float("-inf")).softmax(-1),
                         v.repeat_interleave(G, dim=1))
    torch.testing.assert_close(out, dense[m:], rtol=1e-5, atol=1e-5)
