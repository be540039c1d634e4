"""Each eviction policy's description keeps exactly the tokens its paper keeps.

A policy describes eviction to the cache by forced slots (``forced``), score rules (``score_mode``,
``prefill_mode``, ``prefill_window``, ``prefill_kwargs``, ``decode_kwargs``,
``postprocess_prefill_scores``) and flags (``prefill_compress``, ``decode_evict``); the cache applies
the score rules with the kernels and keeps forced + top scores (ties: lower slot). ``run_description``
below does the same densely with ``kvkernels._modes.update_scores_ref``; ``reference_policies.simulate``
is each paper written out independently. They must agree token for token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkernels._modes import update_scores_ref
from kvpolicies import EvictionPolicy, NewTokens, available, compose, get_policy
from kvpolicies.base import placed_chunk_sums
from reference_policies import (
    DEFAULTS,
    default_decode_noise,
    default_prefill_noise,
    group_probs,
    placed_chunks,
    simulate,
)

EVICTION = [row.name for row in available("eviction")]
# The simulated reference scores a prompt by its own queries; a policy ranked by a reconstruction pass (kvzip)
# is checked against its own dense oracle in tests/test_kvzip.py.
SIMULATED = [row.name for row in available("eviction") if not get_policy(row.name).probe]


def select(policy: EvictionPolicy, scores: torch.Tensor, b: int) -> torch.Tensor:
    """Slots ``[Hkv, b]`` kept by the description: forced + top scores, ties to the lower slot."""
    n_kv_heads, n = scores.shape
    if n <= b:
        return torch.arange(n).expand(n_kv_heads, n)
    n_sink, n_recent = (int(x[0]) for x in policy.forced(torch.tensor([b], dtype=torch.int32)))
    assert 0 <= n_sink and 0 <= n_recent and n_sink + n_recent <= b
    forced = torch.zeros(n, dtype=torch.bool)
    forced[:n_sink] = True
    forced[n - n_recent:] = True
    kept = []
    for h in range(n_kv_heads):
        key = torch.where(forced, torch.inf, scores[h].to(torch.float64))
        order = torch.sort(key, descending=True, stable=True).indices   # stable: lower slot first on ties
        kept.append(torch.sort(order[:b]).values)
    return torch.stack(kept)


def new_tokens(policy: EvictionPolicy, q, k, positions) -> NewTokens:
    """What a step hands an open score rule (values are zeros here: the description has no values)."""
    return NewTokens(k=k, v=torch.zeros_like(k), positions=positions,
                     q=q if policy.reads_queries else None)


def run_description(policy: EvictionPolicy, q_prompt, k_prompt, q_steps, k_steps, b: int, *, evict_every: int,
                    scale: float, prefill_noise, decode_noise, max_new_tokens: int) -> list[torch.Tensor]:
    """Token ids ``[Hkv, n]`` kept after the prompt and after each step, from the policy's description."""
    L, n_q_heads, _ = q_prompt.shape
    n_kv_heads = k_prompt.shape[1]
    group = n_q_heads // n_kv_heads
    ids = torch.arange(L).expand(n_kv_heads, L).clone()                # [Hkv, n]
    scores = torch.zeros(n_kv_heads, L, dtype=torch.float64)
    if policy.prefill_mode is not None and L:
        window = policy.prefill_window(L)
        kw = policy.prefill_kwargs(L)
        for i in range(L - window if window else 0, L):
            for h in range(n_kv_heads):
                noise = None
                if policy.prefill_mode == "gumbel":
                    noise = prefill_noise[h * group:(h + 1) * group, i, : i + 1]
                q_group = q_prompt[i, h * group:(h + 1) * group]                # [G, D]
                c = group_probs(q_group, k_prompt[: i + 1, h], scale, noise=noise,
                                temperature=kw.get("temperature", 1.0))
                scores[h, : i + 1] = update_scores_ref(scores[h, : i + 1], c, policy.prefill_mode,
                                                       decay=kw.get("decay", 1.0), n_valid=i + 1)
        scores = policy.postprocess_prefill_scores(scores)
    elif policy.scores_tokens and L:  # the open rule scores each token from its own key (no values here)
        scores = policy.token_scores(new_tokens(policy, q_prompt, k_prompt, torch.arange(L))).t().double()

    def compact() -> None:
        nonlocal ids, scores
        keep = select(policy, scores, b)
        ids, scores = ids.gather(1, keep), scores.gather(1, keep)

    if policy.prefill_compress:
        compact()
    out = [ids.clone()]
    all_k = torch.cat([k_prompt, k_steps])
    for t in range(q_steps.shape[0]):
        ids = torch.cat([ids, torch.full((n_kv_heads, 1), L + t)], dim=1)
        new = torch.zeros(n_kv_heads, 1, dtype=scores.dtype)
        if policy.scores_tokens:
            step = new_tokens(policy, q_steps[t], k_steps[t], torch.tensor(L + t))
            new = policy.token_scores(step).double()[:, None]
        scores = torch.cat([scores, new], dim=1)
        kw = policy.decode_kwargs(t, max_new_tokens)
        noise = decode_noise(t, ids.shape[1]) if policy.score_mode == "gumbel" else None
        for h in range(n_kv_heads):
            c = group_probs(q_steps[t, h * group:(h + 1) * group], all_k[ids[h], h], scale,
                            noise=None if noise is None else noise[h * group:(h + 1) * group],
                            temperature=kw.get("temperature", 1.0))
            scores[h] = update_scores_ref(scores[h], c, policy.score_mode, decay=kw.get("decay", 1.0),
                                          n_valid=ids.shape[1])
        if policy.decode_evict and (t + 1) % evict_every == 0:
            if policy.heads_share_selection:
                scores = scores.mean(0, keepdim=True).expand_as(scores).clone()
            compact()
        out.append(ids.clone())
    return out


def _tensor(draw, shape):
    """Values on a coarse grid (-1.5 .. 1.5 in steps of 0.75) so exact ties happen often."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return torch.randint(-2, 3, shape, generator=gen).float() * 0.75


@st.composite
def cases(draw, name: str):
    n_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.integers(1, 3))
    L = draw(st.integers(0, 12))
    T = draw(st.integers(0, 6))
    q_prompt = _tensor(draw, (L, n_kv_heads * group, head_dim))
    k_prompt = _tensor(draw, (L, n_kv_heads, head_dim))
    q_steps = _tensor(draw, (T, n_kv_heads * group, head_dim))
    k_steps = _tensor(draw, (T, n_kv_heads, head_dim))
    budget = draw(st.one_of(st.integers(1, 14), st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0])))
    evict_every = draw(st.integers(1, 3))
    params = {}
    if name in ("h2o", "keyformer", "a2sf", "scissorhands"):
        params["recent"] = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0]))
    if name == "streaming":
        params["sinks"] = draw(st.integers(0, 3))
    if name == "snapkv":
        params.update(window=draw(st.integers(1, 5)), kernel=draw(st.sampled_from([1, 3, 5])),
                      pooling=draw(st.sampled_from(["max", "avg"])),
                      chunk=draw(st.sampled_from([1, 1, 2, 3])), per_head=draw(st.booleans()),
                      align=draw(st.sampled_from(["grid", "scores"])))
    if name == "chunkkv":
        params.update(window=draw(st.integers(1, 5)), chunk=draw(st.sampled_from([1, 2, 3, 4])),
                      per_head=draw(st.booleans()), align=draw(st.sampled_from(["grid", "scores"])))
    if name == "a2sf":
        params["decay"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
    if name == "tova":
        params.update(per_head=draw(st.booleans()), decode=draw(st.booleans()))
    if name == "knorm":
        params["decode"] = draw(st.booleans())
    seed = draw(st.integers(0, 3))
    return q_prompt, k_prompt, q_steps, k_steps, budget, evict_every, params, seed


@pytest.mark.parametrize("name", SIMULATED)
def test_every_eviction_policy_has_a_reference(name):
    assert name in DEFAULTS
    # The paper defaults written in the reference are the policy's defaults.
    assert dataclass_defaults(get_policy(name)) == DEFAULTS[name]


def dataclass_defaults(cls) -> dict:
    import dataclasses
    return {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("name", SIMULATED)
def test_description_matches_reference(name):
    @given(cases(name))
    def check(case):
        q_prompt, k_prompt, q_steps, k_steps, budget, evict_every, params, seed = case
        composed = compose(name, budget=budget, evict_every=evict_every, seed=seed, **{name: params})
        L, T = q_prompt.shape[0], q_steps.shape[0]
        b = int(composed.budget_tokens(torch.tensor([L]))[0])
        scale = q_prompt.shape[-1] ** -0.5
        prefill_noise = default_prefill_noise(seed, q_prompt.shape[1], L)
        decode_noise = default_decode_noise(seed, q_prompt.shape[1])
        noise = dict(prefill_noise=prefill_noise, decode_noise=decode_noise)
        ref = simulate(name, params, q_prompt, k_prompt, q_steps, k_steps, budget, seed,
                       evict_every=evict_every, scale=scale, **noise)
        got = run_description(composed.eviction, q_prompt, k_prompt, q_steps, k_steps, b,
                              evict_every=evict_every, scale=scale, max_new_tokens=max(T, 1), **noise)
        assert len(ref) == len(got) == T + 1
        for t, (r, g) in enumerate(zip(ref, got)):
            assert torch.equal(r.kept, g), f"after step {t - 1}: reference {r.kept.tolist()} != {g.tolist()}"
        # Invariants: counts follow from lengths alone, forced slots survive, order is kept.
        policy = composed.eviction
        n_sink, n_recent = (int(x[0]) for x in policy.forced(torch.tensor([b])))
        for t, r in enumerate(ref):
            assert (r.kept[:, 1:] > r.kept[:, :-1]).all(), "kept tokens stay in original order"
            since = t % evict_every if policy.decode_evict else t   # steps since the last compaction
            at_last = L + t - since                                  # tokens seen at that compaction
            compacted = policy.prefill_compress if t == since else True
            n = min(b, at_last) + since if compacted else L + t
            assert r.kept.shape[1] == n
            if policy.decode_evict:
                assert n <= b + evict_every - 1
            if compacted and at_last > b:   # something was evicted: the forced slots survived it
                must = set(range(n_sink)) | set(range(at_last - n_recent, L + t))
                for h in range(r.kept.shape[0]):
                    assert must <= set(r.kept[h].tolist())

    check()


def test_streaming_keeps_sinks_and_recent():
    q = torch.randn(20, 2, 4)
    k = torch.randn(20, 1, 4)
    steps = simulate("streaming", {"sinks": 2}, q, k, torch.randn(3, 2, 4), torch.randn(3, 1, 4), budget=6)
    assert steps[0].kept.tolist() == [[0, 1, 16, 17, 18, 19]]
    assert steps[3].kept.tolist() == [[0, 1, 19, 20, 21, 22]]
    assert simulate("window", None, q, k, q[:0], k[:0], budget=0.25)[0].kept.tolist() == [list(range(15, 20))]


def test_h2o_keeps_heavy_hitters():
    # Every query looks at token 3 only (once it exists), so token 3 is the heavy hitter; token 0 also
    # collects all the attention of rows 0-2 (1 + 1/2 + 1/3), more than any later token.
    L, D = 12, 4
    k = torch.zeros(L, 1, D)
    k[3, 0, 0] = 10.0
    q = torch.zeros(L, 1, D)
    q[:, 0, 0] = 1.0
    steps = simulate("h2o", {"recent": 0.5}, q, k, q[:0], k[:0], budget=4)
    assert steps[0].kept.tolist() == [[0, 3, 10, 11]]   # 2 heavy hitters + 2 recent


def test_snapkv_pools_only_the_prefix():
    policy = get_policy("snapkv")(window=2, kernel=3)
    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 9.0, 1.0]])
    out = policy.postprocess_prefill_scores(scores)
    # Max pooling with kernel 3 over the first 4 entries; the window (last 2) is untouched.
    assert out.tolist() == [[5.0, 5.0, 5.0, 0.0, 9.0, 1.0]]


def test_chunkkv_scores_chunks_of_the_prefix():
    policy = get_policy("chunkkv")(window=2, chunk=3)
    scores = torch.tensor([[1.0, 0.0, 2.0, 4.0, 0.5, 0.0, 1.0, 7.0, 8.0]])
    out = policy.postprocess_prefill_scores(scores)
    # Prefix of 7 tokens in chunks [0, 3), [3, 6), [6, 7); the window (last 2) is untouched.
    assert out.tolist() == [[3.0, 3.0, 3.0, 4.5, 4.5, 4.5, 1.0, 7.0, 8.0]]
    assert get_policy("snapkv")(window=2, kernel=1, chunk=3).postprocess_prefill_scores(scores).tolist() == \
        out.tolist()  # snapkv's chunk option: the same chunk totals (kernel 1 = no pooling)


def test_placed_chunks_keep_whole_the_span_a_grid_cuts():
    # The votes peak on tokens 2-4 (a 3-token number, say); a grid of 3 from the first token cuts it at 3.
    scores = torch.tensor([[0.0, 0.1, 3.0, 4.0, 3.0, 0.1, 0.0, 0.2, 0.0, 9.0, 9.0]])  # window: the last 2
    grid = get_policy("chunkkv")(window=2, chunk=3).postprocess_prefill_scores(scores)
    placed = get_policy("chunkkv")(window=2, chunk=3, align="scores").postprocess_prefill_scores(scores)
    assert grid[0, :9].tolist() == pytest.approx([3.1] * 3 + [7.1] * 3 + [0.2] * 3)
    # The best span [2, 5) first; then [5, 8); [0, 2) and [8, 9) are runs shorter than a chunk, scored by
    # their total scaled to a chunk's length (0.1 * 3 / 2).
    assert placed[0, :9].tolist() == pytest.approx([0.15, 0.15, 10.0, 10.0, 10.0, 0.3, 0.3, 0.3, 0.0])
    assert placed[0, 9:].tolist() == [9.0, 9.0]  # the window is untouched
    keep = lambda sc: sorted(sc[0, :9].topk(3).indices.tolist())
    assert keep(grid) == [3, 4, 5] and keep(placed) == [2, 3, 4]


@given(n=st.integers(0, 30), chunk=st.integers(1, 6), rows=st.integers(1, 3), seed=st.integers(0, 2**16),
       coarse=st.booleans())
def test_placed_chunk_sums_equal_the_reference(n, chunk, rows, seed, coarse):
    """Against the plain greedy placement, per row, bit for bit (values on a coarse grid tie often)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, (rows, n), generator=g).float() if coarse else torch.rand(rows, n, generator=g)
    got = placed_chunk_sums(x, chunk)
    want = torch.stack([placed_chunks(x[h], chunk) for h in range(rows)]) if chunk > 1 else x
    assert torch.equal(got, want)


@given(L=st.integers(1, 40), chunk=st.integers(1, 6), window=st.integers(1, 6), budget=st.integers(1, 40),
       seed=st.integers(0, 99))
def test_chunkkv_keeps_whole_chunks(L, chunk, window, budget, seed):
    """Kept prefix tokens form whole chunks, except one chunk cut short, which keeps its earliest tokens."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, 2, 4, generator=g), torch.randn(L, 1, 4, generator=g)
    kept = simulate("chunkkv", {"window": window, "chunk": chunk}, q, k, q[:0], k[:0], budget)[0].kept[0]
    n_prefix = L - min(window, L)
    prefix = [int(t) for t in kept if t < n_prefix]
    by_chunk: dict[int, list[int]] = {}
    for t in prefix:
        by_chunk.setdefault(t // chunk, []).append(t)
    partial = 0
    for c, toks in by_chunk.items():
        full = list(range(c * chunk, min((c + 1) * chunk, n_prefix)))
        if toks != full:
            partial += 1
            assert toks == full[: len(toks)], (c, toks)
    assert partial <= 1


def test_chunkkv_index_reuse_shares_one_ranking_per_group_of_layers():
    """reuse=2 in the paged cache: layers 0 and 1 keep the same tokens (the same budget), layer 2 its own."""
    from kvmodels.cache import PagedKVCache

    g = torch.Generator().manual_seed(3)
    L, n_layers = 24, 3
    policy = compose("chunkkv", budget=0.5, chunkkv={"window": 2, "chunk": 3, "reuse": 2})
    cache = PagedKVCache(n_layers=n_layers, n_kv_heads=1, head_dim=4, n_q_heads=2, max_batch=1, max_tokens=L,
                         page_size=4, policy=policy)
    cache.start([L], 0)
    for l in range(n_layers):
        q, k = torch.randn(L, 2, 4, generator=g), torch.randn(L, 1, 4, generator=g)
        cache.prefill_layer(l, 0, q, k, k.clone(), torch.arange(L), scale=0.5)
    cache.finish_prefill()
    kept = [cache.layer_contents(l, 0)["pos"][:, 0].tolist() for l in range(n_layers)]
    assert kept[0] == kept[1] and len(kept[0]) == 12
    assert kept[2] != kept[0]  # scored by its own queries (these random layers rank differently)


def test_keyformer_is_reproducible_with_a_seed():
    torch.manual_seed(0)
    q, k = torch.randn(16, 4, 8), torch.randn(16, 2, 8)
    qs, ks = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    run = lambda seed: [s.kept for s in simulate("keyformer", None, q, k, qs, ks, 6, seed)]
    assert all(torch.equal(a, b) for a, b in zip(run(7), run(7)))
    scores = lambda seed: simulate("keyformer", None, q, k, qs, ks, 6, seed)[0].scores
    assert not torch.equal(scores(1), scores(2)), "the seed must reach the noise"


def test_keyformer_large_temperature_gives_uniform_scores():
    # As tau grows, softmax((x + G) / tau) -> uniform, so prompt token j scores sum_{i >= j} 1 / (i + 1).
    torch.manual_seed(1)
    L = 10
    q, k = torch.randn(L, 2, 4) * 3, torch.randn(L, 1, 4) * 3
    steps = simulate("keyformer", {"tau_init": 1e7, "tau_end": 1e7}, q, k, q[:0], k[:0], budget=1.0)
    expected = torch.tensor([sum(1.0 / (i + 1) for i in range(j, L)) for j in range(L)], dtype=torch.float64)
    torch.testing.assert_close(steps[0].scores[0], expected, rtol=1e-5, atol=1e-6)
    # ... while tau = 1 does not.
    steps = simulate("keyformer", None, q, k, q[:0], k[:0], budget=1.0)
    assert not torch.allclose(steps[0].scores[0], expected, rtol=1e-2)


def test_keyformer_temperature_schedule():
    policy = get_policy("keyformer")(tau_init=1.0, tau_end=3.0)
    assert policy.prefill_kwargs(10) == {"temperature": 1.0}
    taus = [policy.decode_kwargs(t, 4)["temperature"] for t in range(4)]
    assert taus == [1.5, 2.0, 2.5, 3.0]
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy.decode_kwargs(0, 0)


def test_prefill_scores_kernel_matches_description_when_available():
    """If the prompt scorer exists, it gives the scores the description assumes (non-random modes)."""
    try:
        from kvkernels import prefill_scores
    except (ImportError, AttributeError):
        pytest.skip("kvkernels.prefill_scores is not written yet")
    torch.manual_seed(2)
    L, group = 9, 2
    q, k = torch.randn(L, 2 * group, 4), torch.randn(L, 2, 4)
    for name in ("h2o", "keyformer", "a2sf", "snapkv", "scissorhands", "tova"):
        params = {"window": 3} if name == "snapkv" else {"tau_init": 1.5} if name == "keyformer" else {}
        policy = get_policy(name)(**params)
        got = prefill_scores(q, k, scale=0.5, mode=policy.prefill_mode, window=policy.prefill_window(L),
                             seed=3, **policy.prefill_kwargs(L))
        # Keyformer: the reference's default prompt noise is the kernels' counter hash (same seed).
        ref = simulate(name, params, q, k, q[:0], k[:0], budget=1.0, seed=3, scale=0.5)[0].scores
        # The reference pools SnapKV's scores; pool the kernel's the same way before comparing.
        torch.testing.assert_close(policy.postprocess_prefill_scores(got).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", EVICTION)
def test_forced_fits_the_budget(name):
    policy = get_policy(name)()
    budgets = torch.arange(policy.min_budget(), 40, dtype=torch.int32)
    n_sink, n_recent = policy.forced(budgets)
    assert n_sink.dtype == n_recent.dtype == torch.int32
    assert (n_sink >= 0).all() and (n_recent >= 0).all() and (n_sink + n_recent <= budgets).all()


@pytest.mark.parametrize("name", ["h2o", "snapkv", "keyformer", "tova", "chunkkv", "a2sf"])
def test_prompt_scores_is_the_kernel_run_with_the_policy_settings(name):
    """Every cache scores a prompt through ``EvictionPolicy.prompt_scores``: the kernel with the policy's
    mode, window and keywords (which may override the caller's seed), then its post-processing."""
    from kvkernels import prefill_scores

    ev = compose(name, budget=0.5).eviction
    g = torch.Generator().manual_seed(3)
    L, Hq, Hkv, D = 23, 4, 2, 16
    q, k = torch.randn(L, Hq, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    kwargs = {"seed": 7, **ev.prefill_kwargs(L)}
    raw = prefill_scores(q, k, scale=0.25, mode=ev.prefill_mode, window=ev.prefill_window(L), **kwargs)
    assert torch.equal(ev.prompt_scores(q, k, scale=0.25, seed=7), ev.postprocess_prefill_scores(raw))
    if name == "keyformer":  # its noise follows the seed: another seed, other scores
        assert not torch.equal(ev.prompt_scores(q, k, scale=0.25, seed=8), ev.prompt_scores(q, k, scale=0.25,
                                                                                           seed=7))


def test_prompt_scores_of_a_policy_that_scores_no_prompt_is_refused_by_name():
    with pytest.raises(ValueError, match="'streaming' scores no prompt"):
        compose("streaming", budget=0.5).eviction.prompt_scores(torch.zeros(3, 2, 8), torch.zeros(3, 1, 8),
                                                                scale=1.0)
