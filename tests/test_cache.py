"""PagedKVCache with a fake model: the full cache equals dense attention, invariants hold, bad input fails.

The fake "model" draws random q/k/v per layer and step (``FakeRun``); the oracle is dense attention over
every token the sequence has seen, written for clarity. Helpers here are shared by the other cache tests.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

from devices import DEVICE, assert_within
from kvmodels.cache import CacheReport, PagedKVCache
from kvpolicies import compose


class FakeRun:
    """Random prompt and decode q/k/v for every cache layer, recorded so a test can replay them.

    prompt[l][b] = (q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, D]); steps[t][l] = (q, k, v) with batch dim B.
    Token positions are 0..L-1 for the prompt and L + t for decode step t.
    """

    def __init__(self, n_layers, n_kv_heads, group, head_dim, prompt_lens, n_steps, seed, alibi=False,
                 dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        hq = n_kv_heads * group
        self.n_layers, self.n_kv_heads, self.n_q_heads, self.head_dim = n_layers, n_kv_heads, hq, head_dim
        self.prompt_lens, self.n_steps, self.dtype = list(prompt_lens), n_steps, dtype
        self.scale = head_dim ** -0.5

        def rand(*shape):  # drawn on the CPU (the same data on every device), used on the suite's device
            return torch.randn(*shape, generator=g).to(DEVICE, dtype)

        self.prompt = [[(rand(L, hq, head_dim), rand(L, n_kv_heads, head_dim), rand(L, n_kv_heads, head_dim))
                        for L in prompt_lens] for _ in range(n_layers)]
        B = len(prompt_lens)
        self.steps = [[(rand(B, hq, head_dim), rand(B, n_kv_heads, head_dim), rand(B, n_kv_heads, head_dim))
                       for _ in range(n_layers)] for _ in range(n_steps)]
        self.alibi = (torch.rand(hq, generator=g) * 0.5).to(DEVICE) if alibi else None

    def cache(self, policy=None, *, page_size=4, max_new=None, num_pages=None, seed=0, **kw) -> PagedKVCache:
        max_new = self.n_steps if max_new is None else max_new
        return PagedKVCache(n_layers=self.n_layers, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                            n_q_heads=self.n_q_heads, max_batch=kw.pop("max_batch", len(self.prompt_lens)),
                            max_tokens=max(self.prompt_lens) + max_new, page_size=page_size,
                            num_pages=num_pages, dtype=self.dtype, device=kw.pop("device", DEVICE),
                            policy=policy if policy is not None else compose("full"), seed=seed, **kw)

    def positions(self, b: int) -> torch.Tensor:
        return torch.arange(self.prompt_lens[b], dtype=torch.int32, device=DEVICE)

    def step_positions(self, t: int) -> torch.Tensor:
        return torch.tensor([L + t for L in self.prompt_lens], dtype=torch.int32, device=DEVICE)

    def prefill(self, cache: PagedKVCache, cos_sim=None) -> None:
        cache.start(self.prompt_lens, self.n_steps)
        for b in range(len(self.prompt_lens)):
            for l in range(self.n_layers):
                q, k, v = self.prompt[l][b]
                cache.prefill_layer(l, b, q, k, v, self.positions(b), scale=self.scale,
                                    alibi_slopes=self.alibi)
                if cos_sim is not None:
                    cache.record_cos_sim(l, b, float(cos_sim[l][b]))
        cache.finish_prefill()

    def decode_step(self, cache: PagedKVCache, t: int, pos: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One eager decode step over all layers (``pos``: the tokens' positions, default
        :meth:`step_positions`); returns the attention outputs per layer."""
        cache.prepare_decode(t)
        pos = self.step_positions(t) if pos is None else pos
        outs = []
        for l in range(self.n_layers):
            q, k, v = self.steps[t][l]
            cache.append(l, k, v, pos)
            outs.append(cache.attend(l, q, pos, scale=self.scale, alibi_slopes=self.alibi))
        cache.after_step(t)
        return outs

    def seen(self, l: int, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All K and V ``[n, Hkv, D]`` sequence ``b`` gave layer ``l`` up to and including step ``t``."""
        k = [self.prompt[l][b][1]] + [self.steps[s][l][1][b:b + 1] for s in range(t + 1)]
        v = [self.prompt[l][b][2]] + [self.steps[s][l][2][b:b + 1] for s in range(t + 1)]
        return torch.cat(k), torch.cat(v)


def dense_attention(q, k, v, scale, alibi=None, q_pos=0, dtype=torch.float32):
    """Naive GQA attention of one query ``[Hq, D]`` over ``k, v`` ``[n, Hkv, D]`` (positions 0..n-1),
    computed in ``dtype``."""
    group = q.shape[0] // k.shape[1]
    kq = k.to(dtype).repeat_interleave(group, dim=1)  # [n, Hq, D]
    vq = v.to(dtype).repeat_interleave(group, dim=1)
    x = scale * torch.einsum("hd,nhd->hn", q.to(dtype), kq)  # [Hq, n]
    if alibi is not None:
        rel = (torch.arange(k.shape[0], device=k.device) - q_pos).to(dtype)  # [n]
        x = x + alibi[:, None].to(dtype) * rel[None, :]
    return torch.einsum("hn,nhd->hd", torch.softmax(x, dim=-1), vq)


def check_invariants(cache: PagedKVCache, *, evict_bound: bool = True) -> None:
    """Host mirror = device state; every page owned once; reported bytes = pages held; budget bounds."""
    S, n = cache.page_size, cache.batch_size
    lens = cache.seq_lens.cpu().numpy()
    assert (lens == cache.host.lens).all(), (lens, cache.host.lens)
    assert int(cache.n_free) == cache.pool.free
    owners = []
    for l in range(cache.n_layers):
        for b in range(cache.max_batch):
            used = math.ceil(int(lens[l, b]) / S)
            row = cache.page_table[l, b].tolist()
            owners += row[:used]
            assert all(p == -1 for p in row[used:]), f"layer {l} seq {b}: stale entries past the used pages"
    free = cache.free_pages[:int(cache.n_free)].tolist()
    everything = sorted(owners + free)
    assert everything == list(range(cache.num_pages)), "a page is double-owned or lost"
    rep = cache.report()
    held = [sum(math.ceil(int(x) / S) for x in lens[l]) for l in range(cache.n_layers)]
    assert rep.bytes_per_layer == tuple(h * rep.page_bytes for h in held)
    assert rep.total_bytes == sum(rep.bytes_per_layer) <= rep.peak_bytes
    assert rep.tokens_per_layer == tuple(tuple(int(x) for x in row[:n]) for row in lens)
    if cache.plan is not None:
        budgets = np.array(rep.layer_budgets)
        totals = budgets.sum(axis=0)
        # Conserved, up to what a layer can ever hold (prompt + new tokens; ComposedPolicy.layer_budgets).
        capacity = np.array(cache.prompt_lens) + cache.max_new_tokens
        want = np.minimum(cache.n_layers * cache.budget_tokens.numpy(), cache.n_layers * capacity)
        assert (totals == want).all(), "layer budgets lost tokens"
        if evict_bound and cache.eviction.decode_evict and cache._state == "decode":
            # A merged pair's region (listed under its first layer) takes 2 slots per step.
            width = np.ones(cache.n_layers, dtype=np.int64)
            for a, b in cache.merged_pairs:
                width[a], width[b] = 2, 0
            bound = budgets + (cache.policy.evict_every - 1) * width[:, None]
            assert (lens[:, :n] <= bound).all(), (lens, bound)


# ----------------------------------------------------------------------------------------------------- (a)
@st.composite
def shapes(draw, max_layers=3, max_len=12):
    n_layers = draw(st.integers(1, max_layers))
    n_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8]))
    prompt_lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=3))
    n_steps = draw(st.integers(0, 7))
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    seed = draw(st.integers(0, 2**16))
    return n_layers, n_kv, group, head_dim, prompt_lens, n_steps, page_size, seed


@given(shapes(), st.booleans(), st.data())
def test_full_cache_equals_dense_attention(shape, alibi, data):
    n_layers, n_kv, group, head_dim, prompt_lens, n_steps, page_size, seed = shape
    run = FakeRun(n_layers, n_kv, group, head_dim, prompt_lens, n_steps, seed, alibi=alibi)
    cache = run.cache(page_size=page_size)
    B = len(prompt_lens)
    # Each sequence stops after a drawn number of steps (finish_sequence between steps).
    stop = [data.draw(st.integers(0, n_steps), label=f"stop[{b}]") for b in range(B)]
    run.prefill(cache)
    check_invariants(cache)
    for l in range(n_layers):
        for b in range(B):
            got = cache.layer_contents(l, b)
            torch.testing.assert_close(got["k"], run.prompt[l][b][1], rtol=0, atol=0)
            assert (got["pos"].cpu() == torch.arange(prompt_lens[b])[:, None]).all()
    for t in range(n_steps):
        for b in range(B):
            if stop[b] == t:
                cache.finish_sequence(b)
        outs = run.decode_step(cache, t)
        check_invariants(cache)
        for l in range(n_layers):
            for b in range(B):
                if stop[b] <= t:
                    assert (outs[l][b] == 0).all(), "a finished sequence must give a zero row"
                    continue
                k, v = run.seen(l, b, t)
                args = (run.steps[t][l][0][b], k, v, run.scale, run.alibi, prompt_lens[b] + t)
                assert_within(outs[l][b], dense_attention(*args, dtype=torch.float64), dense_attention(*args),
                              torch.float32)
                got = cache.layer_contents(l, b)
                assert torch.equal(got["k"], k) and torch.equal(got["v"], v)
    for b in range(B):
        if stop[b] >= n_steps:
            cache.finish_sequence(b)
    check_invariants(cache)
    assert int(cache.n_free) == cache.num_pages and cache.report().total_bytes == 0


# ----------------------------------------------------------------------------------------------------- (c)
@given(shapes(max_len=20), st.sampled_from(["h2o", "streaming", "window", "keyformer", "tova"]),
       st.sampled_from(["uniform", "pyramid"]), st.integers(1, 3), st.data())
def test_invariants_under_eviction(shape, eviction, budget_policy, evict_every, data):
    n_layers, n_kv, group, head_dim, prompt_lens, n_steps, page_size, seed = shape
    budget = data.draw(st.sampled_from([0.3, 0.6, 1.0, 3]), label="budget")
    policy = compose(budget_policy, eviction, budget=budget, evict_every=evict_every)
    run = FakeRun(n_layers, n_kv, group, head_dim, prompt_lens, n_steps, seed)
    cache = run.cache(policy, page_size=page_size)
    run.prefill(cache)
    check_invariants(cache)
    rep = cache.report()
    assert rep.peak_bytes >= rep.total_bytes
    for t in range(n_steps):
        run.decode_step(cache, t)
        check_invariants(cache)
        if t == 1:
            cache.finish_sequence(0)
            check_invariants(cache)
    for b in range(len(prompt_lens)):
        if cache.host.active[b]:
            cache.finish_sequence(b)
    check_invariants(cache)
    assert int(cache.n_free) == cache.num_pages


def test_report_counts_pages_and_compression():
    run = FakeRun(2, 2, 2, 8, [40, 9], 3, seed=1)
    cache = run.cache(compose("window", budget=8), page_size=4)
    run.prefill(cache)
    rep = cache.report()
    assert isinstance(rep, CacheReport)
    page_bytes = 4 * 2 * (2 * 8 * 4 + 8)
    assert rep.page_bytes == page_bytes
    assert rep.tokens_per_layer == ((8, 8), (8, 8)) and rep.layer_budgets == ((8, 8), (8, 8))
    assert rep.bytes_per_layer == (4 * page_bytes, 4 * page_bytes)
    assert rep.peak_bytes == 2 * (10 + 3) * page_bytes  # the full prompts, before compression
    assert rep.full_cache_bytes == rep.peak_bytes
    run.decode_step(cache, 0)  # 9 tokens each: a third page per (layer, sequence), then evicted back to 8
    rep = cache.report()
    assert rep.tokens_per_layer == ((8, 8), (8, 8)) and rep.total_bytes == 8 * page_bytes
    assert rep.full_cache_bytes == 2 * (11 + 3) * page_bytes
    text = str(rep)
    assert "peak" in text and "full cache" in text and len(text.splitlines()) == 6


def test_default_num_pages_fits_full_batches_and_restart_reuses_buffers():
    run = FakeRun(2, 1, 1, 4, [5, 7], 2, seed=3)
    cache = run.cache(page_size=4)
    assert cache.num_pages == 2 * 2 * math.ceil(9 / 4)
    buffers = [cache.k_pages, cache.page_table, cache.seq_lens, cache.free_pages]
    for _ in range(2):  # a second start drops the old batch and reuses every buffer
        run.prefill(cache)
        for t in range(2):
            run.decode_step(cache, t)
        check_invariants(cache)
    after = [cache.k_pages, cache.page_table, cache.seq_lens, cache.free_pages]
    assert all(a is b for a, b in zip(buffers, after))


# ----------------------------------------------------------------------------------------------------- (e)
def test_out_of_pages_raises_before_writing():
    run = FakeRun(1, 1, 1, 4, [4, 4], 2, seed=0)
    with pytest.raises(RuntimeError, match="cache out of pages.*raise num_pages"):
        run.cache(page_size=4, num_pages=1).start([4, 4], 2)
    cache = run.cache(page_size=4, num_pages=2)
    run.prefill(cache)
    before = (cache.page_table.clone(), cache.free_pages.clone(), int(cache.n_free))
    with pytest.raises(RuntimeError, match="cache out of pages: decode step 0 needs 2 more pages but only 0"):
        cache.prepare_decode(0)
    assert torch.equal(before[0], cache.page_table) and torch.equal(before[1], cache.free_pages)
    assert before[2] == int(cache.n_free) == cache.pool.free == 0


def test_bad_arguments_name_the_argument():
    run = FakeRun(2, 2, 2, 4, [3, 5], 2, seed=0)
    with pytest.raises(TypeError, match="policy must be a kvpolicies.ComposedPolicy"):
        run.cache("h2o")
    with pytest.raises(ValueError, match="n_q_heads=3 must be a multiple of n_kv_heads=2"):
        PagedKVCache(1, 2, 4, 3, 1, 8)
    cache = run.cache(page_size=2)
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        cache.start([3, 6], 2)
    with pytest.raises(ValueError, match="3 sequences.*max_batch=2"):
        cache.start([1, 1, 1], 1)
    with pytest.raises(ValueError, match="prompt_lens must all be >= 1"):
        cache.start([0, 2], 1)
    with pytest.raises(RuntimeError, match="call start"):
        cache.prefill_layer(0, 0, *run.prompt[0][0], run.positions(0), scale=1.0)
    cache.start(run.prompt_lens, 2)
    q, k, v = run.prompt[0][0]
    with pytest.raises(ValueError, match="layer l=2 is out of range"):
        cache.prefill_layer(2, 0, q, k, v, run.positions(0), scale=1.0)
    with pytest.raises(ValueError, match=r"k must have shape \[3, 2, 4\]"):
        cache.prefill_layer(0, 0, q, k[:2], v, run.positions(0), scale=1.0)
    with pytest.raises(ValueError, match=r"q must have shape \[3, 4, 4\]"):
        cache.prefill_layer(0, 0, q[:, :2], k, v, run.positions(0), scale=1.0)
    with pytest.raises(TypeError, match="v has dtype float16"):
        cache.prefill_layer(0, 0, q, k, v.half(), run.positions(0), scale=1.0)
    with pytest.raises(TypeError, match="positions has dtype float32"):
        cache.prefill_layer(0, 0, q, k, v, run.positions(0).float(), scale=1.0)
    with pytest.raises(ValueError, match="sequence b=2 is out of range"):
        cache.prefill_layer(0, 2, q, k, v, run.positions(0), scale=1.0)
    with pytest.raises(RuntimeError, match="layer 0 of sequence 0 was not prefilled"):
        cache.finish_prefill()
    run.prefill(cache)
    with pytest.raises(ValueError, match="prepare_decode\\(step=1\\) but the next step is 0"):
        cache.prepare_decode(1)
    cache.prepare_decode(0)
    q, k, v = run.steps[0][0]
    pos = run.step_positions(0)
    with pytest.raises(ValueError, match=r"k must have shape \[2, 2, 4\]"):
        cache.append(0, k[:1], v, pos)
    with pytest.raises(TypeError, match="v has dtype float64"):
        cache.append(0, k, v.double(), pos)
    with pytest.raises(ValueError, match=r"positions must have shape \[2\]"):
        cache.append(0, k, v, pos[:1])
    with pytest.raises(ValueError, match=r"q must have shape \[2, 4, 4\]"):
        cache.attend(0, q[:, :2], pos, scale=1.0)
    with pytest.raises(ValueError, match="q is on meta"):
        cache.attend(0, q.to("meta"), pos, scale=1.0)
    with pytest.raises(TypeError, match="q_positions has dtype float32"):
        cache.attend(0, q, pos.float(), scale=1.0)
    with pytest.raises(RuntimeError, match="after_step\\(step=1\\) must follow"):
        cache.after_step(1)
    cache.after_step(0)
    cache.finish_sequence(1)
    with pytest.raises(ValueError, match="sequence 1 is already finished"):
        cache.finish_sequence(1)


def test_policy_constraints_are_checked_at_start():
    run = FakeRun(1, 1, 1, 4, [3], 1, seed=0)
    cache = run.cache(compose("streaming", budget=2), page_size=2)
    run.prefill(cache)  # a 3-token prompt: the budget and the sinks shrink with it
    check_invariants(cache)


def test_attend_without_score_update_reads_the_same_and_writes_nothing():
    run = FakeRun(1, 2, 2, 4, [6, 3], 1, seed=4)
    cache = run.cache(compose("h2o", budget=4), page_size=2)
    run.prefill(cache)
    cache.prepare_decode(0)
    q, k, v = run.steps[0][0]
    pos = run.step_positions(0)
    cache.append(0, k, v, pos)
    before = cache.slot_score.clone()
    read = cache.attend(0, q, pos, scale=run.scale, update_scores=False)
    assert torch.equal(cache.slot_score, before)
    scored = cache.attend(0, q, pos, scale=run.scale)
    assert torch.equal(read, scored)
    assert not torch.equal(cache.slot_score, before)  # the scoring call did write


def test_noise_keys_are_what_the_cache_draws():
    """Each decode step's Gumbel noise keys are ``decode_keys(noise_seed(policy seed, cache seed), step)``:
    fresh every step, the step counted from ``start``, one per (layer, row, query head); the cache holds no
    noise buffer (later turns continue the count: tests/test_decoder.py)."""
    from kvkernels import decode_keys, noise_seed

    run = FakeRun(2, 1, 2, 4, [5, 3], 2, seed=0)
    cache = run.cache(compose("keyformer", budget=4, seed=7), page_size=2, seed=3)
    assert cache._noise_seed == noise_seed(7, 3) != noise_seed(3, 7)
    assert not hasattr(cache, "gumbel_noise")  # no [layers, rows, Hq, slots] buffer
    run.prefill(cache)
    seen = []
    for step in range(2):
        cache.prepare_decode(step)
        assert cache.gumbel_keys.shape == (2, cache.max_batch, 2) and cache.gumbel_keys.dtype == torch.int32
        want = decode_keys(noise_seed(7, 3), step, 2, 2, 2)  # [layers, rows, query heads]
        assert torch.equal(cache.gumbel_keys[:, :2].cpu(), want)
        seen.append(want)
        pos = run.step_positions(step)
        for l in range(2):
            q, k, v = run.steps[step][l]
            cache.append(l, k, v, pos)
            cache.attend(l, q, pos, scale=run.scale)
        cache.after_step(step)
    assert not torch.equal(seen[0], seen[1])  # fresh keys every step
    assert len(set(torch.cat(seen).flatten().tolist())) == 16  # distinct per (step, layer, row, head)


def test_observe_stores_only_what_the_budget_policy_reads():
    """``observe`` (the models' one observation point) stores squeeze's residual cosine similarity, averaged
    over the prompt, and nothing for a policy that reads nothing."""
    from kvpolicies.base import residual_cos_sim

    gen = torch.Generator().manual_seed(3)
    h_in, attn_out = torch.randn(9, 8, generator=gen), torch.randn(9, 8, generator=gen)
    for name, reads in (("squeeze+h2o", True), ("pyramid+h2o", False), ("h2o", False)):
        cache = PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=8, n_q_heads=1, max_batch=2, max_tokens=16,
                             policy=compose(name, budget=0.5))
        cache.start([9, 9], 2)
        cache.observe(1, 0, h_in, attn_out)
        want = residual_cos_sim(h_in, attn_out).mean() if reads else torch.tensor(0.0)
        assert torch.equal(cache.cos_sim[1, 0].cpu(), want) and torch.equal(cache.cos_sim[0].cpu(),
                                                                              torch.zeros(2))
