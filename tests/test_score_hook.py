"""The open score hook with everything a step provides: a rule that reads each token's own queries and
position (``EvictionPolicy.reads_queries``) runs through kvmodels' paged cache, where it keeps what a dense
reference keeps, through a transformers model's ``generate`` (``kvmodels.hf``), which keeps what kvmodels' own
model keeps, and inside the compiled decode step. (``knorm`` and the example package's ``vnorm`` cover rules
of keys and values alone.)"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvpolicies import EvictionPolicy, NewTokens, compose, register_policy
from reference_policies import kept_by_fixed_scores, resolve_budget
from test_cache import FakeRun, check_invariants


@dataclass(frozen=True)
class QKSign(EvictionPolicy):
    """Test rule: positions ``p % 3 == 2`` first, then ``p % 3 == 1``, then the rest; within a class, tokens
    whose key agrees in sign with their own queries (mean over the KV head's query group) first."""

    reads_queries = True

    def token_scores(self, new: NewTokens) -> torch.Tensor:
        assert new.q is not None
        hkv = new.k.shape[-2]
        q = new.q.float().unflatten(-2, (hkv, -1)).mean(-2)  # [..., Hkv, D]
        agree = ((q * new.k.float()).sum(-1) > 0).float()  # [..., Hkv]
        return (new.positions % 3).float()[..., None] * 2 + agree


@pytest.fixture
def qksign(clean_registry):
    register_policy("qksign", role="eviction")(QKSign)
    return QKSign


def reference_kept(q, k, b: int, L: int, evict_every: int) -> list[list[list[int]]]:
    """Dense reference of one sequence from its queries ``q [L + T, Hq, D]`` and keys ``k [L + T, Hkv, D]``
    (row = position): ``[step][head]`` kept positions, the ``b`` best by the rule's order, ties earlier."""
    H, G = k.shape[1], q.shape[1] // k.shape[1]

    def score(p: int, h: int) -> tuple[int, int]:
        dot = float((q[p, h * G:(h + 1) * G].double().mean(0) * k[p, h].double()).sum())
        return p % 3, int(dot > 0)

    def keep(ids: list[int], h: int) -> list[int]:
        ranked = sorted(ids, key=lambda p: (*(-x for x in score(p, h)), p))  # best first, ties earlier
        return ids if len(ids) <= b else sorted(ranked[:b])

    return kept_by_fixed_scores(keep, H, L, k.shape[0] - L, evict_every)


@st.composite
def cases(draw):
    return dict(n_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 3])),
                prompt_lens=draw(st.lists(st.integers(1, 14), min_size=1, max_size=3)),  # start refuses 0
                n_steps=draw(st.integers(0, 6)), page_size=draw(st.sampled_from([1, 3, 4])),
                budget=draw(st.one_of(st.integers(4, 10), st.sampled_from([0.25, 0.5, 1.0]))),
                evict_every=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)))


def test_a_rule_of_queries_and_positions_keeps_what_the_reference_keeps(qksign):
    @given(cases())
    def check(c):
        policy = compose("qksign", budget=c["budget"], evict_every=c["evict_every"])
        lens = c["prompt_lens"]
        run = FakeRun(1, c["n_kv"], c["group"], 4, lens, c["n_steps"], c["seed"])
        cache = run.cache(policy, page_size=c["page_size"])
        cache.start(lens, c["n_steps"])
        for b in range(len(lens)):
            cache.prefill_layer(0, b, *run.prompt[0][b], run.positions(b), scale=run.scale)
        cache.finish_prefill()
        got = [[cache.layer_contents(0, b)["pos"].t().tolist() for b in range(len(lens))]]
        for t in range(c["n_steps"]):
            cache.prepare_decode(t)
            q, k, v = run.steps[t][0]
            cache.append(0, k, v, run.step_positions(t), q=q)
            cache.attend(0, q, run.step_positions(t), scale=run.scale)
            cache.after_step(t)
            check_invariants(cache)
            got.append([cache.layer_contents(0, b)["pos"].t().tolist() for b in range(len(lens))])
        for b, L in enumerate(lens):
            qs = torch.cat([run.prompt[0][b][0].cpu()] + [run.steps[t][0][0][b:b + 1].cpu()
                                                           for t in range(c["n_steps"])])
            ks = torch.cat([run.prompt[0][b][1].cpu()] + [run.steps[t][0][1][b:b + 1].cpu()
                                                           for t in range(c["n_steps"])])
            want = reference_kept(qs, ks, resolve_budget("qksign", {}, c["budget"], L), L, c["evict_every"])
            assert [step[b] for step in got] == want, f"sequence {b}"

    check()


def test_the_rule_needs_its_queries_and_says_so(qksign):
    run = FakeRun(1, 1, 2, 4, [5], 1, 0)
    cache = run.cache(compose("qksign", budget=4))
    cache.start([5], 1)
    cache.prefill_layer(0, 0, *run.prompt[0][0], run.positions(0), scale=run.scale)
    cache.finish_prefill()
    cache.prepare_decode(0)
    _, k, v = run.steps[0][0]
    with pytest.raises(ValueError, match=r"append\(q=None\).*qksign.*q \[B, Hq, D\]"):
        cache.append(0, k, v, run.step_positions(0))


def test_reads_queries_without_a_rule_is_refused_when_defined():
    with pytest.raises(TypeError, match="reads_queries but defines no token_scores"):
        class NoRule(EvictionPolicy):
            reads_queries = True


@pytest.mark.parametrize("kind", ["llama", "gptj", "mpt"])
def test_a_transformers_model_hands_the_rule_what_kvmodels_hands_it(qksign, kind):
    from hf_models import assert_transformers_keeps_what_kvmodels_keeps

    assert_transformers_keeps_what_kvmodels_keeps(kind, compose("qksign", budget=0.5))


def test_the_rule_compiles_in_the_decode_step(qksign):
    """Inside the compiled decode step: one graph, no break, the same tokens as eager."""
    from kvmodels.generate import generate
    from test_generate import tiny_llama

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, policy = tiny_llama(), compose("qksign", budget=4)
    eager = generate(model, [[1, 2, 3, 4, 5, 6, 7], [8, 9]], 6, policy)
    compiled = generate(model, [[1, 2, 3, 4, 5, 6, 7], [8, 9]], 6, policy, compile=True)
    assert compiled.tokens == eager.tokens
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
