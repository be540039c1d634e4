"""The plan (``kvpolicies.plan``): the one decision object the caches store tokens by (docs/contract.md,
"The plan").

Oracles: the rules of docs/contract.md §4 / §5.1 written out directly (a region's budget is ``B_a + B_b``,
its forced counts ``2 * forced(R // 2)``, a merge keeps ``min(L, R // 2)``), the policy's own
``layer_budgets`` / ``eviction.forced`` / ``head_budgets``, and what each cache ends up holding.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels.merge import merge_region
from kvmodels.head_cache import HeadPagedKVCache
from kvpolicies import CompressionPlan, LayerBudgets, MergeLayout, compose
from kvpolicies.base import LayerStats, MergePolicy
from test_cache import FakeRun


@dataclasses.dataclass(frozen=True)
class _Pairs(MergePolicy):
    """A merge policy of fixed pairs (unregistered)."""

    name: ClassVar[str] = "fixed_pairs"
    fixed: tuple = ((0, 1),)

    def pairs(self, n_layers: int) -> list[tuple[int, int]]:
        return list(self.fixed)

    def region(self, *tokens):
        return merge_region(*tokens, t=0.5, retain_ratio=0.05)


# --- the merge layout ------------------------------------------------------------------------------------
def test_layout_maps_each_layer_to_its_storage():
    policy = compose("minicache", minicache={"start": 0.0})
    layout = policy.merge_layout(5)
    assert layout.pairs == tuple(policy.merge.pairs(5)) and len(layout.pairs) == 2
    a, b = layout.pairs[0]
    assert layout.storage[a] == layout.storage[b] == a
    assert (layout.member[a], layout.member[b]) == (0, 1)
    assert (layout.mask_bit(a), layout.mask_bit(b)) == (1, 2)
    assert (layout.width[a], layout.width[b]) == (2, 0)
    assert layout.merged[a] and layout.merged[b] and layout.max_width == 2
    assert layout.owners == tuple(p[0] for p in layout.pairs)
    plain = compose("h2o").merge_layout(3)
    assert plain.pairs == () and plain.storage == (0, 1, 2) and plain.width == (1, 1, 1)
    assert not any(plain.merged) and plain.max_width == 1


@pytest.mark.parametrize("pairs", [((0, 1), (1, 2)), ((3, 4),), ((1, 1),), ((-1, 0),)])
def test_invalid_pairs_are_refused_naming_the_merge_policy(pairs):
    policy = dataclasses.replace(compose("h2o", budget=0.5), merge=_Pairs(pairs))
    with pytest.raises(ValueError, match="merge policy 'fixed_pairs'.*disjoint and in range"):
        policy.merge_layout(4)
    with pytest.raises(ValueError, match="'fixed_pairs'"):
        policy.plan(torch.tensor([10]), 4)
    with pytest.raises(ValueError, match="merge policy 'mine'"):
        MergeLayout(4, pairs, "mine")
    with pytest.raises(ValueError, match="'fixed_pairs'"):  # the caches ask the same layout
        FakeRun(4, 1, 1, 4, [6], 1, seed=0).cache(policy)


# --- budgets ---------------------------------------------------------------------------------------------
SPECS = [
    dict(p="h2o+minicache", budget=0.3),
    dict(p="squeeze+streaming+minicache", budget=0.5, streaming={"sinks": 2}, minicache={"start": 0.0}),
    dict(p="pyramid+snapkv+minicache", budget=7, minicache={"start": 0.0}),
    dict(p="minicache"),  # no eviction: nothing is compressed, a merge keeps every token
    dict(p="squeeze+tova", budget=0.4),
]


@given(spec=st.sampled_from(SPECS), n_layers=st.integers(2, 6),
       lens=st.lists(st.integers(1, 60), min_size=1, max_size=4), new=st.integers(0, 8),
       seed=st.integers(0, 2**16))
def test_region_budgets_are_the_pairs_sums_and_conserve_the_total(spec, n_layers, lens, new, seed):
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    cos = torch.rand(n_layers, len(lens), generator=torch.Generator().manual_seed(seed))
    prompt = torch.tensor(lens)
    plan = policy.plan(prompt, n_layers, LayerStats(cos_sim=cos), max_new_tokens=new)
    layout, layers, storage = plan.layout, plan.layers, plan.storage

    # The layers' part is the budget policy's decision and the eviction's forced counts.
    want = policy.layer_budgets(policy.budget_tokens(prompt), n_layers, LayerStats(cos_sim=cos),
                                capacity=prompt + new)
    assert torch.equal(layers.budgets, want)
    for l in range(n_layers):
        sink, recent = policy.eviction.forced(want[l])
        assert layers.n_sink[l].tolist() == sink.tolist() and layers.n_recent[l].tolist() == recent.tolist()

    # Storage: a region's budget R = B_a + B_b under a, 0 under b; the total is conserved.
    assert torch.equal(storage.budgets.sum(0), layers.budgets.sum(0))
    plain = [l for l in range(n_layers) if layout.width[l] == 1]
    for name in ("budgets", "n_sink", "n_recent"):
        assert torch.equal(getattr(storage, name)[plain], getattr(layers, name)[plain])
    for i, (a, b) in enumerate(layout.pairs):
        R = layers.budgets[a] + layers.budgets[b]
        assert torch.equal(storage.budgets[a], R) and not storage.budgets[b].any()
        sink, recent = policy.eviction.forced(R // 2)
        assert torch.equal(storage.n_sink[a], 2 * sink.long()) and torch.equal(storage.n_recent[a],
                                                                                2 * recent.long())
        assert not storage.n_sink[b].any() and not storage.n_recent[b].any()
        # The joint selection of a merge: N = min(L, R // 2) with prompt compression, else all L.
        keep = torch.minimum(prompt, R // 2) if policy.eviction.prefill_compress else prompt
        assert torch.equal(plan.joint.budgets[i], keep)
        sink, recent = policy.eviction.forced(keep)
        assert plan.joint.n_sink[i].tolist() == sink.tolist()
        assert plan.joint.n_recent[i].tolist() == recent.tolist()
    assert plan.joint.budgets.shape == (len(layout.pairs), len(lens))
    assert bool((storage.n_sink + storage.n_recent <= storage.budgets).all())
    assert plan.rows is storage and plan.head_budgets is None
    assert [plan.evicts_after(s) for s in range(6)] == [policy.evicts_after(s) for s in range(6)]


@given(lens=st.lists(st.integers(1, 40), min_size=2, max_size=4), seed=st.integers(0, 2**16))
def test_planning_sequences_one_at_a_time_equals_planning_them_together(lens, seed):
    """``compress_prompt`` plans one sequence, ``finish_prefill`` the batch: a sequence's plan is its own."""
    policy = compose("squeeze", "h2o", "minicache", budget=0.3, minicache={"start": 0.0})
    cos = torch.rand(4, len(lens), generator=torch.Generator().manual_seed(seed))
    prompt = torch.tensor(lens)
    whole = policy.plan(prompt, 4, LayerStats(cos_sim=cos), max_new_tokens=3)
    each = CompressionPlan.cat([policy.plan(prompt[[b]], 4, LayerStats(cos_sim=cos[:, [b]]),
                                            max_new_tokens=3) for b in range(len(lens))])
    for part in ("layers", "storage", "joint"):
        for x, y in zip(getattr(whole, part), getattr(each, part)):
            assert torch.equal(x, y), part
    assert torch.equal(whole.budget_tokens, each.budget_tokens)


def test_schedule():
    assert [compose("h2o", evict_every=3).plan(torch.tensor([9]), 2).evicts_after(s) for s in range(6)] == \
        [False, False, True] * 2
    plan = compose("snapkv", budget=0.5).plan(torch.tensor([9]), 2)
    assert plan.schedule.prefill_compress and not any(plan.evicts_after(s) for s in range(4))
    assert not compose("minicache").plan(torch.tensor([9]), 2).schedule.prefill_compress


def test_bad_decisions_and_parts_are_refused():
    policy = compose("h2o", budget=0.5)
    with pytest.raises(ValueError, match="per-sequence budgets"):
        policy.plan(torch.tensor([10, 12]), 2, budget_tokens=torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="one shape"):
        LayerBudgets(torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 2))
    plan = policy.plan(torch.tensor([10, 12]), 2)
    with pytest.raises(ValueError, match="storage has shape"):
        dataclasses.replace(plan, storage=LayerBudgets(*(x[:, :1] for x in plan.storage)))
    with pytest.raises(ValueError, match="different policies"):
        CompressionPlan.cat([plan, compose("h2o", budget=0.5, evict_every=2).plan(torch.tensor([3]), 2)])
    with pytest.raises(ValueError, match="head_scores"):  # a head split needs the heads' prompt scores
        compose("snapkv", "adakv").plan(torch.tensor([10]), 2)


# --- head budgets ----------------------------------------------------------------------------------------
def test_head_budgets_split_each_compressed_layer():
    policy = compose("snapkv", "adakv", budget=0.3, snapkv={"window": 2})
    g = torch.Generator().manual_seed(0)
    lens = [20, 3]
    scores = {(l, j): torch.rand(3, lens[j], generator=g) for l in range(2) for j in range(2)}
    plan = policy.plan(torch.tensor(lens), 2, head_scores=lambda l, j: scores[l, j])
    assert plan.head_budgets is not None and plan.head_budgets.shape == (2, 2, 3)
    for l in range(2):
        B, sink, recent = (int(x[l, 0]) for x in plan.layers)
        assert plan.head_budgets[l, 0].tolist() == policy.head_budgets(scores[l, 0], B, sink, recent).tolist()
        assert plan.head_budgets[l, 1].tolist() == [int(plan.layers.budgets[l, 1])] * 3  # fits: no split
    rows = plan.rows  # one column per (sequence, KV head)
    assert rows.budgets.shape == (2, 6) and torch.equal(rows.budgets, plan.head_budgets.reshape(2, 6))
    assert torch.equal(rows.n_sink, plan.layers.n_sink.repeat_interleave(3, dim=1))


# --- the caches consume it -------------------------------------------------------------------------------
@given(lens=st.lists(st.integers(1, 19), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       spec=st.sampled_from([dict(p="squeeze+h2o", budget=0.4), dict(p="pyramid+snapkv", budget=6)]))
def test_both_paged_caches_take_the_same_plan(lens, seed, spec):
    """``PagedKVCache`` and ``HeadPagedKVCache`` (every head keeping the layer's budget) take the policy's
    plan for the same prompts and statistics: the same layer budgets, every head holding its layer's."""
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    run = FakeRun(3, 2, 2, 4, lens, 2, seed=seed)
    paged = run.cache(policy)
    heads = HeadPagedKVCache(n_layers=3, n_kv_heads=2, head_dim=4, n_q_heads=4, max_batch=len(lens),
                             max_tokens=max(lens) + 2, page_size=4, device=DEVICE, policy=policy)
    cos = torch.rand(3, len(lens), generator=torch.Generator().manual_seed(seed))
    for cache in (paged, heads):
        cache.start(lens, 2)
        for b in range(len(lens)):
            for l in range(3):
                cache.prefill_layer(l, b, *run.prompt[l][b], run.positions(b), scale=run.scale)
                cache.record_cos_sim(l, b, float(cos[l, b]))
        cache.finish_prefill()
    want = policy.plan(torch.tensor(lens), 3, LayerStats(cos_sim=cos), max_new_tokens=2)
    for x, y in zip(paged.plan.storage, want.storage):
        assert torch.equal(x, y)
    for x, y in zip(heads.plan.storage, want.storage):
        assert torch.equal(x, y)
    assert torch.equal(heads.plan.rows.budgets, want.storage.budgets.repeat_interleave(2, dim=1))
    rep = paged.report()
    assert rep.layer_budgets == tuple(tuple(row) for row in want.storage.budgets.tolist())
    assert heads.report().layer_budgets == rep.layer_budgets


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", [dict(p="squeeze+h2o+minicache", budget=0.5, evict_every=2),
                                  dict(p="pyramid+snapkv", budget=6)], ids=lambda s: s["p"])
def test_a_transformers_model_and_kvmodels_own_take_the_same_plan(spec, monkeypatch):
    """The transformers model on the paged cache (``kvmodels.hf``, its layers observed through forward hooks)
    and kvmodels' own Llama on the same weights and prompts: the cache acts on equal plans (SqueezeAttention's
    cos-sim read at either observation point)."""
    pytest.importorskip("transformers")
    import kvmodels.cache as kcache
    from hf_models import model_of, prompts
    from kvmodels.generate import generate
    from kvmodels.hf import wrap_transformers
    from kvmodels.loading import from_transformers

    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    model = model_of("llama", "sdpa", 4)
    batch = prompts([14, 9], seed=7)
    plans = []

    class Recording(kcache.PagedKVCache):
        def finish_prefill(self) -> None:
            super().finish_prefill()
            plans.append(self.plan)

    monkeypatch.setattr(kcache, "PagedKVCache", Recording)
    wrapped = generate(wrap_transformers(model), batch, 8, policy)
    generate(from_transformers(model), batch, 8, policy)
    got, want = plans
    assert got.layout == want.layout
    for part in ("layers", "storage", "joint"):
        for x, y in zip(getattr(got, part), getattr(want, part)):
            assert torch.equal(x, y), part
    assert wrapped.report.layer_budgets == tuple(tuple(row) for row in want.storage.budgets.tolist())


@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=3), new=st.integers(0, 8),
       windows=st.lists(st.sampled_from([0, 2, 5, 33]), min_size=4, max_size=4),
       spec=st.sampled_from(["full", "h2o", "streaming(sinks=2)", "squeeze+keyformer", "snapkv"]))
def test_sliding_windows_keep_their_last_tokens_and_leave_the_rest_to_the_policy(lens, new, windows, spec):
    """A layer of window ``W`` keeps its last ``min(W - 1, capacity)`` tokens, all forced recent, no sinks,
    whatever the policy; the other layers' budgets and forced counts are the plan without windows'."""
    first, *rest = spec.split("+")
    policy = compose(first, *rest, budget=0.3)
    prompt = torch.tensor(lens)
    stats = LayerStats(cos_sim=torch.linspace(0.1, 0.9, 4)[:, None].expand(4, len(lens)).contiguous())
    plain = policy.plan(prompt, 4, stats, max_new_tokens=new)
    plan = policy.plan(prompt, 4, stats, max_new_tokens=new, windows=windows)
    assert plan.windows == (tuple(windows) if any(windows) else ())
    assert plan.sliding == tuple(l for l, w in enumerate(windows) if w)
    for l, w in enumerate(windows):
        got, want = plan.storage.row(l), plain.storage.row(l)
        if w:
            keep = torch.minimum(prompt + new, torch.tensor(w - 1)).clamp_min(1)
            assert got[0].tolist() == keep.tolist() == got[2].tolist() and got[1].tolist() == [0] * len(lens)
        else:
            assert all(a.tolist() == b.tolist() for a, b in zip(got, want, strict=True))
    assert plan.schedule == plain.schedule  # the windows' own eviction is every step, whatever it says
    joined = CompressionPlan.cat([
        policy.plan(prompt[i:i + 1], 4, LayerStats(cos_sim=stats.cos_sim[:, i:i + 1]), max_new_tokens=new,
                    windows=windows) for i in range(len(lens))])
    assert joined.windows == plan.windows and torch.equal(joined.storage.budgets, plan.storage.budgets)


@pytest.mark.parametrize("windows,needle", [
    ((5, 0), "windows has 2 entries for 4 cache layers"),
    ((5, 1, 0, 0), "windows[1] = 1"),
    ((5, -2, 0, 0), "windows[1] = -2"),
    ((5, 2.5, 0, 0), "windows[1] = 2.5"),
    ((5, True, 0, 0), "windows[1] = True"),
    ("5555", "windows must be a sequence of ints"),
])
def test_bad_windows_are_refused_naming_the_entry(windows, needle):
    with pytest.raises(ValueError) as err:
        compose("h2o", budget=0.5).plan(torch.tensor([10]), 4, windows=windows)
    assert needle in str(err.value)
    for spec, what in (("snapkv+minicache", "'minicache' is not supported"), ("snapkv+adakv", "'adakv'")):
        with pytest.raises(ValueError, match="sliding-window layers") as err:
            compose(*spec.split("+"), budget=0.5).plan(torch.tensor([10]), 4, windows=(5, 0, 5, 0),
                                                       head_scores=lambda l, j: torch.ones(2, 10))
        assert what in str(err.value)
