"""The continuable generation state (``kvmodels.decoder.Decoder``) and chunked prefill.

(a) With the full policy nothing is evicted, so several turns of extend + generate equal greedy decoding of
    the concatenated tokens by a no-cache forward pass, and a chunked prefill equals the whole prompt's.
(b) With compressing policies, after each extend every layer holds at most its budget, every kept token's
    K/V is bit-identical to what the model computed for it at its position, and positions are right.
(c) A chunked prefill's peak pages follow budget + chunk, not the prompt's length.
(d) The extension's attention and scores against a naive per-row, per-head loop.
(e) Errors, each one line naming the argument.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels._modes import update_scores_ref
from kvkernels._noise import gumbel_noise_hash
from kvkernels.extend_attention import extend_attention, scored_rows
from kvmodels.decoder import Decoder, chunked_num_pages
from kvmodels.generate import generate
from kvmodels.llama import Llama
from kvpolicies import compose
from test_cache import check_invariants
from test_generate import V, greedy_oracle, tiny_llama
from test_model_policy_matrix import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tiny_llama()  # max_seq_len 96


def no_cache_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of a plain forward pass over ``tokens`` (no cache)."""
    with torch.no_grad():
        return model.prefill(torch.tensor(tokens, device=DEVICE), None, 0)[-1]


def tokens_strategy(min_size: int = 1, max_size: int = 12):
    return st.lists(st.integers(0, V - 1), min_size=min_size, max_size=max_size)


# ----------------------------------------------------------------------------------------------------- (a)
@given(prompts=st.lists(tokens_strategy(), min_size=1, max_size=3),
       follow=st.lists(tokens_strategy(0, 6), min_size=3, max_size=3), n1=st.integers(1, 5),
       n2=st.integers(1, 5), page_size=st.sampled_from([1, 3, 4, 16]))
def test_full_policy_turns_equal_one_shot_on_the_concatenation(prompts, follow, n1, n2, page_size):
    """Turn 2 continues turn 1's cache; it must decode what a no-cache pass over everything decodes."""
    B = len(prompts)
    dec = Decoder(MODEL, page_size=page_size)
    dec.extend(prompts)
    first = dec.generate(n1)
    logits = dec.extend(follow[:B])
    second = dec.generate(n2)
    for b in range(B):
        assert first.tokens[b] == greedy_oracle(MODEL, prompts[b], n1)
        context = prompts[b] + first.tokens[b] + follow[b]
        assert second.tokens[b] == greedy_oracle(MODEL, context, n2)
        torch.testing.assert_close(logits[b], no_cache_logits(MODEL, context), rtol=1e-4, atol=1e-4)
    assert dec.lengths == [len(p) + n1 + len(f) + n2 - 1 for p, f in zip(prompts, follow, strict=False)]


def test_generate_after_generate_feeds_the_last_token_first():
    dec = Decoder(MODEL)
    dec.extend([[3, 1, 4, 1, 5]])
    a = dec.generate(4).tokens[0]
    b = dec.generate(3).tokens[0]
    assert a + b == greedy_oracle(MODEL, [3, 1, 4, 1, 5], 7)
    assert dec.pending == [b[-1]] and dec.lengths == [5 + 6]


def test_decode_steps_by_hand_are_generate_and_an_extension_ends_them():
    """``start_decode`` / ``begin_step`` / ``end_step`` (what ``kvmodels.hf.PagedCache`` drives) give
    ``generate``'s greedy tokens; an ``extend`` ends the generation (its positions are stale after it)."""
    prompt = [3, 1, 4, 1, 5]
    dec = Decoder(MODEL)
    tokens = [int(dec.extend([prompt])[0].argmax())]
    dec.start_decode(4)
    assert dec.decoding and dec.step == 0
    for _ in range(3):
        positions = dec.begin_step()
        assert positions.tolist() == dec.lengths
        logits = MODEL.decode_step(torch.tensor(tokens[-1:], device=DEVICE), positions, dec.cache)
        dec.end_step([0])
        tokens.append(int(logits[0].argmax()))
    assert tokens == greedy_oracle(MODEL, prompt, 4) and dec.step == 3 and dec.lengths == [5 + 3]
    dec.extend([[2]])
    assert not dec.decoding
    with pytest.raises(RuntimeError, match="begin_step\\(\\) before start_decode"):
        dec.begin_step()


@given(prompts=st.lists(tokens_strategy(1, 30), min_size=1, max_size=3), n_new=st.integers(1, 4),
       chunk=st.sampled_from([1, 2, 3, 4, 5, 16]), page_size=st.sampled_from([1, 3, 4]))
def test_full_policy_chunked_prefill_equals_unchunked(prompts, n_new, chunk, page_size):
    """Ragged lengths incl. 1, chunks incl. 1 and ones that end on and across page boundaries."""
    chunked = generate(MODEL, prompts, n_new, chunk=chunk, page_size=page_size)
    whole = generate(MODEL, prompts, n_new, page_size=page_size)
    assert chunked.tokens == whole.tokens == [greedy_oracle(MODEL, p, n_new) for p in prompts]
    assert chunked.prefill_tokens == whole.prefill_tokens == sum(map(len, prompts))
    dec = Decoder(MODEL, page_size=page_size)
    logits = dec.extend(prompts, chunk=chunk)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b], no_cache_logits(MODEL, p), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gptj", "mpt"])
def test_other_models_continue_too(family):
    model = tiny_model(family)
    dec = Decoder(model)
    dec.extend([[5, 3, 8, 1, 9], [2, 2]], chunk=2)
    first = dec.generate(3)
    dec.extend([[7, 7, 1], []])
    second = dec.generate(3)
    for b, (prompt, more) in enumerate([([5, 3, 8, 1, 9], [7, 7, 1]), ([2, 2], [])]):
        assert first.tokens[b] == greedy_oracle(model, prompt, 3)
        assert second.tokens[b] == greedy_oracle(model, prompt + first.tokens[b] + more, 3)


# ----------------------------------------------------------------------------------------------------- (b)
class Recorder:
    """Wraps the cache a Decoder builds to record the K/V the model hands it for every (layer, sequence,
    position), and checks that each extension's positions continue its sequence."""

    def __init__(self, dec: Decoder) -> None:
        self.dec, self.kv = dec, {}
        build = dec._build_cache

        def build_and_wrap(batch: int) -> None:
            build(batch)
            self.wrap(dec.cache)

        dec._build_cache = build_and_wrap

    def wrap(self, cache) -> None:
        dec = self.dec
        prefill_attend, extend_attend, append = cache.prefill_attend, cache.extend_attend, cache.append

        def on_prefill(l, b, q, k, v, positions, **kw):
            self.store(l, b, k, v, positions)
            return prefill_attend(l, b, q, k, v, positions, **kw)

        def on_extend(l, b, q, k, v, positions, **kw):
            start = dec.lengths[b]
            assert positions.tolist() == list(range(start, start + len(positions)))
            self.store(l, b, k, v, positions)
            return extend_attend(l, b, q, k, v, positions, **kw)

        def on_append(l, k, v, positions, q=None):
            for b in range(len(positions)):
                if cache.host.active[b]:
                    self.store(l, b, k[b:b + 1], v[b:b + 1], positions[b:b + 1])
            return append(l, k, v, positions, q=q)

        cache.prefill_attend, cache.extend_attend, cache.append = on_prefill, on_extend, on_append

    def store(self, l, b, k, v, positions) -> None:
        for i, p in enumerate(positions.tolist()):
            self.kv[l, b, p] = (k[i].clone(), v[i].clone())

    def check(self, slack: int = 0) -> None:
        """Every layer within its budget (+ ``slack``); kept K/V bit-identical to the model's; positions
        distinct, seen, and including the forced recent window."""
        cache, dec = self.dec.cache, self.dec
        check_invariants(cache, evict_bound=False)
        rep = cache.report()
        for b in range(dec.batch_size):
            for l in range(cache.n_layers):
                held = rep.tokens_per_layer[l][b]
                assert held <= rep.layer_budgets[l][b] + slack, (l, b, held, rep.layer_budgets[l][b])
                kept = cache.layer_contents(l, b)
                pos = kept["pos"]  # [n, Hkv], position order per head
                assert int(pos.max()) < dec.lengths[b]
                assert (pos[1:] > pos[:-1]).all(), "a position is kept twice"
                for h in range(cache.n_kv_heads):
                    for i, p in enumerate(pos[:, h].tolist()):
                        k, v = self.kv[l, b, p]
                        assert torch.equal(kept["k"][i, h], k[h]) and torch.equal(kept["v"][i, h], v[h])
                n_recent = int(cache.plan.rows.n_recent[l, b])
                if held == rep.layer_budgets[l][b] and n_recent:  # just compressed: the newest are kept
                    newest = list(range(dec.lengths[b] - n_recent, dec.lengths[b]))
                    for h in range(cache.n_kv_heads):
                        assert pos[-n_recent:, h].tolist() == newest


COMPRESSING = ["h2o", "snapkv(window=4)", "streaming", "tova", "a2sf", "keyformer", "scissorhands", "knorm",
               "pyramid+h2o", "squeeze+h2o", "snapkv(window=4, chunk=3, per_head=False, align='scores')"]


@given(prompts=st.lists(tokens_strategy(1, 40), min_size=1, max_size=2),
       follow=st.lists(tokens_strategy(0, 9), min_size=2, max_size=2), chunk=st.sampled_from([None, 4, 5, 8]),
       spec=st.sampled_from(COMPRESSING), budget=st.sampled_from([0.3, 6, 9]),
       page_size=st.sampled_from([1, 4]))
def test_compressing_policies_hold_their_budget_and_the_model_kv(prompts, follow, chunk, spec, budget,
                                                                  page_size):
    policy = compose(spec, budget=budget)
    dec = Decoder(MODEL, policy, page_size=page_size, max_tokens=64)
    rec = Recorder(dec)
    B = len(prompts)
    for more, n_new in ((prompts, 3), (follow[:B], 4), ([[9]] * B, 2)):
        dec.extend(more, chunk=chunk)
        rec.check()
        dec.generate(n_new)
        # decode-time eviction holds the budget; snapkv and the others that only compress prompts grow by the
        # tokens fed since
        rec.check(slack=0 if policy.eviction.decode_evict else n_new - 1)


def test_keyformer_draws_fresh_noise_keys_on_every_turn():
    """A follow-up turn continues the decode steps' noise keys from the first turn's (a restarted decode does
    not repeat a turn's noise), and every step's keys are ``decode_keys`` of the steps counted so far."""
    from kvkernels import decode_keys

    dec = Decoder(MODEL, compose("keyformer", budget=6), page_size=4)
    seen, counts = [], []
    for turn in ([5, 3, 8, 1, 9, 2, 7, 11], [4, 6]):
        dec.extend([turn])
        dec.generate(3)  # the first token from the turn's forward, then decode steps
        seen.append(dec.cache.gumbel_keys[:, :1].cpu().clone())  # the turn's last step's keys
        counts.append(dec.cache._noise_step)
    assert counts[0] > 0 and counts[1] == 2 * counts[0]  # the second turn's steps continue the count
    cache = dec.cache
    n_layers, _, n_heads = cache.gumbel_keys.shape
    for count, keys in zip(counts, seen, strict=True):
        assert torch.equal(keys, decode_keys(cache._noise_seed, count - 1, n_layers, 1, n_heads))


@pytest.mark.parametrize("spec", ["h2o", "a2sf"])
def test_scores_of_an_extension_continue_as_decode_steps_would(spec):
    """Nothing evicted (a budget above everything): the scores after decoding tokens one step at a time
    equal the scores after extending with the same tokens, for rules that score every query row."""
    prompt = [5, 3, 8, 1, 9, 2, 7, 11, 4]
    policy = compose(spec, budget=60)
    decoded = Decoder(MODEL, policy, page_size=4)
    decoded.extend([prompt])
    tokens = decoded.generate(6).tokens[0]
    extended = Decoder(MODEL, policy, page_size=4)
    extended.extend([prompt])
    extended.extend([tokens[:-1]])
    for l in range(MODEL.n_cache_layers):
        a, b = decoded.cache.layer_contents(l, 0), extended.cache.layer_contents(l, 0)
        assert torch.equal(a["pos"], b["pos"])
        torch.testing.assert_close(a["score"], b["score"], rtol=1e-5, atol=1e-6)


def test_chunked_budgets_are_the_whole_prompts():
    """A fraction budget is a fraction of the whole prompt, however it is chunked."""
    prompt = list(range(40))
    for chunk in (None, 7):
        dec = Decoder(MODEL, compose("h2o", budget=0.25), page_size=4)
        dec.extend([prompt], chunk=chunk)
        assert dec.cache.report().tokens_per_layer == ((10,), (10,))
    dec.extend([[1, 2, 3, 4]])  # 44 seen: ceil(0.25 * 44) = 11
    assert dec.cache.report().tokens_per_layer == ((11,), (11,))


# ----------------------------------------------------------------------------------------------------- (c)
def pages(n_tokens: int, page_size: int) -> int:
    return math.ceil(n_tokens / page_size)


@given(length=st.integers(40, 90), chunk=st.sampled_from([1, 3, 4, 8, 13]),
       budget=st.sampled_from([6, 8, 0.1]), page_size=st.sampled_from([1, 4, 5]))
def test_chunked_peak_follows_budget_plus_chunk(length, chunk, budget, page_size):
    policy = compose("h2o", budget=budget)
    prompt = [(7 * i) % V for i in range(length)]
    Lc = MODEL.n_cache_layers
    budget_tokens = int(policy.budget_tokens(torch.tensor([length]))[0])
    chunked = generate(MODEL, [prompt], 3, policy, chunk=chunk, page_size=page_size).report
    whole = generate(MODEL, [prompt], 3, policy, page_size=page_size).report
    assert chunked.peak_bytes <= Lc * pages(budget_tokens + chunk, page_size) * chunked.page_bytes
    assert whole.peak_bytes == Lc * pages(length, page_size) * whole.page_bytes
    assert chunked.tokens_per_layer == whole.tokens_per_layer == ((budget_tokens,),) * Lc


def test_a_chunk_past_the_prompt_length_minus_the_budget_is_not_refused():
    """generate sizes max_tokens to the prompt plus the new tokens; a layer never holds more than the tokens
    it has seen, so budget + chunk above max_tokens is no reason to refuse (it was: found by the chunked
    prefill study, experiments/chunked_prefill.py)."""
    prompt = [(3 * i + 2) % V for i in range(40)]
    policy = compose("h2o", budget=0.5)  # 20 tokens + a 32-token chunk > max_tokens = 40 + 2
    res = generate(MODEL, [prompt], 2, policy, chunk=32)
    assert len(res.tokens[0]) == 2
    assert res.report.tokens_per_layer == ((20,),) * MODEL.n_cache_layers  # h2o evicts back to its budget


def test_a_pool_for_budget_plus_chunk_runs_a_prompt_that_does_not_fit_whole():
    prompt = [(5 * i + 1) % V for i in range(80)]
    policy = compose("streaming", budget=12)
    num_pages = MODEL.n_cache_layers * pages(12 + 8, 4)  # budget + one chunk per layer
    with pytest.raises(RuntimeError, match="out of pages"):
        generate(MODEL, [prompt], 4, policy, page_size=4, num_pages=num_pages)
    res = generate(MODEL, [prompt], 4, policy, page_size=4, num_pages=num_pages, chunk=8)
    assert len(res.tokens[0]) == 4
    assert res.report.peak_bytes <= num_pages * res.report.page_bytes
    assert res.report.tokens_per_layer == ((12,),) * MODEL.n_cache_layers


DEEP = tiny_llama(n_layers=4)  # a layer-budget policy's layers differ


@given(length=st.integers(30, 80), chunk=st.sampled_from([4, 8, 13]), budget=st.sampled_from([8, 12, 0.25]),
       spec=st.sampled_from(["pyramid+h2o", "pyramid+snapkv(window=4)", "squeeze+streaming", "pyramid+knorm",
                             "squeeze+tova"]),
       evict_every=st.integers(1, 3), n_new=st.integers(1, 6), page_size=st.sampled_from([1, 4]),
       horizon=st.booleans())
def test_layer_budgets_fit_a_cache_sized_for_the_mean_budget(length, chunk, budget, spec, evict_every, n_new,
                                                             page_size, horizon):
    """A cache of max_tokens = the mean budget + one chunk (or + the generation) streams a prompt that a
    layer-budget policy splits unevenly: each layer's budget is capped at what leaves room for the next
    chunk, then for the generation, the excess handed to the other layers, so nothing is refused mid-prompt
    (it was: the largest layer overflowed at the next chunk) and the plan keeps the whole budget between
    them. ``horizon``: extend knows the generation's length (as ``generate`` and ``kvgen`` pass it)."""
    policy = compose(spec, budget=budget, evict_every=evict_every)
    prompt = [(7 * i + 3) % V for i in range(length)]
    mean = int(policy.budget_tokens(torch.tensor([length]))[0])
    max_tokens = mean + max(chunk, n_new)
    dec = Decoder(DEEP, policy, max_tokens=max_tokens, page_size=page_size)
    dec.extend([prompt], chunk=chunk, max_new_tokens=n_new if horizon else 0)
    res = dec.generate(n_new)
    assert len(res.tokens[0]) == n_new
    plan, Lc = dec.cache.plan, DEEP.n_cache_layers
    slots = dec.cache.slots_per_layer
    ahead = min(evict_every, n_new) if policy.eviction.decode_evict else n_new
    budgets = plan.layers.budgets[:, 0]
    if length + n_new > slots:  # the cache cannot hold every token: the plan made room for the generation
        assert int(budgets.max()) <= slots - ahead
    assert int(budgets.sum()) == Lc * mean  # the total is conserved
    held = [t[0] for t in res.report.tokens_per_layer]
    assert max(held) <= slots
    # (What the layers hold may fall short of the plan: a layer capped lower mid-prompt, or one squeeze gave
    # less after an earlier chunk, has evicted tokens that no later chunk brings back.)
    assert sum(held) <= Lc * mean + Lc * (n_new if not policy.eviction.decode_evict else evict_every)


def test_a_layer_budget_policy_streams_into_a_cache_for_its_mean_budget():
    """The case that failed: pyramid gives the first layer more than max_tokens less a chunk."""
    policy = compose("pyramid+h2o", budget=12)
    uncapped = policy.plan(torch.tensor([60]), DEEP.n_cache_layers).layers.budgets[:, 0]
    assert int(uncapped[0]) > 12 + 8 - 8  # more than a layer of max_tokens = 12 + 8 keeps beside a chunk
    dec = Decoder(DEEP, policy, max_tokens=12 + 8, page_size=4)
    dec.extend([[(5 * i) % V for i in range(60)]], chunk=8, max_new_tokens=3)
    assert len(dec.generate(3).tokens[0]) == 3
    budgets = dec.cache.plan.layers.budgets[:, 0]
    assert int(budgets.sum()) == int(uncapped.sum()) and int(budgets.max()) <= 20 - 1  # room for a step
    assert budgets.tolist() != uncapped.tolist()


def test_retrieval_heads_stream_into_a_cache_for_the_mean_budget():
    """duo's retrieval heads keep more than the layer's budget (per-head pages): capped like the layers, the
    excess going to the layer's other heads, a cache of the mean budget + one chunk takes the prompt."""
    duo = ("duo", {"weights": ((0.9, 0.1),) * DEEP.n_cache_layers, "fraction": 0.5})
    policy = compose("snapkv(window=4)", duo, budget=12)
    prompt = [(5 * i + 2) % V for i in range(70)]
    uncapped = Decoder(DEEP, policy, page_size=4)
    uncapped.extend([prompt], chunk=8, max_new_tokens=3)
    assert int(uncapped.cache.plan.head_budgets.max()) > 12 + 8 - 3  # would not fit beside a chunk
    dec = Decoder(DEEP, policy, max_tokens=12 + 8, page_size=4)
    dec.extend([prompt], chunk=8, max_new_tokens=3)
    assert len(dec.generate(3).tokens[0]) == 3
    heads = dec.cache.plan.head_budgets[:, 0]  # [Lc, Hkv]
    assert int(heads.max()) <= 20 - 3  # room for the generation (snapkv does not evict while decoding)
    assert heads.sum(1).tolist() == [2 * 12] * DEEP.n_cache_layers  # each layer's heads: the whole budget
    # Not told the generation's length, the prompt's plan fills the retrieval heads' slots; per-head budgets
    # are split once a turn, so the generation is refused up front (it failed at its first step).
    dec = Decoder(DEEP, policy, max_tokens=12 + 8, page_size=4)
    dec.extend([prompt], chunk=8)
    with pytest.raises(ValueError, match=r"^max_new_tokens=3: .*extend\(\.\.\., max_new_tokens=\)\)$"):
        dec.generate(3)


def test_chunked_num_pages_is_every_layers_budget_plus_a_chunk_plus_the_generation():
    Lc = DEEP.n_cache_layers
    assert chunked_num_pages(DEEP, compose("h2o", budget=0.25), 400, 32, 8, page_size=4) == Lc * (35 + 1)
    assert chunked_num_pages(DEEP, compose("pyramid+snapkv", budget=50), 400, 30, 0, page_size=16,
                             batch=3) == 3 * Lc * (5 + 1)
    h2o = compose("h2o", budget=0.5)
    assert chunked_num_pages(DEEP, h2o, 40, 32, 8, page_size=1) == Lc * 49  # never more than every token
    assert chunked_num_pages(DEEP, compose("full"), 400, 32, 8, page_size=8) == Lc * 52  # every token
    for args, name in (((0, 32, 8), "tokens"), ((400, 0, 8), "chunk"), ((400, 32, -1), "max_new_tokens")):
        with pytest.raises(ValueError, match=f"^{name}="):
            chunked_num_pages(DEEP, h2o, *args)
    with pytest.raises(ValueError, match="^follow_ups="):
        chunked_num_pages(DEEP, h2o, 400, 32, 8, follow_ups=-1)
    # follow-ups: compressed with the context in one format
    assert chunked_num_pages(DEEP, h2o, 300, 32, 8, page_size=1, follow_ups=100) == Lc * (200 + 32 + 8 + 1)
    with pytest.raises(ValueError, match="region='side': policy 'h2o' stores tokens in one format"):
        chunked_num_pages(DEEP, h2o, 400, 32, 8, region="side")
    with pytest.raises(ValueError, match="region='both' must be 'main', 'side' or None"):
        chunked_num_pages(DEEP, h2o, 400, 32, 8, region="both")
    # two formats, each pool its own: KIVI's unquantized residual + a group + a chunk, its quantized budget
    # + a chunk + the generation + the follow-ups (kept whole); MiKV's low bits every token
    kivi = compose("h2o", "kivi(bits=4, group=4, residual=16)", budget=0.5)
    sizes = [chunked_num_pages(DEEP, kivi, 300, 32, 8, page_size=1, follow_ups=10, region=r)
             for r in ("main", "side", None)]
    assert sizes == [Lc * (16 + 4 + 32 + 1), Lc * (150 + 10 + 32 + 8 + 1), Lc * (150 + 10 + 32 + 8 + 1)]
    mikv = compose("h2o", "mikv(low=4, group=4)", budget=0.5)
    assert [chunked_num_pages(DEEP, mikv, 300, 32, 8, page_size=1, region=r) for r in ("main", "side")] == [
        Lc * (150 + 32 + 8 + 1), Lc * (300 + 8 + 1)]
    with pytest.raises(ValueError, match="side_pages=4: policy 'h2o' stores tokens in one format"):
        Decoder(DEEP, h2o, side_pages=4)
    # KIVI's residual holds residual + group whole whatever the budget: a cap below that plus a chunk is
    # refused before the prompt (it failed at a later chunk: "past the ... slots per layer")
    small = compose("snapkv(window=4)", "kivi(bits=4, group=4, residual=16)", budget=4)
    with pytest.raises(ValueError, match=r"chunk=8: each layer holds its budget \(20 tokens\) plus one"):
        Decoder(DEEP, small, max_tokens=24).extend([[1] * 60], chunk=8)
    dec = Decoder(DEEP, small, max_tokens=28)
    dec.extend([[1] * 60], chunk=8)  # residual + group + a chunk fits
    assert (dec.cache.host.lens[:, 0] <= 20).all()
    prompt = [(7 * i + 3) % V for i in range(40)]  # generate() hands side_pages to the 4-bit pool
    with pytest.raises(RuntimeError, match="cache out of pages: .*4-bit"):
        generate(DEEP, [prompt], 4, kivi, chunk=8, page_size=4, side_pages=2)
    res = generate(DEEP, [prompt], 4, kivi, chunk=8, page_size=4,
                   side_pages=chunked_num_pages(DEEP, kivi, 40, 8, 4, page_size=4, region="side"),
                   num_pages=chunked_num_pages(DEEP, kivi, 40, 8, 4, page_size=4, region="main"))
    assert len(res.tokens[0]) == 4
    with pytest.raises(ValueError, match="side_pages must be a positive int or None, got 0"):
        Decoder(DEEP, kivi, side_pages=0)


def converse_alike(bounded: Decoder, free: Decoder, prompt: list[int], chunk: int, questions: list[int],
                   n_new: int) -> None:
    """Stream ``prompt`` into both Decoders ``chunk`` at a time, then ask each question (of that many
    tokens) after the previous answer: after every answer, the same tokens, plans and tokens held per
    layer."""
    for dec in (bounded, free):
        dec.extend([prompt], chunk=chunk, max_new_tokens=n_new)
    for k, q in enumerate([None, *questions]):
        if q is not None:
            for dec in (bounded, free):
                dec.extend([[(5 * i + k) % V for i in range(q)]], max_new_tokens=n_new)
        got, want = (dec.generate(n_new).tokens[0] for dec in (bounded, free))
        assert got == want
        assert torch.equal(bounded.cache.plan.rows.budgets, free.cache.plan.rows.budgets)
        assert bounded.cache.report().tokens_per_layer == free.cache.report().tokens_per_layer


DEEP_DUO = ("duo", {"weights": ((0.9, 0.1),) * DEEP.n_cache_layers, "fraction": 0.5})
PROFILE = ("profile", {"weights": (2.0, 0.3, 0.2, 1.5)})


@given(length=st.integers(30, 80), chunk=st.sampled_from([4, 8, 13]), budget=st.sampled_from([8, 12, 0.25]),
       spec=st.sampled_from([("pyramid+h2o",), ("squeeze+snapkv(window=4)",), (PROFILE, "tova"), ("h2o",),
                             ("snapkv(window=4)", "duo")]),
       n_new=st.integers(1, 6), questions=st.lists(st.integers(1, 16), max_size=2),
       page_size=st.sampled_from([1, 4, 16]))
@example(length=30, chunk=4, budget=8, spec=("pyramid+h2o",), n_new=1, questions=[], page_size=16)  # rounding
def test_a_pool_of_chunked_num_pages_changes_nothing(length, chunk, budget, spec, n_new, questions,
                                                    page_size):
    """A page pool of ``chunked_num_pages`` (the mean budget + one chunk + the generation per layer, a page of
    rounding each) takes a streamed prompt and its follow-ups with every layer's (head's) budget as planned
    in a pool of the model's context: the layers share the pool, so a layer-budget policy's or duo's large
    layers take the pages the small ones leave. Same tokens, same kept tokens; it never runs out."""
    parts = [p if p != "duo" else DEEP_DUO for p in spec]
    policy = compose(*parts, budget=budget)
    prompt = [(7 * i + 3) % V for i in range(length)]
    final = length + sum(questions) + len(questions) * n_new
    assume(final + n_new <= DEEP.max_seq_len)
    pages = chunked_num_pages(DEEP, policy, final, max([chunk, *questions]), n_new, page_size=page_size)
    bounded, free = (Decoder(DEEP, policy, num_pages=n, page_size=page_size) for n in (pages, None))
    converse_alike(bounded, free, prompt, chunk, questions, n_new)
    assert bounded.cache.num_pages < free.cache.num_pages or final <= 2 * chunk


@given(length=st.integers(30, 80), chunk=st.sampled_from([4, 8, 13]), budget=st.sampled_from([8, 12, 0.25]),
       spec=st.sampled_from([("snapkv(window=4)", "kivi(bits=4, group=4, residual=6)"),
                             ("h2o", "kivi(bits=4, group=4, residual=4)"),
                             ("kivi(bits=4, group=4, residual=8)",),
                             ("snapkv(window=4)", "mikv(low=4, group=4)"), ("h2o", "mikv(low=4, group=4)"),
                             ("pyramid+tova", "kivi(bits=2, group=4, residual=4)"),
                             ("snapkv(window=4)", "zipcache(high=8, low=4, group=4, every=5)"),
                             ("h2o", "zipcache(high=16, low=2, group=4, salient=0.3, every=3)")]),
       n_new=st.integers(1, 6), questions=st.lists(st.integers(1, 16), max_size=2),
       page_size=st.sampled_from([1, 4, 16]))
@example(length=80, chunk=4, budget=0.25, spec=("kivi(bits=4, group=4, residual=8)",), n_new=6,
         questions=[16], page_size=1)  # no eviction: 4 bits take every token
@example(length=80, chunk=13, budget=0.25,
         spec=("snapkv(window=4)", "zipcache(high=8, low=4, group=4, every=5)"), n_new=6, questions=[9],
         page_size=1)  # ZipCache: the high bits' share of the budget
def test_two_formats_stream_into_pools_of_chunked_num_pages(length, chunk, budget, spec, n_new, questions,
                                                            page_size):
    """A prompt streamed into two formats (KIVI's residual, MiKV, ZipCache) in chunks, then follow-ups: each
    of the two pools sized by ``chunked_num_pages(region=)`` (``follow_ups``: the questions and earlier
    answers, which two formats keep whole) takes it with what an unbounded pair of pools holds, the same
    tokens; KIVI's unquantized pool holds its residual, a group and a chunk (fewer pages than the budget's,
    however long the prompt), ZipCache's high bits their salient share of the budget, a chunk and the rest.
    Pools smaller than the regions' needs fail up front or with "cache out of pages", never silently."""
    policy = compose(*spec, budget=budget)
    prompt = [(7 * i + 3) % V for i in range(length)]
    final = length + sum(questions) + len(questions) * n_new
    assume(final + n_new <= DEEP.max_seq_len)
    step = max([chunk, *questions])  # the most tokens one extension appends
    sizes = {region: chunked_num_pages(DEEP, policy, length, step, n_new, page_size=page_size, region=region,
                                       follow_ups=final - length) for region in ("main", "side")}
    assert chunked_num_pages(DEEP, policy, length, step, n_new, page_size=page_size,
                             follow_ups=final - length) == max(sizes.values())
    bounded = Decoder(DEEP, policy, num_pages=sizes["main"], side_pages=sizes["side"], page_size=page_size)
    free = Decoder(DEEP, policy, page_size=page_size)
    converse_alike(bounded, free, prompt, chunk, questions, n_new)
    p = policy.precision
    if p.name == "kivi":
        assert (bounded.cache.host.lens[:, 0] <= p.residual + p.group).all()
        main = min(final + n_new, p.residual + p.group + step)
        assert sizes["main"] == DEEP.n_cache_layers * (-(-main // page_size) + 1)
    if p.name == "zipcache":  # the high bits: their share of the budget, a chunk, the follow-ups, the answer
        main = min(final + n_new, p.high_share(int(policy.budget_tokens(torch.tensor([length]))[0]))
                   + final - length + step + n_new)
        assert sizes["main"] == DEEP.n_cache_layers * (-(-main // page_size) + 1) <= sizes["side"]


@given(spec=st.sampled_from(["full", "snapkv(window=4)", "streaming", "h2o", "pyramid+h2o", "tova",
                             "adakv+snapkv", "h2o+minicache"]),
       budget=st.sampled_from([6, 0.5]), evict_every=st.sampled_from([1, 3]),
       lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), n_new=st.integers(2, 20),
       spare=st.integers(0, 12), page_size=st.sampled_from([1, 4]))
@example(spec="snapkv(window=4)", budget=6, evict_every=1, lens=[12, 12], n_new=10, spare=0, page_size=4)
def test_a_generation_the_pool_cannot_hold_is_refused_before_its_first_step(spec, budget, evict_every, lens,
                                                                             n_new, spare, page_size):
    """``Decoder.generate`` counts, before its first step, the pages its steps may open at worst
    (``cache.decode_pages``) against the pool's free pages: a pool too small for the generation is refused
    then with the pool's error ("cache out of pages", naming ``max_new_tokens`` and ``num_pages``), no token
    emitted (it failed mid-generation, at the step that found no page). Whatever the check lets through runs
    to the end; a policy that evicts nothing while decoding fails without the check exactly when the check
    refuses."""
    policy = compose(spec, budget=budget, evict_every=evict_every)
    prompts = [[(3 * i + b) % V for i in range(L)] for b, L in enumerate(lens)]
    probe = Decoder(MODEL, policy, page_size=page_size)
    probe.extend(prompts, max_new_tokens=n_new)
    probe.start_decode(n_new)
    held = int(probe.cache.num_pages - probe.cache.pool.free)
    unit = probe.cache.rows.per_sequence  # per-head rows (adakv): the cache counts one head's pages
    pages = -(-max(held + spare, int(probe.cache.host.peak_pages)) // unit) * unit  # the prefill fits too
    free = pages - held
    need = probe.cache.decode_pages(n_new - 1)
    assert need is not None and need >= 0
    outcomes = with_and_without_the_pool_check(policy, prompts, n_new, page_size, num_pages=pages // unit)
    assert outcomes[True][0] == ("refused" if need > free else "ran")
    if need > free:
        err = outcomes[True][1]
        assert f"max_new_tokens={n_new}" in err and f"of {pages} are free" in err and "raise num_pages" in err
    if not policy.eviction.decode_evict:  # the count is exact there
        assert outcomes[False][0] == ("out of pages" if need > free else "ran")


def with_and_without_the_pool_check(policy, prompts, n_new, page_size, **pools):
    """``generate(n_new)`` after ``prompts`` on a Decoder of ``pools`` (``num_pages=``, ``side_pages=``), with
    its up-front pool check (True) and without it (False): ``("ran", "")`` for a run that emitted every
    token, else ``("refused" | "out of pages", the error)``; a refusal emits nothing."""
    outcomes = {}
    for checked in (True, False):
        dec = Decoder(MODEL, policy, page_size=page_size, **pools)
        dec.extend(prompts, max_new_tokens=n_new)
        if not checked:
            dec._check_pool = lambda n: None
        emitted: list[int] = []
        try:
            res = dec.generate(n_new, stream=lambda b, t, out=emitted: out.append(t))
            assert [len(t) for t in res.tokens] == [n_new] * len(prompts)
            outcomes[checked] = ("ran", "")
        except RuntimeError as e:
            assert "cache out of pages" in str(e), e
            assert not (checked and emitted), "refused before any token"
            outcomes[checked] = ("refused" if checked else "out of pages", str(e))
    return outcomes


@given(spec=st.sampled_from(["snapkv(window=4)+kivi(bits=4, group=4, residual=4)",
                             "h2o+kivi(bits=8, group=4, residual=2)",
                             "h2o+zipcache(high=8, low=4, group=4, every=3)",
                             "snapkv(window=4)+zipcache(high=16, low=4, group=4, salient=0.3, every=2)",
                             "tova+zipcache(high=8, low=2, group=4, every=5)", "h2o+mikv(low=4, group=4)",
                             "snapkv(window=4)+mikv(low=4, group=4)"]),
       budget=st.sampled_from([6, 0.5]), evict_every=st.sampled_from([1, 3]),
       lens=st.lists(st.integers(1, 30), min_size=1, max_size=3), n_new=st.integers(2, 20),
       spare=st.tuples(st.integers(0, 12), st.integers(0, 12)), page_size=st.sampled_from([1, 4]))
@example(spec="h2o+kivi(bits=8, group=4, residual=2)", budget=6, evict_every=3, lens=[12, 7], n_new=15,
         spare=(3, 2), page_size=1)
def test_a_generation_two_pools_cannot_hold_is_refused_before_its_first_step(spec, budget, evict_every, lens,
                                                                             n_new, spare, page_size):
    """Two formats (``kvmodels.cache.tiers``): ``Decoder.generate`` replays its steps on lengths
    (``SideRegion.decode_pages``: the append, KIVI's aging or ZipCache's re-compression, the eviction or
    MiKV's demotion every ``evict_every`` steps) and refuses up front when either pool lacks the pages, with
    that pool's error (naming ``num_pages`` or ``side_pages``), no token emitted. The counts depend on lengths
    only, so the refusal is exact: without it, a generation fails mid-way exactly when it refuses."""
    policy = compose(spec, budget=budget, evict_every=evict_every)
    prompts = [[(3 * i + b) % V for i in range(L)] for b, L in enumerate(lens)]
    probe = Decoder(MODEL, policy, page_size=page_size)
    probe.extend(prompts, max_new_tokens=n_new)
    probe.start_decode(n_new)
    pools = {}
    for region, pool, peak, extra in (("main", probe.cache.pool, probe.cache.host.peak_pages, spare[0]),
                                      ("side", probe.cache.side.pool, probe.cache.side.peak_pages, spare[1])):
        held = int(pool.num_pages - pool.free)
        pages = max(held + extra, int(peak))  # the prefill fits too
        need = probe.cache.decode_pages(n_new - 1, region)
        assert need is not None and need >= 0
        pools[region] = (pages, need, pages - held)
    short = [r for r, (_, need, free) in pools.items() if need > free]
    outcomes = with_and_without_the_pool_check(policy, prompts, n_new, page_size, num_pages=pools["main"][0],
                                               side_pages=pools["side"][0])
    assert outcomes[True][0] == ("refused" if short else "ran"), pools
    assert outcomes[False][0] == ("out of pages" if short else "ran"), pools
    if short:  # the first short pool's own error
        err, name = outcomes[True][1], {"main": "num_pages", "side": "side_pages"}[short[0]]
        assert f"max_new_tokens={n_new}" in err and f"of {pools[short[0]][0]} are free" in err, err
        assert f"raise {name}" in err, err


@pytest.mark.parametrize("spec", ["h2o+zipcache(group=8, every=4)", "tova+zipcache(group=8)"])
def test_zipcache_under_eviction_generates_in_a_cache_of_its_prompt(spec):
    """ZipCache's main region under a policy that evicts while decoding is re-compressed whenever it holds
    more than its layer's budget, so it never passes budget + 1 slots: a generation longer than the cache's
    room is not refused (it was, counted as growing by every step: "would cache 19 more tokens")."""
    dec = Decoder(MODEL, compose(spec, budget=0.4), max_tokens=20, page_size=1)
    dec.extend([[(3 * i + 1) % V for i in range(20)]])
    held: list[int] = []  # what the fullest layer holds as each token is read
    for turn, n in ((None, 5), ([(5 * i) % V for i in range(6)], 20)):
        if turn:
            dec.extend([turn])
        res = dec.generate(n, stream=lambda b, t: held.append(dec.cache.slots_held(0)))
        assert len(res.tokens[0]) == n
        assert max(held) <= int(dec.cache.plan.rows.budgets.max()) + 1 <= dec.cache.slots_per_layer
        held.clear()


@given(length=st.integers(30, 80), chunk=st.sampled_from([4, 8, 13]), budget=st.sampled_from([8, 12, 0.25]),
       spec=st.sampled_from([("pyramid+h2o",), ("squeeze+snapkv(window=4)",), ("pyramid+streaming",),
                             ("squeeze+tova",), ("h2o",), ("snapkv(window=4)", DEEP_DUO), ("h2o", DEEP_DUO)]),
       n_new=st.integers(1, 6), questions=st.lists(st.integers(1, 16), min_size=1, max_size=3),
       page_size=st.sampled_from([1, 4]))
def test_follow_ups_fit_a_cache_sized_for_the_mean_budget(length, chunk, budget, spec, n_new, questions,
                                                          page_size):
    """Follow-up turns on a context streamed into a cache of the mean budget + one chunk (or + the longest
    turn, + the generation): the layers (heads) a layer-budget policy or duo gave the most fill their slots,
    so each follow-up's extension first compresses the sequence with room reserved for it
    (``cache.make_room``; it was refused at the first follow-up: "would hold 115 + 11 tokens in a layer").
    Each turn completes and no layer outgrows the cache; the budget is planned whole."""
    policy = compose(*spec, budget=budget)
    prompt = [(7 * i + 3) % V for i in range(length)]
    final = length + sum(questions) + len(questions) * n_new
    assume(final + n_new <= DEEP.max_seq_len)
    mean = int(policy.budget_tokens(torch.tensor([final]))[0])  # the budget grows with the conversation
    max_tokens = mean + max(chunk, n_new, *questions) + n_new
    dec = Decoder(DEEP, policy, max_tokens=max_tokens, page_size=page_size)
    dec.extend([prompt], chunk=chunk, max_new_tokens=n_new)
    assert len(dec.generate(n_new).tokens[0]) == n_new
    slots, Lc = dec.cache.slots_per_layer, DEEP.n_cache_layers
    for k, q in enumerate(questions):
        dec.extend([[(5 * i + k) % V for i in range(q)]], max_new_tokens=n_new)
        assert dec.cache.slots_held(0) <= slots
        seen = dec.lengths[0]  # what the turn's budget is a fraction of
        res = dec.generate(n_new)
        assert len(res.tokens[0]) == n_new
        assert dec.cache.slots_held(0) <= slots
    budgets = dec.cache.plan.rows.budgets[:, dec.cache.rows.rows(0)]  # [Lc, rows of the sequence]
    total = int(policy.budget_tokens(torch.tensor([seen]))[0]) * Lc * budgets.shape[1]
    assert int(budgets.sum()) == total  # the cap moved budget between layers (heads), dropped none
    assert int(budgets.max()) <= slots


# ----------------------------------------------------------------------------------------------------- (d)
def naive_extension(q, k, v, positions, kept_k, kept_v, kept_pos, *, scale, slopes, mode, window, decay,
                    seed, temperature):
    """Row by row, query head by query head: each row attends to its KV head's kept tokens and to the new
    tokens up to itself; scores start at zero and take ``update_scores_ref`` per scored row."""
    n, Hq, D = q.shape
    m, Hkv = kept_k.shape[0], k.shape[1]
    G = Hq // Hkv
    out = torch.zeros(n, Hq, D, dtype=torch.float64)
    scores = torch.zeros(Hkv, m + n, dtype=torch.float64)
    first = scored_rows(n, mode, window)
    for i in range(n):
        contrib = torch.zeros(Hkv, m + i + 1, dtype=torch.float64)
        for hq in range(Hq):
            h = hq // G
            keys = torch.cat([kept_k[:, h], k[:i + 1, h]]).double()
            values = torch.cat([kept_v[:, h], v[:i + 1, h]]).double()
            key_pos = torch.cat([kept_pos[:, h].long(), positions[:i + 1].long()])
            logits = scale * (keys @ q[i, hq].double())
            if slopes is not None:
                logits = logits + float(slopes[hq]) * (key_pos - int(positions[i])).double()
            out[i, hq] = torch.softmax(logits, 0) @ values
            if mode == "gumbel":
                noise = gumbel_noise_hash(seed, hq, positions[i:i + 1].long(), key_pos).double()
                contrib[h] += torch.softmax((logits + noise) / temperature, 0) / G
            elif mode == "max":  # kvzip's probe: the largest probability of any scored row and query head
                if i >= first:
                    scores[h, :m + i + 1] = torch.maximum(scores[h, :m + i + 1], torch.softmax(logits, 0))
            else:
                contrib[h] += torch.softmax(logits, 0) / G
        if i >= first and mode != "max":
            visible = scores[:, :m + i + 1].float()
            scores[:, :m + i + 1] = update_scores_ref(visible, contrib.float(), mode, decay=decay,
                                                      n_valid=m + i + 1).double()
    return out, scores


@pytest.mark.parametrize("mode, window", [("accumulate", 0), ("accumulate", 3), ("decay", 0), ("replace", 1),
                                          ("gumbel", 0), ("count_low", 0), ("max", 0)])
@pytest.mark.parametrize("alibi", [False, True])
@given(m=st.integers(0, 9), n=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_extend_attention_equals_a_naive_loop(mode, window, alibi, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    Hkv, G, D = 2, 2, 8
    q = torch.randn(n, Hkv * G, D, generator=g)
    k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    kept_k, kept_v = torch.randn(m, Hkv, D, generator=g), torch.randn(m, Hkv, D, generator=g)
    # each head keeps its own m of the first 3m positions, in order
    kept_pos = torch.stack([torch.randperm(3 * m, generator=g)[:m].sort().values for _ in range(Hkv)], 1)
    positions = torch.arange(3 * m, 3 * m + n)
    slopes = torch.rand(Hkv * G, generator=g) if alibi else None
    kw = dict(scale=D**-0.5, mode=mode, window=window, decay=0.9, seed=seed, temperature=1.5)
    out, scores = extend_attention(q, k, v, positions, kept_k, kept_v, kept_pos, alibi_slopes=slopes, block=3,
                                   **kw)
    want_out, want_scores = naive_extension(q, k, v, positions, kept_k, kept_v, kept_pos, slopes=slopes, **kw)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- (e)
class NoExtendLlama(Llama):
    can_extend = False


@pytest.mark.parametrize("make, call, error, match", [
    (lambda: Decoder(MODEL), lambda d: d.extend([[1, 2, 3]], chunk=0), ValueError, r"^chunk=0 must be"),
    (lambda: Decoder(MODEL, compose("snapkv", budget=0.5)), lambda d: d.extend([list(range(50))], chunk=16),
     ValueError, r"^chunk=16 is smaller than snapkv's observation window of 32 .* use chunk >= 32"),
    (lambda: Decoder(MODEL), lambda d: d.extend([[1] * 90], max_new_tokens=8), ValueError,
     r"^tokens\[0\]: sequence 0 would reach 98 tokens .* past the model's context of 96"),
    (lambda: Decoder(MODEL, compose("h2o", budget=8), max_tokens=12),
     lambda d: d.extend([list(range(40))], chunk=8), ValueError,
     r"^chunk=8: each layer holds its budget \(8 tokens\) plus one chunk, more than max_tokens=12"),
    (lambda: Decoder(MODEL, compose("h2o", budget=4), max_tokens=12), lambda d: d.extend([list(range(20))]),
     ValueError, r"^tokens\[0\]: .* more than max_tokens=12 allows; prefill in smaller chunks"),
    (lambda: Decoder(MODEL, max_tokens=12), lambda d: d.extend([list(range(20))], chunk=4), ValueError,
     r"^chunk: .* more than max_tokens=12 allows; raise max_tokens \(policy 'full' compresses no prompt"),
    (lambda: Decoder(tiny_model("llama"), compose("h2o", "minicache", budget=0.5)),
     lambda d: d.extend([list(range(10))], chunk=4), NotImplementedError, "merges layers"),
    (lambda: Decoder(MODEL, compose("h2o", "adakv", budget=0.5)),
     lambda d: d.extend([list(range(10))], chunk=4), NotImplementedError, "own budgets from the prompt's"),
    (lambda: Decoder(tiny_model("lckv")), lambda d: d.extend([list(range(10))], chunk=4), NotImplementedError,
     "^LCKV cannot continue"),
    (lambda: Decoder(MODEL), lambda d: d.generate(4), RuntimeError, r"before extend\(\)"),
    (lambda: Decoder(MODEL), lambda d: d.extend([[1], []]), ValueError, r"tokens\[1\] is empty"),
    (lambda: Decoder(MODEL), lambda d: d.extend("hello"), ValueError, "tokenize"),
    (lambda: Decoder(MODEL), lambda d: d.extend(torch.tensor([[1, 2]])), ValueError,
     r"^tokens is a torch.Tensor; pass a list of token-id lists"),
    (lambda: Decoder(MODEL), lambda d: d.extend([[1, MODEL.config.vocab_size]]), ValueError,
     r"^tokens\[0\]\[1\]=\d+ is outside the model's vocabulary"),
    (lambda: Decoder(MODEL), lambda d: d.extend([[0.5]]), ValueError,
     r"^tokens\[0\]\[0\]=0.5 is not a token id"),
])
def test_bad_input_is_refused_in_one_line(make, call, error, match):
    dec = make()
    with pytest.raises(error, match=match) as info:
        call(dec)
    assert "\n" not in str(info.value)
    assert dec.cache is None or dec.cache._state in ("idle", "decode")  # nothing half done


def test_continuation_errors():
    dec = Decoder(MODEL)
    dec.extend([[1, 2, 3], [4, 5]])
    dec.generate(2)
    with pytest.raises(ValueError, match=r"tokens has 1 lists; this Decoder's batch has 2 sequences"):
        dec.extend([[1]])
    with pytest.raises(ValueError, match=r"^max_new_tokens=95: sequence 0 has 5 tokens"):
        dec.generate(95)
    with pytest.raises(ValueError, match=r"^tokens\[1\]: sequence 1 would reach 98 tokens"):
        dec.extend([[], [1] * 94])
    dec.generate(2, final=True)
    with pytest.raises(ValueError, match=r"sequence 0 is closed \(close\(\) or generate\(final=True\)"):
        dec.extend([[1], []])
    with pytest.raises(RuntimeError, match="every sequence is closed"):
        dec.generate(2)
    dec = Decoder(MODEL)
    dec.extend([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^tokens\[0\]\[1\]=-3 is outside"):  # a follow-up's ids too
        dec.extend([[4, -3]])
    with pytest.raises(ValueError, match=r"^temperature=-1 must be a finite number >= 0"):
        dec.generate(2, temperature=-1)
    with pytest.raises(ValueError, match=r"^eos_ids='2' must be token ids .*not text"):  # was ignored
        dec.generate(2, eos_ids="2")
    with pytest.raises(ValueError, match=r"^eos_ids\[1\]=\d+ is outside the model's vocabulary"):
        dec.generate(2, eos_ids=[1, MODEL.config.vocab_size])
    with pytest.raises(ValueError, match=r"^eos_ids=2.0 is not a token id"):
        dec.generate(2, eos_ids=2.0)
    with pytest.raises(TypeError, match=r"^stream=5 must be a callable"):
        dec.generate(2, stream=5)
    assert dec.generate(2).tokens[0]  # neither refusal touched the cache
    model = NoExtendLlama(MODEL.config).to(DEVICE)
    one_shot = Decoder(model)
    one_shot.extend([[1, 2, 3]])  # a prompt needs no continuation
    one_shot.generate(2)
    with pytest.raises(NotImplementedError, match="^NoExtendLlama cannot continue"):
        one_shot.extend([[4]])


def test_paused_sequences_keep_their_tokens_and_scores_while_others_decode():
    """A sequence that stopped on eos sits out the rest of the turn: its cache must not change."""
    policy = compose("h2o", budget=60)
    dec = Decoder(MODEL, policy, page_size=4)
    dec.extend([[5, 3, 8, 1], [9, 2, 7, 11, 4, 6]])
    free = dec.generate(1)  # the first token of each
    eos = free.tokens[0][0]
    dec2 = Decoder(MODEL, policy, page_size=4)
    dec2.extend([[5, 3, 8, 1], [9, 2, 7, 11, 4, 6]])
    before = [dec2.cache.layer_contents(l, 0) for l in range(MODEL.n_cache_layers)]
    res = dec2.generate(6, eos_ids=[eos])
    assert res.tokens[0] == [eos] and res.finished_on_eos[0]
    for l in range(MODEL.n_cache_layers):
        after = dec2.cache.layer_contents(l, 0)
        for name in ("k", "v", "pos", "score"):
            assert torch.equal(before[l][name], after[name]), name


@pytest.mark.slow
def test_compiled_turns_equal_eager_without_recompiles():
    """One decode graph for the Decoder: two turns (extend, generate, extend, generate) compiled give the
    eager tokens and compile one graph."""
    from torch._dynamo.utils import counters

    policy = compose("h2o", budget=6, evict_every=2)
    prompts = [[5, 3, 8, 1, 9, 2, 7], list(range(11, 30))]
    turns = [([[1, 2, 3], [4]], 8), ([[], [6, 6]], 6)]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    outs = []
    for compile in (False, True):
        dec = Decoder(MODEL, policy, page_size=4, compile=compile)
        dec.extend(prompts, chunk=5)
        got = [dec.generate(10).tokens]
        for more, n in turns:
            dec.extend(more)
            got.append(dec.generate(n).tokens)
        outs.append(got)
    assert outs[0] == outs[1]
    assert counters["stats"]["unique_graphs"] - before == 1


def test_close_returns_one_sequences_pages_and_the_others_continue():
    dec = Decoder(MODEL, compose("h2o", budget=6), page_size=4)
    dec.extend([[5, 3, 8, 1, 9, 2, 7], [4, 4, 2, 9]])
    first = dec.generate(3)
    dec.close(0)
    assert dec.cache.report().tokens_per_layer == ((0, 6), (0, 6))
    dec.extend([[], [1, 2]])
    second = dec.generate(3)
    assert second.tokens[0] == [] and len(second.tokens[1]) == 3
    want = Decoder(MODEL, compose("h2o", budget=6), page_size=4)  # the same turns without sequence 0
    want.extend([[4, 4, 2, 9]])
    assert want.generate(3).tokens[0] == first.tokens[1]
    want.extend([[1, 2]])
    assert want.generate(3).tokens[0] == second.tokens[1]


def test_a_full_cache_longer_than_max_tokens_is_refused_before_any_chunk():
    dec = Decoder(MODEL, max_tokens=20)
    with pytest.raises(ValueError, match=r"^chunk: sequence 0 would hold 0 \+ 30 tokens in a layer"):
        dec.extend([list(range(30))], chunk=8)
    assert dec.cache is None


def test_a_generation_past_max_tokens_is_refused_up_front():
    dec = Decoder(MODEL, max_tokens=16)  # the full policy never evicts
    dec.extend([list(range(10))])
    with pytest.raises(ValueError, match=r"^max_new_tokens=8: sequence 0 would cache 7 more tokens"):
        dec.generate(8)
    assert len(dec.generate(7).tokens[0]) == 7  # 6 steps fit


DUO = ("duo", {"weights": ((0.9, 0.1), (0.1, 0.9)), "fraction": 0.5})  # one retrieval head per layer


@pytest.mark.parametrize("spec", [("snapkv(window=4)",), ("h2o",), ("snapkv(window=4)", DUO)],
                         ids=["snapkv", "h2o", "snapkv+duo"])
def test_a_batched_follow_up_equals_each_sequence_alone(spec):
    """A follow-up turn of a batch compresses each sequence by its own extension: sequence 0's ``end_extend``
    must not compress sequence 1's answer to its old budget before sequence 1's question re-ranks it (the
    batch, in either order, keeps and generates what each sequence does alone)."""
    g = torch.Generator().manual_seed(11)
    prompts = [[int(x) for x in torch.randint(0, V, (n,), generator=g)] for n in (28, 23)]
    follow = [[int(x) for x in torch.randint(0, V, (n,), generator=g)] for n in (6, 9)]
    policy = compose(*spec, budget=0.5)

    def kept(dec: Decoder, b: int) -> list:
        if policy.heads.per_head:
            return [[h["pos"].flatten().tolist() for h in dec.cache.head_contents(l, b)]
                    for l in range(MODEL.n_cache_layers)]
        return [dec.cache.layer_contents(l, b)["pos"].t().tolist() for l in range(MODEL.n_cache_layers)]

    def run(order: list[int]) -> tuple[list[list[int]], list]:
        dec = Decoder(MODEL, policy)
        dec.extend([prompts[b] for b in order])
        dec.generate(5)
        dec.extend([follow[b] for b in order])
        out = dec.generate(4).tokens
        return out, [kept(dec, i) for i in range(len(order))]

    alone = [run([b]) for b in (0, 1)]
    for order in ([0, 1], [1, 0]):
        out, held = run(order)
        for i, b in enumerate(order):
            assert out[i] == alone[b][0][0], f"order {order}, sequence {b}: tokens"
            assert held[i] == alone[b][1][0], f"order {order}, sequence {b}: kept positions"
