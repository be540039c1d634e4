"""MiniCache in PagedKVCache: a merged pair of cache layers shares one storage region.

Oracles: the unmerged cache (retain_ratio=1 merges nothing, so outputs must match it), dense attention over
``merge_restore`` of the kept tokens computed here from the originals (retain_ratio=0), a naive joint
selection on summed prefill scores, and page arithmetic for the reported bytes.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvkernels.merge import magnitude_direction_merge_ref, merge_restore
from kvpolicies import available, compose, get_policy
from test_cache import FakeRun, check_invariants, dense_attention

# A reconstruction pass (kvzip) with merging is refused by the Decoder before any token (tests/test_kvzip.py).
EVICTION = [row.name for row in available(role="eviction") if not get_policy(row.name).probe]
PARAMS = {"snapkv": {"window": 3, "kernel": 3}, "streaming": {"sinks": 2}}


def policy_of(eviction, *names, **kw):
    options = {eviction: PARAMS[eviction]} if eviction in PARAMS else {}
    return compose(eviction, *names, **options, **kw)


def minicache(eviction="full", *names, retain_ratio=0.05, t=0.5, start=0.5, **kw):
    options = {"retain_ratio": retain_ratio, "t": t, "start": start}
    return policy_of(eviction, "minicache", *names, minicache=options, **kw)


def gather_heads(x, pos):
    """``x [L, H, ...]`` by per-head positions ``pos [n, H]`` -> ``[n, H, ...]``."""
    return torch.stack([x[pos[:, h].long(), h] for h in range(pos.shape[1])], dim=1)


def angle(a, b):
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.acos(cos.clamp(-1, 1))


# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eviction,budget,alibi", [("full", 1.0, False), ("streaming", 0.5, True),
                                                   ("window", 4, False)])
def test_retaining_every_token_equals_the_unmerged_cache(eviction, budget, alibi):
    run = FakeRun(4, 2, 2, 8, [9, 1, 14], 6, seed=3, alibi=alibi)
    plain = run.cache(policy_of(eviction, budget=budget, evict_every=2), page_size=4)
    merged = run.cache(minicache(eviction, retain_ratio=1.0, budget=budget, evict_every=2), page_size=4)
    assert merged.merged_pairs == [(2, 3)]
    for cache in (plain, merged):
        run.prefill(cache)
    check_invariants(merged)
    for t in range(run.n_steps):
        want, got = run.decode_step(plain, t), run.decode_step(merged, t)
        check_invariants(merged)
        for l in range(run.n_layers):
            torch.testing.assert_close(got[l], want[l], rtol=1e-6, atol=1e-6)
    # Nothing merged: the region holds each layer's tokens privately, so it is as large as the two layers.
    rep_p, rep_m = plain.report(), merged.report()
    pair_slots = [[sum(col) for col in zip(*rep.tokens_per_layer[2:])] for rep in (rep_m, rep_p)]
    assert pair_slots[0] == pair_slots[1]


@given(st.integers(1, 3), st.sampled_from([1, 2]), st.lists(st.integers(1, 12), min_size=1, max_size=3),
       st.sampled_from([1, 3, 4]), st.sampled_from(["full", "h2o"]), st.floats(0.0, 1.0), st.integers(0, 999),
       st.sampled_from([2, 4]))
@settings(max_examples=15, deadline=None)
def test_merging_everything_equals_dense_attention_over_restored_tokens(n_kv, group, prompt_lens, page_size,
                                                                        eviction, t, seed, n_layers):
    # Four layers merge two pairs: a later pair's merge must not touch an earlier pair's region.
    run = FakeRun(n_layers, n_kv, group, 4, prompt_lens, 1, seed=seed)
    policy = minicache(eviction, retain_ratio=0.0, t=t, start=0.0, budget=0.6 if eviction == "h2o" else 1.0)
    cache = run.cache(policy, page_size=page_size)
    assert cache.merged_pairs == [(l, l + 1) for l in range(0, n_layers, 2)]
    run.prefill(cache)
    check_invariants(cache)
    kept = {(a, b): cache.layer_contents(a, b)["pos"] for a, _ in cache.merged_pairs
            for b in range(len(prompt_lens))}
    outs = run.decode_step(cache, 0)
    check_invariants(cache)
    for (a, b), pos in kept.items():
        originals = {}
        for which in (1, 2):  # K, V
            xa, xb = (gather_heads(run.prompt[l][b][which], pos) for l in (a, a + 1))  # [n, Hkv, D]
            direction, mag_a, mag_b, _ = magnitude_direction_merge_ref(xa, xb, t=t, retain_ratio=0.0)
            originals[which] = (merge_restore(direction, mag_a), merge_restore(direction, mag_b))
        for i, l in enumerate((a, a + 1)):
            q, k_new, v_new = run.steps[0][l]
            k = torch.cat([originals[1][i], k_new[b:b + 1]])  # the new token is private and exact
            v = torch.cat([originals[2][i], v_new[b:b + 1]])
            torch.testing.assert_close(outs[l][b], dense_attention(q[b], k, v, run.scale), rtol=1e-5,
                                       atol=1e-5)


def test_pair_keeps_the_top_tokens_of_the_summed_scores():
    run = FakeRun(2, 2, 1, 4, [13, 6], 0, seed=8)
    budget = 5
    cache = run.cache(minicache("h2o", retain_ratio=0.0, start=0.0, budget=budget), page_size=4)
    scorer = run.cache(compose("h2o", budget=budget), page_size=4)  # prefill only: the unselected scores
    for c in (cache, scorer):
        c.start(run.prompt_lens, 0)
        for b in range(2):
            for l in range(2):
                c.prefill_layer(l, b, *run.prompt[l][b], run.positions(b), scale=run.scale)
    summed = [scorer.layer_contents(0, b)["score"] + scorer.layer_contents(1, b)["score"] for b in range(2)]
    cache.finish_prefill()
    n_recent = int(cache.eviction.forced(torch.tensor([budget]))[1])
    for b, L in enumerate(run.prompt_lens):
        got = cache.layer_contents(1, b)["pos"]
        for h in range(2):
            if L <= budget:
                want = list(range(L))
            else:  # the recent window, then the best of the rest (ties: earlier token)
                rest = sorted(range(L - n_recent), key=lambda j: (-float(summed[b][j, h]), j))
                want = sorted(rest[:budget - n_recent] + list(range(L - n_recent, L)))
            assert got[:, h].tolist() == want


def test_restore_error_is_bounded_and_retained_tokens_are_exact():
    t, ratio = 0.3, 0.25
    run = FakeRun(4, 2, 2, 8, [16, 7], 0, seed=11)
    cache = run.cache(minicache(retain_ratio=ratio, t=t), page_size=4)
    run.prefill(cache)
    a, b = cache.merged_pairs[0]
    for seq, L in enumerate(run.prompt_lens):
        n_ret = math.ceil(ratio * L)
        for member, l in enumerate((a, b)):
            got = cache.layer_contents(l, seq)
            assert got["k"].shape[0] == L + n_ret
            vis = got["visible"]
            assert (vis.sum(0) == L).all()
            for h in range(2):
                pos = got["pos"][vis[:, h], h].long()
                assert pos.tolist() == list(range(L))  # every token once, in order
                theta = torch.maximum(*(angle(run.prompt[a][seq][w][:, h], run.prompt[b][seq][w][:, h])
                                        for w in (1, 2)))  # [L]
                retained = set(torch.sort(theta, descending=True, stable=True).indices[:n_ret].tolist())
                private = set(pos[(got["visible"][vis[:, h], h]) & ~_shared(cache, l, seq)[vis[:, h], h]]
                              .tolist())
                assert private == retained
                limit = min(float(theta[list(retained)].min()), math.pi) if retained else math.pi
                for w, name in ((1, "k"), (2, "v")):
                    orig = run.prompt[l][seq][w][:, h]  # [L, D]
                    restored = got[name][vis[:, h], h]
                    torch.testing.assert_close(restored.norm(dim=-1), orig.norm(dim=-1), rtol=1e-5, atol=1e-6)
                    err = angle(restored, orig)
                    share = t if member == 0 else 1 - t  # a's direction moves t * theta, b's (1 - t) * theta
                    assert (err <= share * limit + 1e-3).all()
                    for p in retained:
                        assert torch.equal(restored[p], orig[p])


def _shared(cache, l, b):
    """``[n, Hkv]`` bool: slots of ``l``'s region visible to both layers."""
    s = cache.layout.storage[l]
    n = int(cache.seq_lens[s, b])
    pages = cache.page_table[s, b, :math.ceil(n / cache.page_size)].long()
    return cache.slot_mask[pages].flatten(0, 1)[:n] == 3


def test_report_shows_the_pages_the_merge_returns():
    ratio, S = 0.1, 4
    prompt_lens = [40, 9]
    run = FakeRun(6, 2, 1, 8, prompt_lens, 3, seed=2)
    plain, merged = run.cache(page_size=S), run.cache(minicache(retain_ratio=ratio), page_size=S)
    for cache in (plain, merged):
        run.prefill(cache)
    assert merged.merged_pairs == [(3, 4)]
    slot_bytes = 2 * (2 * 8 * 4 + 4 + 4)  # Hkv * (K + V + pos + score)
    assert plain.page_bytes == S * slot_bytes
    assert merged.page_bytes == S * (slot_bytes + 2 * (4 * 4 + 1))  # + 4 magnitudes and the mask per head
    region = [L + math.ceil(ratio * L) for L in prompt_lens]
    rep = merged.report()
    assert rep.tokens_per_layer[3] == tuple(region) and rep.tokens_per_layer[4] == (0, 0)
    assert rep.bytes_per_layer[4] == 0
    pages = [math.ceil(L / S) for L in prompt_lens]
    want_pages = 4 * sum(pages) + sum(math.ceil(r / S) for r in region)  # layers 0, 1, 2, 5 + the region
    assert rep.total_bytes == want_pages * merged.page_bytes
    assert plain.report().total_bytes == 6 * sum(pages) * plain.page_bytes
    assert rep.pages_in_use == want_pages < 6 * sum(pages)
    assert "merged pairs" in str(rep)
    for step in range(3):  # both layers append privately: the region grows by 2 slots per step
        run.decode_step(merged, step)
        assert merged.report().tokens_per_layer[3] == tuple(r + 2 * (step + 1) for r in region)
        check_invariants(merged)


@pytest.mark.parametrize("eviction", EVICTION)
def test_every_eviction_policy_runs_with_minicache(eviction):
    @given(st.integers(2, 5), st.lists(st.integers(1, 14), min_size=1, max_size=3), st.integers(0, 6),
           st.sampled_from([1, 3, 4]), st.sampled_from([0.3, 0.6, 1.0, 3]), st.integers(1, 3),
           st.sampled_from([0.0, 0.2, 1.0]), st.sampled_from(["uniform", "pyramid"]), st.integers(0, 999))
    @settings(max_examples=6, deadline=None)
    def check(n_layers, prompt_lens, n_steps, page_size, budget, evict_every, ratio, budget_policy, seed):
        if eviction == "full":
            budget, budget_policy = 1.0, "uniform"
        policy = minicache(eviction, budget_policy, retain_ratio=ratio, budget=budget,
                           evict_every=evict_every, seed=seed)
        run = FakeRun(n_layers, 2, 2, 4, prompt_lens, n_steps, seed)
        cache = run.cache(policy, page_size=page_size, seed=seed)
        run.prefill(cache)
        check_invariants(cache)
        for t in range(n_steps):
            outs = run.decode_step(cache, t)
            assert all(torch.isfinite(o).all() for o in outs)
            check_invariants(cache)
            for a, b in cache.merged_pairs:
                for seq in range(len(prompt_lens)):
                    if cache.host.active[seq]:
                        check_region(run, cache, seq, t, a, b)
            if t == 1:
                cache.finish_sequence(0)
                check_invariants(cache)
        for seq in range(len(prompt_lens)):
            if cache.host.active[seq]:
                cache.finish_sequence(seq)
        check_invariants(cache)
        assert int(cache.n_free) == cache.pool.free == cache.num_pages

    check()


def check_region(run, cache, seq, t, a, b):
    """After decode step ``t``, each layer of the pair sees every token it keeps once, in order, through
    slots that restore to the token's original length for that layer (exactly, when private)."""
    for l in (a, b):
        got = cache.layer_contents(l, seq)
        k_all, v_all = run.seen(l, seq, t)  # row = position
        for h in range(cache.n_kv_heads):
            vis = got["visible"][:, h]
            pos = got["pos"][vis, h].long()
            assert (pos[1:] > pos[:-1]).all(), f"layer {l} head {h} sees {pos.tolist()}"
            for name, orig in (("k", k_all[pos, h]), ("v", v_all[pos, h])):
                restored = got[name][vis, h]
                torch.testing.assert_close(restored.norm(dim=-1), orig.norm(dim=-1), rtol=1e-5, atol=1e-5)
            private = ~_shared(cache, l, seq)[vis, h]
            assert torch.equal(got["k"][vis, h][private], k_all[pos[private], h])
