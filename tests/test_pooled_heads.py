"""``pooled`` head budgets: one top-k over every compressed layer's and KV head's scores (KVzip's allocation).

Oracle written for clarity: ``reference_pooled`` (plain Python, token by token). Checked: the split against
it with many ties, the total conserved across layers, each head between its floor and its layer's tokens,
one layer alone equal to ``adakv(alpha)``, layers the prompt fits in left out of the pool, the plan's check
of a bad split, compose and its spec; with ``kvzip`` (tests/test_kvzip.py) the cache keeps each head's top
of the reconstruction oracle at these budgets.
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvpolicies import compose
from kvpolicies.heads import Pooled
from test_head_cache import reference_split


def reference_pooled(scores: list[list[list[float]]], budgets: list[int], alpha: float,
                     forced: list[tuple[int, int]]) -> list[list[int]]:
    """Per compressed layer and KV head, its budget: every head keeps its forced tokens and its best
    ``floor`` tokens; the ``H * sum(budgets) - H * sum(floors)`` remaining slots go to the best of all other
    (layer, head, token) entries, ties to the earlier layer, then the lower head, then the head's
    earlier-ranked token."""
    candidates, counts = [], []
    for i, (layer, budget, (n_sink, n_recent)) in enumerate(zip(scores, budgets, forced)):
        L = len(layer[0])
        floor = min(L, max(math.ceil(alpha * budget - 1e-9), n_sink + n_recent, 1))
        is_forced = [j < n_sink or j >= L - n_recent for j in range(L)]
        counts.append([floor] * len(layer))
        for h, row in enumerate(layer):
            ranked = sorted(range(L), key=lambda j: (not is_forced[j], -row[j], j))  # noqa: B023
            for rank, j in enumerate(ranked[floor:]):
                candidates.append((-row[j], i, h, rank))
    candidates.sort()
    H = len(scores[0])
    extra = H * sum(budgets) - sum(sum(c) for c in counts)
    for _, i, h, _ in candidates[:extra]:
        counts[i][h] += 1
    return counts


@given(H=st.integers(1, 3), n_layers=st.integers(1, 3), data=st.data(),
       alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_split_layers_matches_the_reference(H, n_layers, data, alpha):
    scores, budgets, forced = [], [], []
    for _ in range(n_layers):
        L = data.draw(st.integers(2, 30), label="L")
        budget = data.draw(st.integers(1, L - 1), label="budget")  # compressed: L > budget
        n_sink = data.draw(st.integers(0, min(2, budget)), label="n_sink")
        n_recent = data.draw(st.integers(0, budget - n_sink), label="n_recent")
        # Small integer scores: many ties between layers, heads and tokens.
        scores.append([[float(data.draw(st.integers(0, 4))) for _ in range(L)] for _ in range(H)])
        budgets.append(budget)
        forced.append((n_sink, n_recent))
    policy = compose("snapkv", "pooled", pooled={"alpha": alpha})
    got = policy.pooled_head_budgets([torch.tensor(s) for s in scores], budgets, forced)
    assert got.tolist() == reference_pooled(scores, budgets, alpha, forced)
    assert int(got.sum()) == H * sum(budgets)  # the compressed layers' memory, moved between them
    for i, s in enumerate(scores):
        assert all(max(1, sum(forced[i])) <= n <= len(s[0]) for n in got[i].tolist())


@given(H=st.integers(1, 4), L=st.integers(2, 40), data=st.data(), alpha=st.sampled_from([0.0, 0.2, 1.0]))
def test_one_layer_is_adakv(H, L, data, alpha):
    """Alone, a layer's pool is Ada-KV's split with the same floor."""
    budget = data.draw(st.integers(1, L - 1), label="budget")
    n_sink = data.draw(st.integers(0, min(2, budget)), label="n_sink")
    n_recent = data.draw(st.integers(0, budget - n_sink), label="n_recent")
    scores = [[float(data.draw(st.integers(0, 5))) for _ in range(L)] for _ in range(H)]
    got = Pooled(alpha=alpha).split(torch.tensor(scores), budget, (n_sink, n_recent))
    assert got.tolist() == reference_split(scores, budget, alpha, n_sink, n_recent)


def test_budget_moves_to_the_layer_that_needs_it():
    peaked = [1.0, 1.0] + [0.0] * 18  # a layer whose heads need two tokens each
    diffuse = [0.5] * 20              # one whose heads need all of them
    got = compose("snapkv", "pooled").pooled_head_budgets(
        [torch.tensor([peaked, peaked]), torch.tensor([diffuse, diffuse])], [10, 10], [(0, 0), (0, 0)])
    assert got.tolist() == [[2, 2], [20, 16]]  # 40 slots in all, as two layers of 2 x 10; ties: lower head


def test_plan_pools_only_compressed_layers():
    """A layer the prompt fits in keeps its budget and lends none of it; the others share their slots."""
    policy = compose("h2o", "pooled", budget=0.5)
    L, H = 20, 2
    scores = {0: torch.tensor([[1.0] * 4 + [0.0] * 16] * H), 1: torch.tensor([[0.5] * L] * H)}
    plan = policy.plan(torch.tensor([L]), 2, head_scores=lambda l, j: scores[l])
    # h2o at budget 10 forces the 5 most recent tokens; layer 0's heads win their four 1.0 tokens, layer 1
    # takes the other 12 of the 20 free slots (0.5 beats 0.0; ties to the lower head).
    assert plan.layers.budgets[:, 0].tolist() == [10, 10] and plan.layers.n_recent[:, 0].tolist() == [5, 5]
    assert plan.head_budgets[:, 0].tolist() == [[9, 9], [17, 5]]
    # A layer whose heads hold fewer tokens than its budget (10) keeps the budget and lends none of it.
    held = {0: scores[0], 1: scores[1][:, :6]}
    mixed = policy.plan(torch.tensor([L]), 2, head_scores=lambda l, j: held[l])
    assert mixed.head_budgets[:, 0].tolist() == [[11, 9], [10, 10]]  # layer 0 pooled alone: its 2 x 10


class _Bad(Pooled):
    """A pooled split that gives every head one slot too many (unregistered)."""

    def split_layers(self, scores, budgets, n_forced):
        return torch.tensor([[b] * s.shape[0] for s, b in zip(scores, budgets)]) + 1


def test_bad_split_is_refused_by_name():
    policy = dataclasses.replace(compose("h2o", "pooled", budget=0.5), heads=_Bad())
    with pytest.raises(ValueError, match="head-budget policy 'pooled' split budgets"):
        policy.plan(torch.tensor([20]), 2, head_scores=lambda l, j: torch.rand(2, 20))


def test_compose_and_spec():
    p = compose("kvzip", "pooled", budget=0.2, pooled={"alpha": 0.1})
    assert p.name == "kvzip+pooled" and p.heads.per_head and p.heads.pools_layers
    assert compose(p.spec()) == p and compose(p.to_json()) == p
    assert compose("kvzip+pooled(alpha=0.1)", budget=0.2) == p
    assert not p.heads_refuse_extension  # kvzip compresses once, after its probe
    assert compose("snapkv", "pooled").heads_refuse_extension
    with pytest.raises(ValueError, match="alpha"):
        compose("snapkv", "pooled", pooled={"alpha": 2.0})
    with pytest.raises(ValueError, match="'streaming' scores no prompt"):
        compose("streaming", "pooled")
