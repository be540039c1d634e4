"""Head-adaptive budgets (``adakv``) and the cache of per-head pages that holds them (``HeadPagedKVCache``).

Oracles written for clarity: ``reference_split`` (Ada-KV's one top-k across heads with a per-head floor, in
plain Python), ``PagedKVCache`` (a head-paged cache with even budgets must keep exactly what it keeps and
attend exactly alike) and dense attention over each head's kept tokens.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import assume, given

from devices import DEVICE
from kvmodels.cache import PagedKVCache, paged_cache
from kvmodels.generate import generate
from kvmodels.head_cache import HeadPagedKVCache
from kvpolicies import compose
from test_cache import FakeRun, dense_attention
from test_model_policy_matrix import FAMILIES, PROMPTS, VOCAB, tiny_model


def reference_split(scores: list[list[float]], budget: int, alpha: float, n_sink: int,
                    n_recent: int) -> list[int]:
    """Ada-KV's head budgets for one layer, token by token: every head keeps its forced tokens and its best
    ``floor`` tokens; the remaining ``H * budget - H * floor`` slots go to the best of all other
    (head, token) pairs, ties to the lower head, then to the head's earlier-ranked token."""
    H, L = len(scores), len(scores[0])
    if L <= budget:
        return [budget] * H
    floor = min(L, max(math.ceil(alpha * budget - 1e-9), n_sink + n_recent, 1))

    def forced(j: int) -> bool:
        return j < n_sink or j >= L - n_recent

    candidates = []
    for h in range(H):
        ranked = sorted(range(L), key=lambda j: (not forced(j), -scores[h][j], j))  # the head's order
        for rank, j in enumerate(ranked[floor:]):
            candidates.append((-scores[h][j], h, rank))
    candidates.sort()
    counts = [floor] * H
    for _, h, _ in candidates[:H * budget - H * floor]:
        counts[h] += 1
    return counts


@given(H=st.integers(1, 4), L=st.integers(1, 40), data=st.data(),
       alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_split_matches_the_reference(H, L, data, alpha):
    budget = data.draw(st.integers(1, L + 3), label="budget")
    n_sink = data.draw(st.integers(0, min(2, budget)), label="n_sink")
    n_recent = data.draw(st.integers(0, budget - n_sink), label="n_recent")
    # Small integer scores: many ties between heads and tokens.
    scores = [[float(data.draw(st.integers(0, 5))) for _ in range(L)] for _ in range(H)]
    policy = compose("snapkv", "adakv", adakv={"alpha": alpha})
    got = policy.head_budgets(torch.tensor(scores), budget, n_sink, n_recent)
    assert got.tolist() == reference_split(scores, budget, alpha, n_sink, n_recent)
    if L > budget:
        assert int(got.sum()) == H * budget  # the layer's memory is conserved, only moved between heads


def test_split_moves_budget_to_the_diffuse_head():
    peaked = [10.0] * 2 + [0.0] * 18  # two tokens hold all of this head's attention
    diffuse = [1.0] * 20
    got = compose("snapkv", "adakv").head_budgets(torch.tensor([peaked, diffuse]), 10, 0, 0)
    assert got.tolist() == [2, 18]  # floor ceil(0.2 * 10) = 2 for the peaked head, the rest to the other


def test_compose_checks_head_policies_up_front():
    p = compose("squeeze", "snapkv", "adakv", budget=0.2, adakv={"alpha": 0.5})
    assert p.name == "squeeze+snapkv+adakv" and compose(p.spec()) == p and compose(p.to_json()) == p
    assert compose("h2o").heads.name == "even" and compose("h2o").name == "h2o"
    with pytest.raises(ValueError, match="'streaming' scores no prompt"):
        compose("streaming", "adakv")
    with pytest.raises(ValueError, match="tova"):
        compose("tova", "adakv")  # its heads share one selection
    assert compose("tova", "adakv", tova={"per_head": True}).heads.per_head
    with pytest.raises(ValueError, match=r"snapkv=\{'per_head': True\}"):
        compose("snapkv", "adakv", snapkv={"per_head": False})  # one selection per layer, by choice
    with pytest.raises(ValueError, match="minicache"):
        compose("h2o", "adakv", "minicache")
    with pytest.raises(ValueError, match="alpha"):
        compose("snapkv", "adakv", adakv={"alpha": 1.5})
    with pytest.raises(ValueError, match="both heads policies"):
        compose("snapkv", "adakv", "even")


def test_caches_refuse_what_they_cannot_hold():
    run = FakeRun(1, 2, 1, 4, [5], 1, seed=0)
    with pytest.raises(ValueError, match="HeadPagedKVCache"):
        run.cache(compose("snapkv", "adakv"))
    with pytest.raises(ValueError, match="'tova'"):
        HeadPagedKVCache(1, 2, 4, 2, 1, 8, policy=compose("tova"))


def head_cache(run: FakeRun, policy, page_size: int = 4, extra: int = 0) -> HeadPagedKVCache:
    return HeadPagedKVCache(n_layers=run.n_layers, n_kv_heads=run.n_kv_heads, head_dim=run.head_dim,
                            n_q_heads=run.n_q_heads, max_batch=len(run.prompt_lens),
                            max_tokens=max(run.prompt_lens) + run.n_steps + extra, page_size=page_size,
                            dtype=run.dtype, device=DEVICE, policy=policy)


lens_st = st.lists(st.integers(1, 19), min_size=1, max_size=3)


@given(lens=lens_st, n_kv=st.integers(1, 3), group=st.sampled_from([1, 2, 3]), alibi=st.booleans(),
       name=st.sampled_from(["snapkv", "h2o", "scissorhands", "knorm", "chunkkv", "full"]),
       seed=st.integers(0, 2**16))
def test_head_pages_with_even_budgets_equal_the_paged_cache(lens, n_kv, group, alibi, name, seed):
    """Rows of one head translate exactly: same attention outputs, same kept tokens in every head, same
    bytes (a page of one head holds S of that head's slots; S slots of every head cost the same)."""
    policy = compose(name, budget=0.4, **({"snapkv": {"window": 3}} if name == "snapkv" else {}))
    run = FakeRun(2, n_kv, group, 4, lens, 3, seed=seed, alibi=alibi)
    paged, heads = run.cache(policy), head_cache(run, policy)
    run.prefill(paged)
    run.prefill(heads)
    for t in range(run.n_steps):
        for want, got in zip(run.decode_step(paged, t), run.decode_step(heads, t)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for l in range(run.n_layers):
        for b in range(len(lens)):
            want = paged.layer_contents(l, b)
            for h, got in enumerate(heads.head_contents(l, b)):
                assert torch.equal(got["pos"], want["pos"][:, h])
                assert torch.equal(got["k"], want["k"][:, h]) and torch.equal(got["v"], want["v"][:, h])
    assert heads.report().total_bytes == paged.report().total_bytes


@given(lens=lens_st, n_kv=st.integers(1, 3), group=st.sampled_from([1, 2]), alibi=st.booleans(),
       name=st.sampled_from(["snapkv", "h2o", "knorm", "full", "streaming", "chunkkv"]),
       n_new=st.integers(1, 7), who=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_head_pages_take_a_follow_up_as_the_paged_cache_does(lens, n_kv, group, alibi, name, n_new, who,
                                                             seed):
    """A sequence that takes tokens after its prompt (begin_extend / extend_attend / end_extend, between
    decode steps) on rows per KV head: the same attention outputs, re-plan and compression as on rows per
    sequence, then the same decode steps and kept tokens in every head."""
    policy = compose(name, budget=0.4, **({"snapkv": {"window": 3}} if name == "snapkv" else {}))
    run = FakeRun(2, n_kv, group, 4, lens, 3, seed=seed, alibi=alibi)
    paged, heads = run.cache(policy, max_new=run.n_steps + n_new), head_cache(run, policy, extra=n_new)
    b, B = who % len(lens), len(lens)
    g = torch.Generator().manual_seed(seed + 1)
    new = [tuple(torch.randn(n_new, h, run.head_dim, generator=g).to(DEVICE)
                 for h in (run.n_q_heads, n_kv, n_kv)) for _ in range(run.n_layers)]
    shift = torch.tensor([n_new if i == b else 0 for i in range(B)], dtype=torch.int32, device=DEVICE)
    for cache in (paged, heads):
        run.prefill(cache)
    for t in range(run.n_steps):
        if t == 1:  # between steps 0 and 1, sequence b takes n_new tokens after the ones it has seen
            start = lens[b] + 1
            positions = torch.arange(start, start + n_new, dtype=torch.int32, device=DEVICE)
            outs = []
            for cache in (paged, heads):
                cache.begin_extend(b, n_new)
                outs.append([cache.extend_attend(l, b, *new[l], positions, scale=run.scale,
                                                 alibi_slopes=run.alibi) for l in range(run.n_layers)])
                cache.end_extend(b)
            for want, got in zip(*outs, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert heads.slots_held(b) == paged.slots_held(b) and heads.decode_room(b) == paged.decode_room(b)
        pos = run.step_positions(t) + (shift if t >= 1 else 0)
        steps = [run.decode_step(cache, t, pos) for cache in (paged, heads)]
        for want, got in zip(*steps, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for l in range(run.n_layers):
        for s in range(B):
            want = paged.layer_contents(l, s)
            for h, got in enumerate(heads.head_contents(l, s)):
                assert torch.equal(got["pos"], want["pos"][:, h])
                assert torch.equal(got["k"], want["k"][:, h]) and torch.equal(got["v"], want["v"][:, h])
    assert heads.report().total_bytes == paged.report().total_bytes


@given(lens=lens_st, n_kv=st.integers(2, 3), group=st.sampled_from([1, 2]), alpha=st.sampled_from([0.0, 0.2]),
       page_size=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_adakv_keeps_each_heads_best_tokens_in_its_own_pages(lens, n_kv, group, alpha, page_size, seed):
    """``snapkv+adakv``: each head keeps its window plus its best prompt tokens, as many as the reference
    split gives it; the heads of a layer hold ``Hkv * B`` tokens in all, each in ``ceil(n_h / S)`` pages of
    its own; attention over them equals dense attention over each head's kept tokens."""
    window = 2
    run = FakeRun(2, n_kv, group, 4, lens, 2, seed=seed)
    scorer = head_cache(run, compose("snapkv", "adakv", budget=1.0, snapkv={"window": window}))
    run.prefill(scorer)  # budget 1.0 keeps every token: its scores are the uncompressed prompt's
    policy = compose("snapkv", "adakv", budget=0.3, snapkv={"window": window}, adakv={"alpha": alpha})
    cache = head_cache(run, policy, page_size)
    run.prefill(cache)
    rep = cache.report()
    pages = 0
    for l in range(run.n_layers):
        for b, L in enumerate(lens):
            B = policy.budget_tokens(torch.tensor([L]))[0].item()
            stored = scorer.head_contents(l, b)
            scores = [c["score"].tolist() for c in stored]
            n_recent = min(window, B)
            counts = reference_split(scores, B, alpha, 0, n_recent)
            kept = cache.head_contents(l, b)
            assert [len(c["pos"]) for c in kept] == [min(n, L) for n in counts]
            for h, c in enumerate(kept):
                n = min(counts[h], L)
                best = sorted(range(L), key=lambda j: (j < L - n_recent, -scores[h][j], j))[:n]
                assert c["pos"].tolist() == sorted(best), (l, b, h)
                assert torch.equal(c["k"], run.prompt[l][b][1][sorted(best), h])  # bit-identical
                pages += -(-n // page_size)
            assert rep.head_tokens[l][b] == tuple(min(n, L) for n in counts)
    assert rep.total_bytes == pages * cache.page_bytes
    # Decode: each head's output is dense attention over what that head holds (the new token included).
    t = 0
    cache.prepare_decode(t)
    pos = run.step_positions(t)
    for l in range(run.n_layers):
        q, k, v = run.steps[t][l]
        cache.append(l, k, v, pos)
        held = [cache.head_contents(l, b) for b in range(len(lens))]
        out = cache.attend(l, q, pos, scale=run.scale)
        for b in range(len(lens)):
            for h, c in enumerate(held[b]):
                group_q = q[b, h * group:(h + 1) * group]  # [G, D]
                want = dense_attention(group_q, c["k"][:, None], c["v"][:, None], run.scale)
                torch.testing.assert_close(out[b, h * group:(h + 1) * group], want, atol=1e-5, rtol=1e-5)
    cache.after_step(t)


@given(lens=lens_st, seed=st.integers(0, 2**16))
def test_compressing_each_prompt_keeps_what_finish_prefill_keeps(lens, seed):
    """``generate`` compresses each prompt right after its prefill: the head budgets are planned then, from
    the uncompressed scores, and ``finish_prefill`` keeps them (it must not re-plan from compressed heads)."""
    run = FakeRun(2, 3, 1, 4, lens, 1, seed=seed)
    policy = compose("snapkv", "adakv", budget=0.3, snapkv={"window": 2})
    whole, each = head_cache(run, policy), head_cache(run, policy)
    run.prefill(whole)
    each.start(lens, run.n_steps, compress_each=True)
    for b in range(len(lens)):
        for l in range(run.n_layers):
            each.prefill_layer(l, b, *run.prompt[l][b], run.positions(b), scale=run.scale)
        each.compress_prompt(b)
    each.finish_prefill()
    assert each.report().head_tokens == whole.report().head_tokens
    assert torch.equal(each.budgets, whole.budgets)
    for l in range(run.n_layers):
        for b in range(len(lens)):
            for got, want in zip(each.head_contents(l, b), whole.head_contents(l, b)):
                assert torch.equal(got["pos"], want["pos"])


@given(lens=lens_st, seed=st.integers(0, 2**16), evict_every=st.sampled_from([1, 2]))
def test_decode_time_eviction_holds_each_head_at_its_own_budget(lens, seed, evict_every):
    assume(max(lens) > 6)
    run = FakeRun(2, 3, 2, 4, lens, 5, seed=seed)
    policy = compose("h2o", "adakv", budget=0.4, evict_every=evict_every)
    cache = head_cache(run, policy)
    run.prefill(cache)
    budgets = cache.budgets[:, :cache.batch_size].clone()  # [Lc, B * Hkv]: one budget per head
    for t in range(run.n_steps):
        run.decode_step(cache, t)
        lens_now = cache.seq_lens[:, :cache.batch_size]
        assert bool((lens_now <= budgets + evict_every - 1).all())
        assert torch.equal(cache.budgets[:, :cache.batch_size], budgets)  # planned once, held
    # Budgets of a compressed layer sum to Hkv x the layer's budget, per sequence.
    per_seq = budgets.view(run.n_layers, len(lens), 3).sum(-1)
    for b, L in enumerate(lens):
        B = policy.budget_tokens(torch.tensor([L]))[0].item()
        assert bool((per_seq[:, b] == 3 * B).all())


@pytest.fixture(scope="module")
def models():
    return {f: tiny_model(f) for f in FAMILIES}


@pytest.mark.parametrize("spec", [("snapkv", "adakv"), ("squeeze", "h2o", "adakv"),
                                  ("pyramid", "chunkkv", "adakv")])
def test_adakv_runs_on_every_model(models, spec):
    policy = compose(*spec, budget=0.5, evict_every=2)
    for family, model in models.items():
        res = generate(model, PROMPTS, 4, policy)
        assert [len(t) for t in res.tokens] == [4] * len(PROMPTS), family
        assert all(0 <= t < VOCAB for seq in res.tokens for t in seq)
        rep = res.report
        assert rep.head_tokens is not None and 0 < rep.total_bytes <= rep.full_cache_bytes, family
        # Layer budgets stay those of the layer-budget policy: their mean over heads is the layer's.
        even = compose(*[s for s in spec if s != "adakv"], budget=0.5, evict_every=2)
        assert rep.layer_budgets == generate(model, PROMPTS, 4, even).report.layer_budgets, family


def test_paged_cache_picks_the_class_for_the_policy():
    kw = dict(n_layers=1, n_kv_heads=2, head_dim=4, n_q_heads=4, max_batch=1, max_tokens=8, num_pages=3)
    assert type(paged_cache(**kw, policy=compose("snapkv"))) is PagedKVCache
    cache = paged_cache(**kw, policy=compose("snapkv", "adakv"))
    assert isinstance(cache, HeadPagedKVCache) and cache.num_pages == 6  # pages of one head


@pytest.mark.slow
def test_compiled_decode_step_no_graph_break_no_recompile(models):
    import torch._dynamo

    policy = compose("squeeze", "h2o", "adakv", budget=0.5, evict_every=2)
    eager = generate(models["llama"], PROMPTS, 6, policy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(models["llama"], PROMPTS, 6, policy, compile=True)
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert compiled.tokens == eager.tokens


def test_a_split_that_breaks_the_contract_is_refused(clean_registry):
    from dataclasses import dataclass

    from kvpolicies import HeadBudgetPolicy, register_policy

    @register_policy("greedy_heads", role="heads")
    @dataclass(frozen=True)
    class Greedy(HeadBudgetPolicy):
        """Every slot to head 0 (takes the other heads' forced tokens away)."""

        per_head = True

        def split(self, scores, budget, n_forced, *, layer=None):
            out = torch.zeros(scores.shape[0], dtype=torch.int64)
            out[0] = scores.shape[0] * budget
            return out

    policy = compose("snapkv", "greedy_heads", budget=0.4, snapkv={"window": 2})
    with pytest.raises(ValueError, match="greedy_heads.*at least max"):
        policy.head_budgets(torch.rand(2, 10), 4, 0, 2)
    run = FakeRun(1, 2, 1, 4, [10], 1, seed=0)
    with pytest.raises(ValueError, match="greedy_heads"):
        run.prefill(head_cache(run, policy))


def test_pool_checks_count_every_head():
    """``start(compress_each=True)`` needs the longest prompt whole in every head's rows, before anything is
    written: 2 layers x 3 heads x ceil(9 / 4) pages = 18."""
    run = FakeRun(2, 3, 1, 4, [9, 9], 1, seed=0)
    kw = dict(n_layers=2, n_kv_heads=3, head_dim=4, n_q_heads=3, max_batch=2, max_tokens=10, page_size=4,
              device=DEVICE, policy=compose("snapkv", "adakv", budget=0.3))
    with pytest.raises(RuntimeError, match="needs 18 more pages"):
        HeadPagedKVCache(**kw, num_pages=17).start(run.prompt_lens, 1, compress_each=True)
    HeadPagedKVCache(**kw, num_pages=18).start(run.prompt_lens, 1, compress_each=True)
