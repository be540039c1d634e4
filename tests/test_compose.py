"""compose(): every input form, order independence, defaults, errors, parameter routing, round trips."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpolicies import ComposedPolicy, available, compose, get_policy

NAMES = {role: [r.name for r in available(role)] for role in ("eviction", "budget", "merge")}
VALID = [combo for combo in itertools.product(NAMES["budget"], NAMES["eviction"], NAMES["merge"])
         if not (combo[1] == "full" and combo[0] != "uniform")]


def test_front_door():
    policy = compose("squeeze", "keyformer", budget=0.2)
    assert isinstance(policy, ComposedPolicy)
    assert policy.name == "squeeze+keyformer"
    assert policy.eviction.name == "keyformer" and policy.budget_policy.name == "squeeze"
    assert policy.merge.name == "none" and policy.budget == 0.2 and policy.evict_every == 1


def test_input_forms_agree():
    expected = compose("squeeze", "keyformer", budget=0.2, squeeze={"p": 0.25}, keyformer={"tau_end": 3.0})
    forms = [
        compose("keyformer", "squeeze", budget=0.2, squeeze={"p": 0.25}, keyformer={"tau_end": 3.0}),
        compose("squeeze+keyformer", budget=0.2, squeeze={"p": 0.25}, keyformer={"tau_end": 3.0}),
        compose("keyformer + squeeze", budget=0.2, squeeze={"p": 0.25}, keyformer={"tau_end": 3.0}),
        compose(("squeeze", {"p": 0.25}), ("keyformer", {"tau_end": 3.0}), budget=0.2),
        compose(("squeeze", {"p": 0.25}), "keyformer", budget=0.2, keyformer={"tau_end": 3.0}),
        compose(get_policy("keyformer")(tau_end=3.0), get_policy("squeeze")(p=0.25), budget=0.2),
        compose({"policies": ["keyformer", "squeeze"], "budget": 0.2, "squeeze": {"p": 0.25},
                 "keyformer": {"tau_end": 3.0}}),
        compose(expected.spec()),
        compose(expected.to_json()),
        compose(expected),
        compose(["squeeze", "keyformer"], budget=0.2, squeeze={"p": 0.25}, keyformer={"tau_end": 3.0}),
        # a pair as JSON writes it (a list), in a spec's policies
        compose(json.loads('{"policies": [["squeeze", {"p": 0.25}], ["keyformer", {"tau_end": 3.0}]], '
                           '"budget": 0.2}')),
    ]
    for got in forms:
        assert got == expected
        assert hash(got) == hash(expected)


def test_defaults():
    policy = compose()
    assert policy.name == "full" and policy.eviction.name == "full"
    assert policy.budget_policy.name == "uniform" and policy.merge.name == "none"
    assert (policy.budget, policy.evict_every, policy.seed) == (1.0, 1, 0)
    assert compose("uniform", "none").name == "full"
    assert compose("minicache").name == "minicache"
    assert compose("h2o", "minicache", "pyramid").name == "pyramid+h2o+minicache"


def test_parameters_reach_their_policy():
    policy = compose("squeeze", "keyformer", budget=0.2,
                     keyformer={"tau_init": 1.0, "tau_end": 2.0, "recent": 0.3}, squeeze={"p": 0.3})
    assert policy.eviction.recent == 0.3 and policy.budget_policy.p == 0.3
    policy = compose("keyformer", keyformer={"tau_end": 4.0, "recent": 0.1}, budget=10, seed=5, evict_every=4)
    assert (policy.eviction.tau_end, policy.eviction.recent) == (4.0, 0.1)
    assert (policy.budget, policy.seed, policy.evict_every) == (10, 5, 4)


def test_immutable_and_printable():
    policy = compose("pyramid", "h2o", budget=0.5, h2o={"recent": 0.25})
    with pytest.raises(AttributeError):
        policy.budget = 0.1
    with pytest.raises(AttributeError):
        policy.eviction.recent = 0.1
    assert "pyramid+h2o" in repr(policy) and "'recent': 0.25" in repr(policy)
    assert str(policy).startswith("pyramid+h2o(recent=0.25) @ budget=0.5")
    assert str(compose()).startswith("full @")


def test_a_name_carries_its_parameters_as_it_prints_them():
    """One string says everything (kvgen --policy): ``name(param=literal, ...)``, joined by '+'."""
    want = compose("pyramid", "snapkv", budget=0.2, snapkv={"chunk": 10, "window": 16, "per_head": False})
    assert compose("pyramid+snapkv(chunk=10, window=16, per_head=False)", budget=0.2) == want
    assert want.label == "pyramid+snapkv(window=16, chunk=10, per_head=False)"
    assert compose(want.label, budget=0.2) == want  # what it prints reads back
    assert compose("squeeze(p=0.8) + keyformer(tau_end=3.0, recent=0.25)").budget_policy.p == 0.8
    assert compose("snapkv()") == compose("snapkv")
    assert compose("snapkv(chunk=10)", snapkv={"window": 8}).eviction.window == 8  # the two forms combine


@pytest.mark.parametrize("text, match", [
    ("snapkv(chunk=)", "keyword=literal"),
    ("snapkv(10)", "keyword=literal"),
    ("snapkv(chunk=ten)", "keyword=literal"),
    ("snapkv(chunk=10", "cannot read the policy"),
    ("snap kv", "cannot read the policy"),
    ("snapkv(chunk=10)(window=8)", "keyword=literal"),
    ("h2o(0.5)", r"keyword=literal pairs, e.g. 'h2o\(recent=0.\d+\)'"),  # the policy's own parameter
    ("full(1)", r"e.g. 'full' \(it takes no parameters\)"),
    ("nosuch(1)", r"e.g. 'snapkv\(chunk=10, per_head=False\)'"),
])
def test_unreadable_parameters_name_the_fix(text, match):
    with pytest.raises(ValueError, match=match):
        compose(text)


def test_parameters_in_names_are_checked_like_keywords():
    with pytest.raises(ValueError, match=r"\['chunk'\] given twice"):
        compose("snapkv(chunk=10)", snapkv={"chunk": 5})
    with pytest.raises(ValueError, match="unknown parameter 'chunks'"):
        compose("snapkv(chunks=10)")


@pytest.mark.parametrize("combo", VALID, ids=lambda c: "+".join(c))
def test_spec_round_trip_for_every_combination(combo):
    policy = compose(*combo, budget=0.3, evict_every=2, seed=7)
    spec = policy.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert compose(spec) == policy
    assert compose(json.loads(policy.to_json())) == policy
    assert compose(policy.name, budget=0.3, evict_every=2, seed=7) == policy
    assert compose(*reversed(combo), budget=0.3, evict_every=2, seed=7) == policy


def test_full_with_a_budget_policy_is_an_error():
    with pytest.raises(ValueError, match="needs an eviction policy"):
        compose("squeeze")


@pytest.mark.parametrize("call, error, match", [
    (lambda: compose("keyformr"), KeyError, "did you mean 'keyformer'"),
    (lambda: compose("squeeze+h2oo"), KeyError, "did you mean 'h2o'"),
    (lambda: compose("h2o", "tova"), ValueError, "'h2o' and 'tova' are both eviction policies"),
    (lambda: compose("squeeze", "pyramid", "h2o"), ValueError, "both budget policies"),
    (lambda: compose("h2o", "h2o"), ValueError, "'h2o' is given twice"),
    (lambda: compose("keyformer", keyformer={"tau": 1.0}), ValueError, "unknown parameter 'tau'.*tau_"),
    (lambda: compose("keyformer", keyformer={"recent": 1.5}), ValueError, "keyformer: parameter recent=1.5"),
    (lambda: compose("h2o", squeeze={"p": 0.3}), ValueError, "'squeeze', which is not composed"),
    (lambda: compose("h2o", bugdet=0.3), TypeError, "did you mean 'budget'"),
    (lambda: compose("h2o", h2o=0.3), TypeError, "must be a dict"),
    (lambda: compose("h2o", budget=0), ValueError, "budget=0"),
    (lambda: compose("h2o", budget=-3), ValueError, "budget=-3"),
    (lambda: compose("h2o", budget=1.5), ValueError, "budget=1.5"),
    (lambda: compose("h2o", budget=0.0), ValueError, "budget=0.0"),
    (lambda: compose("h2o", budget=float("nan")), ValueError, "budget=nan"),
    (lambda: compose("h2o", budget=True), TypeError, "budget=True"),
    (lambda: compose("h2o", budget="0.2"), TypeError, "budget='0.2'"),
    (lambda: compose("h2o", evict_every=0), ValueError, "evict_every=0"),
    (lambda: compose("h2o", evict_every=1.0), TypeError, "evict_every=1.0"),
    (lambda: compose("h2o", seed=False), TypeError, "seed=False"),
    (lambda: compose("h2o+"), ValueError, "empty policy name"),
    (lambda: compose(3), TypeError, "compose\\(\\) takes"),
    (lambda: compose(("h2o", 0.5)), TypeError, "compose\\(\\) takes.*got 0.5"),
    (lambda: compose("{not json"), ValueError, "JSON"),
    (lambda: compose({"policies": ["h2o"], "budget": 0.2}, budget=0.3), ValueError, "'budget' is given"),
    (lambda: compose(("h2o", {"recent": 0.2}), h2o={"recent": 0.3}), ValueError, "given twice"),
    (lambda: compose("snapkv", snapkv={"kernel": 4}), ValueError, "kernel=4"),
    (lambda: compose("streaming", streaming={"sinks": 2.5}), TypeError, "sinks"),
    (lambda: compose("minicache", minicache={"t": 2.0}), ValueError, "minicache: parameter t=2.0"),
])
def test_errors_name_the_problem(call, error, match):
    with pytest.raises(error, match=match):
        call()


@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=6),
       budget=st.one_of(st.floats(0.01, 1.0), st.integers(1, 400)),
       name=st.sampled_from(NAMES["eviction"]))
def test_budget_tokens(lens, budget, name):
    policy = compose(name, budget=budget)
    got = policy.budget_tokens(torch.tensor(lens, dtype=torch.int32))
    assert got.dtype == torch.int64
    m = policy.floor
    assert m == max(4, policy.eviction.min_budget())
    for L, b in zip(lens, got.tolist()):
        if name == "full":
            assert b == L
            continue
        if isinstance(budget, int):  # a cache size: not capped at the prompt
            assert b == max(m, budget)
            continue
        assert b >= m and (b <= L or b == m)
        if m < b < L:   # not clamped: b is the fraction rounded up
            assert budget * L - 1e-6 <= b < budget * L + 1


def test_budget_tokens_examples():
    policy = compose("h2o", budget=0.2)
    assert policy.budget_tokens(torch.tensor([0, 1, 5, 10, 11, 100])).tolist() == [4, 4, 4, 4, 4, 20]
    one = compose("h2o", budget=0.2, min_tokens=1)
    assert one.budget_tokens(torch.tensor([0, 1, 5, 10, 11, 100])).tolist() == [1, 1, 1, 2, 3, 20]
    # An int is a cache size, whatever the prompt length (the prompt is kept whole while it fits).
    assert compose("h2o", budget=8).budget_tokens(torch.tensor([3, 8, 50])).tolist() == [8, 8, 8]
    assert compose("h2o", budget=256).budget_tokens(torch.tensor([36])).tolist() == [256]
    assert compose("h2o", budget=1).budget_tokens(torch.tensor([36])).tolist() == [4]  # the floor
    assert compose("streaming", budget=2).budget_tokens(torch.tensor([3, 50])).tolist() == [5, 5]
    assert compose("streaming", budget=2, streaming={"sinks": 8}).floor == 9
    assert compose(budget=0.1).budget_tokens(torch.tensor([7])).tolist() == [7]
    with pytest.raises(TypeError, match="prompt_lens"):
        policy.budget_tokens(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="prompt_lens"):
        policy.budget_tokens(torch.tensor([-1]))


def test_the_decode_schedule_and_ranking_both_caches_ask():
    """``evicts_after`` and ``eviction_scores`` are the decisions every cache takes from the policy
    (docs/contract.md §6)."""
    assert [compose("h2o", evict_every=3).evicts_after(s) for s in range(6)] == [False, False, True] * 2
    assert all(compose("h2o").evicts_after(s) for s in range(4))
    assert not any(compose("snapkv").evicts_after(s) for s in range(4))  # prompt-only selection
    assert not compose("tova", tova={"decode": False}).evicts_after(0)
    scores = torch.tensor([[1.0, 3.0], [2.0, 0.0]])  # [slots, KV heads]
    assert compose("h2o").eviction.eviction_scores(scores, head_dim=-1) is scores  # per head
    shared = compose("tova").eviction.eviction_scores(scores, head_dim=-1)  # the layer's mean, every head
    assert shared.tolist() == [[2.0, 2.0], [1.0, 1.0]]
    assert compose("tova", tova={"per_head": True}).eviction.eviction_scores(scores, -1) is scores
