"""The ``duo`` head-budget policy (retrieval heads keep up to the whole prompt, the others their sinks and
window): its split against a loop written for clarity, the sums and floors ``ComposedPolicy.head_budgets``
checks, parameter errors, calibration, the compose round trip, and a run through ``kvmodels.Decoder`` on a
tiny Llama whose retrieval heads really hold more tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmodels.decoder import Decoder
from kvpolicies import compose
from kvpolicies.heads import Duo
from test_generate import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_split(weights, fraction, layer, H, L, budget, n_forced):
    """The split handed out one token at a time: every head starts at its floor; each further token goes to
    the retrieval head with the fewest tokens (the lower head on a tie) that is below L, else to such a
    streaming head. Retrieval heads: the ceil(fraction * n) highest weights, ties to the earlier layer and
    the lower head."""
    if L <= budget:
        return [budget] * H
    flat = [(-w, l, h) for l, row in enumerate(weights) for h, w in enumerate(row)]
    n = math.ceil(fraction * len(flat) - 1e-9)
    chosen = {(l, h) for _, l, h in sorted(flat)[:n]}
    retrieval = [(layer, h) in chosen for h in range(H)]
    if all(retrieval) or not any(retrieval):
        return [budget] * H
    floor = min(L, max(sum(n_forced), 1))
    out = [floor] * H
    for _ in range(H * budget - H * floor):
        for group in (True, False):
            open_ = [h for h in range(H) if retrieval[h] == group and out[h] < L]
            if open_:
                h = min(open_, key=lambda h: (out[h], h))
                out[h] += 1
                break
    return out


@st.composite
def cases(draw):
    H = draw(st.integers(1, 4))
    n_layers = draw(st.integers(1, 3))
    weights = [[draw(st.sampled_from([0.0, 0.5, 1.0, 0.25])) for _ in range(H)] for _ in range(n_layers)]
    L = draw(st.integers(1, 40))
    budget = draw(st.integers(1, 44))
    n_sink = draw(st.integers(0, budget))
    n_recent = draw(st.integers(0, budget - n_sink))
    fraction = draw(st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 0.75, 1.0]))
    layer = draw(st.integers(0, n_layers - 1))
    return H, weights, L, budget, (n_sink, n_recent), fraction, layer


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_split_matches_the_reference_loop(case):
    H, weights, L, budget, forced, fraction, layer = case
    duo = Duo(weights=weights, fraction=fraction)
    got = duo.split(torch.rand(H, L), budget, forced, layer=layer)
    assert got.dtype == torch.int64 and got.shape == (H,)
    assert got.tolist() == reference_split(weights, fraction, layer, H, L, budget, forced)


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_sums_and_floors_as_compose_checks(case):
    H, weights, L, budget, (n_sink, n_recent), fraction, layer = case
    policy = compose("snapkv", ("duo", {"weights": weights, "fraction": fraction}))
    got = policy.head_budgets(torch.rand(H, L), budget, n_sink, n_recent, layer=layer)  # raises if off
    assert bool((got >= max(1, n_sink + n_recent)).all())
    if L > budget:
        assert int(got.sum()) == H * budget and bool((got <= L).all())
        retrieval = Duo(weights=weights, fraction=fraction).retrieval_heads()[layer]
        if 0 < int(retrieval.sum()) < H:  # every retrieval head holds at least as much as any other head
            assert int(got[retrieval].min()) >= int(got[~retrieval].max())
    else:
        assert got.tolist() == [budget] * H


def test_retrieval_heads_keep_everything_when_the_budget_allows():
    duo = Duo(weights=((0.9, 0.1, 0.2, 0.05),), fraction=0.25)  # one retrieval head: head 0
    assert duo.retrieval_heads().tolist() == [[True, False, False, False]]
    assert duo.split(torch.rand(4, 100), 40, (4, 8), layer=0).tolist() == [100, 20, 20, 20]
    assert duo.split(torch.rand(4, 100), 20, (4, 8), layer=0).tolist() == [44, 12, 12, 12]
    # the scores play no part: only the heads' identity and the layer's budget do
    assert duo.split(torch.zeros(4, 100), 20, (4, 8), layer=0).tolist() == [44, 12, 12, 12]


def test_model_wide_fraction_with_ties():
    duo = Duo(weights=((1.0, 0.0), (1.0, 1.0)), fraction=0.5)  # 2 of 4 heads; the tie goes to layer 0
    assert duo.retrieval_heads().tolist() == [[True, False], [True, False]]
    assert Duo(weights=((1.0, 0.0),), fraction=0.0).retrieval_heads().sum() == 0


@pytest.mark.parametrize("params, match", [
    ({"weights": 3}, "parameter weights"),
    ({"weights": ((1.0, "a"),)}, r"parameter weights\[0\]\[1\]"),
    ({"weights": ((1.0, -1.0),)}, r"parameter weights\[0\]\[1\]"),
    ({"weights": ((1.0, math.nan),)}, r"parameter weights\[0\]\[1\]"),
    ({"weights": ((1.0, 2.0), (1.0,))}, r"parameter weights\[1\]"),
    ({"weights": ((),)}, r"parameter weights\[0\]"),
    ({"fraction": 1.5}, "fraction"),
    ({"fraction": -0.1}, "fraction"),
])
def test_parameter_errors_name_the_parameter(params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        compose("snapkv", ("duo", params))
    with pytest.raises(TypeError, match="fraction"):
        Duo(fraction="a")


def test_split_errors_name_what_is_missing():
    duo = Duo(weights=((1.0, 0.0), (0.0, 1.0)))
    with pytest.raises(ValueError, match="layer"):
        duo.split(torch.rand(2, 10), 4, (0, 2))
    with pytest.raises(ValueError, match="weights has 2 cache layers"):
        duo.split(torch.rand(2, 10), 4, (0, 2), layer=2)
    with pytest.raises(ValueError, match="weights has 2 KV heads"):
        duo.split(torch.rand(3, 10), 4, (0, 2), layer=0)
    with pytest.raises(ValueError, match="parameter weights is empty"):
        Duo().split(torch.rand(2, 10), 4, (0, 2), layer=0)
    # a layer the prompt fits in needs nothing from the weights
    assert Duo().split(torch.rand(2, 3), 4, (0, 2), layer=0).tolist() == [4, 4]


@pytest.mark.parametrize("role, bad, good, match", [
    ("duo", ((1.0, 0.0),) * 3, ((1.0, 0.0), (0.0, 1.0)),
     "weights has 3 cache layers of 2 KV heads, and the model 2 of 2"),
    ("duo", ((1.0,), (0.0,)), ((1.0, 0.0), (0.0, 1.0)),
     "weights has 2 cache layers of 1 KV heads, and the model 2 of 2"),
    ("profile", (1.0, 2.0, 3.0), (1.0, 2.0), "weights has 3 entries but the model has 2 cache layers"),
    ("duo", (), ((1.0, 0.0), (0.0, 1.0)), r"weights is empty; .* calibrate the policy on the model"),
])
def test_weights_of_another_model_are_refused_before_any_prefill(role, bad, good, match):
    """Weights measured on another model (``duo``'s per layer and KV head, ``profile``'s per layer), or none
    where the policy needs them (``duo`` not calibrated), are refused where the Decoder or the cache is built
    (``ComposedPolicy.check_model``), not after a prefill, nor only once a prompt is long enough to be split
    (a short first turn used to pass, and the follow-up failed); weights of this model run both turns."""
    from kvmodels.cache import paged_cache

    model = tiny_llama()  # 2 cache layers, 2 KV heads
    scorer = "snapkv(window=4)" if role == "duo" else "h2o"
    policy = compose(scorer, (role, {"weights": bad}), budget=0.5)
    with pytest.raises(ValueError, match=match):
        Decoder(model, policy)
    with pytest.raises(ValueError, match=match):
        paged_cache(**vars(model.cache_layout()), max_batch=1, max_tokens=32, policy=policy)
    dec = Decoder(model, compose(scorer, (role, {"weights": good}), budget=0.5))
    dec.extend([[1, 2, 3]])  # a prompt under the budget's floor: nothing to split
    dec.generate(2)
    dec.extend([list(range(1, 30))])
    assert len(dec.generate(2).tokens[0]) == 2


def test_compose_round_trip():
    policy = compose("profile(weights=(1.0, 2.0))", "snapkv(window=4)",
                     ("duo", {"weights": [[0.5, 0.1], [0.2, 0.9]], "fraction": 0.5}), budget=0.3)
    assert policy.name == "profile+snapkv+duo"
    assert isinstance(policy.heads, Duo) and policy.heads.weights == ((0.5, 0.1), (0.2, 0.9))
    assert compose(policy.spec()) == policy
    assert compose(policy.to_json()) == policy
    assert compose(policy.label, budget=0.3) == policy
    assert hash(compose(policy.spec())) == hash(policy)


def test_composition_needs_a_per_head_scorer():
    with pytest.raises(ValueError, match="per_head"):
        compose("snapkv(per_head=False)", "duo")
    with pytest.raises(ValueError, match="scores no prompt"):
        compose("streaming", "duo")


class _Probe:
    name = "fake probe"

    def __init__(self):
        self.calls = 0

    def retrieval_profile(self):
        return (1.0, 1.0)

    def retrieval_heads(self):
        self.calls += 1
        return ((0.1, 0.9), (0.3, 0.2))


def test_calibration_measures_the_weights_once():
    policy = compose("snapkv", "duo", budget=0.5)
    assert policy.needs_calibration
    probe = _Probe()
    fitted, notes = policy.calibrate(probe)
    assert probe.calls == 1 and not fitted.needs_calibration
    assert fitted.heads.weights == ((0.1, 0.9), (0.3, 0.2))
    assert len(notes) == 1 and notes[0].startswith("duo: ") and "1 of 4 KV heads" in notes[0]
    again, notes = fitted.calibrate(probe)
    assert again == fitted and notes == [] and probe.calls == 1
    both, notes = compose("profile", "snapkv", "duo", budget=0.5).calibrate(_Probe())
    assert [n.split(":")[0] for n in notes] == ["profile", "duo"] and both.budget_policy.weights == (1.0, 1.0)


def test_kvmodels_probe_measures_per_kv_head_weights():
    from kvmodels.profile import ModelProbe, retrieval_head_weights, retrieval_scores

    model = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
    w = retrieval_head_weights(model, length=10, trials=1)
    assert len(w) == 2 and all(len(row) == 2 for row in w)
    echo, induction = retrieval_scores(model, length=10, trials=1)
    strongest = torch.maximum(echo, induction).view(2, 2, 2).amax(dim=2)
    assert w == tuple(tuple(round(float(x), 4) for x in row) for row in strongest)
    fitted, _ = compose("snapkv", "duo").calibrate(ModelProbe(model))
    assert len(fitted.heads.weights) == 2


def test_decoder_gives_retrieval_heads_more_tokens():
    model = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
    weights = ((1.0, 0.0), (0.0, 0.0))  # layer 0's head 0 retrieves; fraction 0.25 picks only it
    policy = compose("snapkv(window=4)", ("duo", {"weights": weights}), budget=0.25)
    prompt = [int(x) for x in torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(1))]
    dec = Decoder(model, policy, page_size=4)
    dec.extend([prompt])
    assert dec.cache.rows.name == "heads"
    rep = dec.cache.report()
    # budget 10 per head of a 40-token layer: layer 0's retrieval head takes 20 - 4, the other its window
    assert rep.head_tokens[0][0] == (16, 4)
    assert rep.head_tokens[1][0] == (10, 10)  # no retrieval head in layer 1: an even split
    out = dec.generate(3, final=True)
    assert len(out.tokens[0]) == 3
    even = Decoder(model, compose("snapkv(window=4)", budget=0.25), page_size=4)
    even.extend([prompt])
    assert sum(rep.head_tokens[0][0]) == 2 * even.cache.report().tokens_per_layer[0][0]


# ----------------------------------------------------------------------------------------------------
# Follow-up turns on per-head pages (Decoder.extend after the prompt, chunked prefill)
# ----------------------------------------------------------------------------------------------------

DUO_WEIGHTS = ((1.0, 0.0), (0.0, 0.5))  # layer 0's head 0 and layer 1's head 1 retrieve (fraction 0.5)


@given(prompt=st.lists(st.integers(0, 49), min_size=1, max_size=30),
       follow=st.lists(st.integers(0, 49), min_size=1, max_size=12), chunk=st.sampled_from([None, 4, 7]))
@settings(max_examples=8, deadline=None)
def test_duo_with_room_for_everything_continues_as_the_full_cache(prompt, follow, chunk):
    """Budget 1.0: every head keeps everything, so two turns (and a chunked first prompt) on per-head pages
    give the full cache's greedy tokens."""
    model = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
    policy = compose("snapkv(window=4)", ("duo", {"weights": DUO_WEIGHTS, "fraction": 0.5}), budget=1.0)
    duo, full = Decoder(model, policy, page_size=4), Decoder(model, compose("full"), page_size=4)
    for dec in (duo, full):
        dec.extend([prompt], chunk=chunk)
    assert duo.cache.rows.name == "heads"
    assert duo.generate(3).tokens == full.generate(3).tokens
    for dec in (duo, full):
        dec.extend([follow])
    assert duo.generate(4).tokens == full.generate(4).tokens


def test_duo_follow_up_keeps_retrieval_heads_whole_and_the_model_kv():
    """A compressing duo over three turns: after each extension every (layer, head) row holds at most its
    head budget, the retrieval heads hold every token the budget allows (more than the streaming heads),
    and every kept K/V is the one the model computed at that position (bit for bit)."""
    model = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
    policy = compose("snapkv(window=4)", ("duo", {"weights": DUO_WEIGHTS, "fraction": 0.5}), budget=0.25)
    dec = Decoder(model, policy, page_size=4, max_tokens=96)
    kv = {}
    g = torch.Generator().manual_seed(3)

    def wrap(cache):
        prefill_attend, extend_attend, append = cache.prefill_attend, cache.extend_attend, cache.append

        def store(l, k, v, positions):
            for i, p in enumerate(positions.tolist()):
                kv[l, p] = (k[i].clone(), v[i].clone())

        def on_prefill(l, b, q, k, v, positions, **kw):
            store(l, k, v, positions)
            return prefill_attend(l, b, q, k, v, positions, **kw)

        def on_extend(l, b, q, k, v, positions, **kw):
            store(l, k, v, positions)
            return extend_attend(l, b, q, k, v, positions, **kw)

        def on_append(l, k, v, positions, q=None):
            store(l, k, v, positions)
            return append(l, k, v, positions, q=q)

        cache.prefill_attend, cache.extend_attend, cache.append = on_prefill, on_extend, on_append

    build = dec._build_cache
    dec._build_cache = lambda batch: (build(batch), wrap(dec.cache))[0]
    for turn, n in ((40, 3), (12, 4), (9, 2)):
        dec.extend([[int(x) for x in torch.randint(0, 50, (turn,), generator=g)]])
        cache, rep = dec.cache, dec.cache.report()
        seen = dec.lengths[0]
        for l in range(cache.n_layers):
            budgets = cache.plan.rows.budgets[l].tolist()  # [Hkv] this sequence's head budgets
            held = rep.head_tokens[l][0]
            assert all(h <= bud for h, bud in zip(held, budgets, strict=True)), (l, held, budgets)
            retrieval = DUO_WEIGHTS[l].index(max(DUO_WEIGHTS[l]))
            assert held[retrieval] > max(h for i, h in enumerate(held) if i != retrieval)
            for h, got in enumerate(cache.head_contents(l, 0)):
                pos = got["pos"].tolist()
                assert len(set(pos)) == len(pos) and max(pos) < seen
                for i, p in enumerate(pos):
                    k, v = kv[l, p]
                    assert torch.equal(got["k"][i], k[h]) and torch.equal(got["v"][i], v[h])
        dec.generate(n)
