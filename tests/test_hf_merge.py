"""MiniCache layer merging in the transformers bridge (kvpolicies.hf), on tiny random 4-layer models.

Oracles:
* the in-house cache (kvmodels' ``PagedKVCache``, docs/contract.md §5.1): for the same weights, prompts and
  policy, the bridge generates the same tokens and each layer attends over the same region slots
  (positions, per-head visibility) with the same restored K/V (``layer_contents``);
* the merge kernel's reference on the model's own prompt K/V: a shared slot restores to
  ``merge_restore(magnitude_direction_merge_ref(k_a, k_b))``, a retained token is stored exactly, and the
  retained tokens are those of largest angle (independent of kvmodels' region-building code);
* the unmerged bridge: retaining every token must generate exactly what the policy without merging does;
* byte arithmetic: a region holds ``n_slots * (2 * D * 4 + 4 * 4 + 1)`` bytes per (sequence, KV head);
* the same sequences generated one by one (left-padded batches).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from kvkernels.merge import magnitude_direction_merge_ref, merge_region, merge_restore  # noqa: E402
from kvpolicies import compose  # noqa: E402
from kvpolicies.base import MergePolicy  # noqa: E402
from kvpolicies.hf import PolicyCache, compressed, hf_cache  # noqa: E402
from test_hf_bridge import NEW, left_pad, prompts, run, smollm2_hf  # noqa: E402
from test_hf_bridge import model_of as bridge_model_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N_LAYERS = 4  # minicache's default start=0.5 merges the pair (2, 3); start=0.0 merges (0, 1) and (2, 3)


def model_of(kind: str, attn: str = "sdpa") -> torch.nn.Module:
    return bridge_model_of(kind, attn, N_LAYERS)


def contents(cache: PolicyCache, b: int) -> list[dict[str, torch.Tensor]]:
    return [cache.layer_contents(l, b) for l in range(len(cache.layers))]


def assert_same_contents(got: dict, want: dict, where: str, atol: float = 1e-5) -> None:
    assert got["pos"].tolist() == want["pos"].long().tolist(), where
    assert ("visible" in got) == ("visible" in want), where
    if "visible" in want:
        assert torch.equal(got["visible"], want["visible"]), where
    torch.testing.assert_close(got["k"], want["k"], rtol=1e-5, atol=atol, msg=where)
    torch.testing.assert_close(got["v"], want["v"], rtol=1e-5, atol=atol, msg=where)


# --- the same regions and tokens as the in-house cache --------------------------------------------------
_IN_HOUSE: dict[int, torch.nn.Module] = {}


def in_house(model: torch.nn.Module, batch: list[list[int]], policy, monkeypatch, new: int = NEW):
    """kvmodels on the same weights: (tokens, layer_contents[b][layer]) taken before pages are returned."""
    import kvmodels.cache as kcache
    from kvmodels.generate import generate
    from kvmodels.gptj import GPTJ
    from kvmodels.loading import from_transformers
    from kvmodels.mpt import MPT

    snap: dict[int, list[dict[str, torch.Tensor]]] = {}

    class Recording(kcache.PagedKVCache):
        def finish_sequence(self, b: int) -> None:
            snap[b] = [self.layer_contents(l, b) for l in range(self.n_layers)]
            super().finish_sequence(b)

    monkeypatch.setattr(kcache, "PagedKVCache", Recording)
    if id(model) not in _IN_HOUSE:
        build = {"GPTJForCausalLM": GPTJ.from_hf, "MptForCausalLM": MPT.from_hf}.get(
            type(model).__name__, from_transformers
        )
        _IN_HOUSE[id(model)] = build(model)
    result = generate(_IN_HOUSE[id(model)], batch, new, policy)
    return result.tokens, [snap[b] for b in range(len(batch))]


IN_HOUSE_POLICIES = [
    dict(p="minicache"),  # full eviction: the whole prompt merges, decode tokens stay private
    dict(p="minicache", minicache=dict(start=0.0, retain_ratio=0.2)),  # two pairs, layer 0 included
    dict(p="squeeze+h2o+minicache", budget=0.5, evict_every=2),  # joint selection, region eviction
    dict(p="keyformer+minicache", budget=0.5, seed=3),  # Gumbel noise indexed by region slot
    dict(p="tova+minicache", budget=0.75, minicache=dict(retain_ratio=0.3, t=0.3)),  # replaced scores
]


@pytest.mark.parametrize(
    "kind,attn", [("llama", "sdpa"), ("llama", "eager"), ("gptj", "eager"), ("mpt", "eager")]
)
@pytest.mark.parametrize(
    "spec",
    IN_HOUSE_POLICIES,
    ids=lambda s: s["p"] + ("-2pairs" if s.get("minicache", {}).get("start") == 0.0 else ""),
)
def test_regions_and_tokens_equal_in_house(kind, attn, spec, monkeypatch):
    check_against_in_house(kind, attn, spec, monkeypatch)


def test_two_compressed_pairs_equal_in_house(monkeypatch):
    """Two pairs merged after prompt compression: the second merge leaves the first region alone (kvmodels
    once used a magnitude pool as scratch for the pair's scores and broke this)."""
    check_against_in_house("llama", "sdpa", dict(p="h2o+minicache", budget=0.5, minicache=dict(start=0.0)),
                           monkeypatch)


def check_against_in_house(kind: str, attn: str, spec: dict, monkeypatch) -> None:
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    model = model_of(kind, attn)
    batch = prompts([14, 9], seed=7)
    tokens, cache = run(model, batch, policy)
    ref_tokens, ref = in_house(model, batch, policy, monkeypatch)
    for b in range(len(batch)):
        for l, (got, want) in enumerate(zip(contents(cache, b), ref[b])):
            assert_same_contents(got, want, f"sequence {b} layer {l}")
    assert tokens == ref_tokens
    rep = cache.report()
    assert rep.merged_pairs and all(rep.tokens_per_layer[b].sum() == 0 for _, b in rep.merged_pairs)
    # Not vacuous: restored (shared) slots, visible to both layers, are compared.
    a, b = rep.merged_pairs[0]
    both = [contents(cache, i)[a]["visible"] & contents(cache, i)[b]["visible"] for i in range(len(batch))]
    assert any(x.any() for x in both)


# --- restored slots == the merge kernel on the model's own K/V -----------------------------------------
def prompt_kv(model: torch.nn.Module, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the prompt's K/V ``[B, Hkv, Lpad, D]`` from a plain forward (left-padded)."""
    ids, mask = left_pad(batch)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate derives them; a bare forward would not
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.integers(1, 16), min_size=1, max_size=3),
    eviction=st.sampled_from(["full", "h2o", "snapkv"]),
    start=st.sampled_from([0.0, 0.5]),
    t=st.floats(0.0, 1.0),
    retain_ratio=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 99),
)
def test_restored_slots_equal_the_merge_kernel(lens, eviction, start, t, retain_ratio, seed):
    """Right after the merge, per (sequence, pair, KV head): every kept prompt token is one shared slot
    that restores to ``merge_restore(magnitude_direction_merge_ref(...))`` of the two layers' originals, or,
    for the ``ceil(retain_ratio * N)`` tokens of largest ``max(theta_K, theta_V)``, one exact private slot
    per layer (``a``'s first); both layers keep the same tokens."""
    model = model_of("llama")
    batch = prompts(lens, seed=seed)
    options = {"snapkv": dict(window=2, kernel=3)} if eviction == "snapkv" else {}
    minicache = dict(start=start, t=t, retain_ratio=retain_ratio)
    policy = compose(eviction, "minicache", budget=0.5, minicache=minicache, **options)
    _, cache = run(model, batch, policy, new=1)  # the prompt only
    rep = cache.report()  # ends the prefill: budgets, merge, compression
    assert rep.merged_pairs == tuple(policy.merge.pairs(N_LAYERS))
    originals = prompt_kv(model, batch)  # [layer] -> (K, V) [B, Hkv, Lpad, D]
    width = max(lens)
    for a, b in cache.merged_pairs:
        for i, L in enumerate(lens):
            ca, cb = cache.layer_contents(a, i), cache.layer_contents(b, i)
            assert torch.equal(ca["pos"], cb["pos"])  # one region, read by both layers
            for h in range(ca["pos"].shape[1]):
                pos = ca["pos"][:, h]
                assert pos.tolist() == sorted(pos.tolist())  # token order
                kept = sorted(set(pos.tolist()))
                N = len(kept)
                want_n = L if eviction == "full" else min(L, int(rep.layer_budgets[a, i]) // 2)
                assert N == want_n
                cols = torch.tensor(kept) + width - L  # their columns in the left-padded prompt
                # x[which][m]: [N, 1, D] originals of member m (0 = a, 1 = b); which 0 = K, 1 = V
                x = [[originals[l][which][i, h, cols][:, None] for l in (a, b)] for which in (0, 1)]
                restored, angles = [], []
                for xa, xb in x:
                    direction, mag_a, mag_b, _ = magnitude_direction_merge_ref(xa, xb, t=t, retain_ratio=0.0)
                    restored.append([merge_restore(direction, m)[:, 0] for m in (mag_a, mag_b)])
                    ua, ub = (torch.nn.functional.normalize(v[:, 0], dim=-1) for v in (xa, xb))
                    angles.append(torch.acos((ua * ub).sum(-1).clamp(-1, 1)))
                theta = torch.maximum(*angles)  # [N]
                slots = [(pos == tok).nonzero().flatten().tolist() for tok in kept]
                retained = [j for j in range(N) if len(slots[j]) == 2]
                shared = [j for j in range(N) if len(slots[j]) == 1]
                assert len(retained) + len(shared) == N
                assert len(retained) == min(N, math.ceil(round(retain_ratio * N, 9)))
                if retained and shared:  # the retained tokens are those of largest angle
                    assert theta[retained].min() >= theta[shared].max() - 1e-5
                for j in retained:  # a's private slot then b's, the exact originals, each seen by its layer
                    for m, (s, c) in enumerate(zip(slots[j], (ca, cb))):
                        assert c["visible"][s, h] and not (cb, ca)[m]["visible"][s, h]
                        assert torch.equal(c["k"][s, h], x[0][m][j, 0])
                        assert torch.equal(c["v"][s, h], x[1][m][j, 0])
                for j in shared:
                    s = slots[j][0]
                    for m, c in enumerate((ca, cb)):
                        assert c["visible"][s, h]
                        for which, name in ((0, "k"), (1, "v")):
                            want = restored[which][m][j]
                            torch.testing.assert_close(c[name][s, h], want, rtol=1e-5, atol=1e-6)


# --- memory: one region per pair, counted once ----------------------------------------------------------
def test_bytes_of_a_merged_pair_follow_the_formula_and_are_less_than_unmerged():
    model = model_of("llama")
    batch = prompts([20, 13], seed=2)
    ratio = 0.25
    _, plain = run(model, batch, compose("full"))
    _, merged = run(model, batch, compose("minicache", minicache=dict(retain_ratio=ratio)))
    rep_p, rep_m = plain.report(), merged.report()
    assert rep_m.merged_pairs == ((2, 3),)
    hkv, D, elt = 2, 16, 4
    # Per sequence: each prompt token once, the retained ones twice, and each decode step's 2 private slots.
    slots = [L + math.ceil(ratio * L) + 2 * (NEW - 1) for L in map(len, batch)]
    assert rep_m.tokens_per_layer[2].tolist() == slots and rep_m.tokens_per_layer[3].tolist() == [0, 0]
    per_slot = 2 * D * elt + 4 * 4 + 1  # K and V, four float32 magnitudes, one uint8 mask (per KV head)
    assert int(rep_m.bytes_per_layer[2]) == len(batch) * hkv * max(slots) * per_slot
    assert int(rep_m.bytes_per_layer[3]) == 0
    assert rep_m.bytes_per_layer[:2].tolist() == rep_p.bytes_per_layer[:2].tolist()  # unmerged layers
    pair_plain = int(rep_p.bytes_per_layer[2:].sum())
    assert pair_plain == 2 * len(batch) * hkv * (max(map(len, batch)) + NEW - 1) * 2 * D * elt
    assert int(rep_m.bytes_per_layer[2:].sum()) < pair_plain
    assert rep_m.total_bytes == int(rep_m.bytes_per_layer.sum()) and rep_m.peak_bytes >= rep_m.total_bytes


def test_pair_budget_is_the_sum_of_both_layers_and_eviction_holds_it():
    model = model_of("llama")
    batch = prompts([24, 15], seed=6)
    every = 3
    policy = compose("h2o", "minicache", budget=0.25, evict_every=every)
    unmerged = compose("h2o", budget=0.25, evict_every=every)
    _, cache = run(model, batch, policy)
    _, ref = run(model, batch, unmerged)
    rep, rep_ref = cache.report(), ref.report()
    budgets = rep_ref.layer_budgets
    assert rep.layer_budgets[2].tolist() == (budgets[2] + budgets[3]).tolist()
    assert rep.layer_budgets[3].tolist() == [0, 0]
    assert rep.layer_budgets.sum() == budgets.sum()  # conserved
    # A region holds at most R + 2 * (evict_every - 1) slots between steps (budget + evict_every - 1 a layer).
    assert (rep.tokens_per_layer[2] <= rep.layer_budgets[2] + 2 * (every - 1)).all()
    assert (rep.tokens_per_layer[2] > rep.layer_budgets[2] // 2).all()  # more than one layer's worth


# --- retaining every token == no merging -----------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        dict(p="full"),
        dict(p="streaming", budget=6, evict_every=2, streaming=dict(sinks=2)),
        dict(p="window", budget=5),
    ],
    ids=lambda s: s["p"],
)
@pytest.mark.parametrize("kind", ["llama", "mpt"])
def test_retaining_every_token_equals_no_merging(kind, spec):
    """retain_ratio=1 keeps both layers' originals privately: attention, selection and tokens are exactly
    the unmerged policy's (forced sinks/recent slots count both layers' private slots)."""
    spec = dict(spec)
    name = spec.pop("p")
    model = model_of(kind, "sdpa" if kind == "llama" else "eager")
    batch = prompts([15, 8, 11], seed=9)
    want, plain = run(model, batch, compose(name, **spec))
    everything = dict(retain_ratio=1.0, t=0.7)
    got, merged = run(model, batch, compose(name, "minicache", minicache=everything, **spec))
    assert got == want
    for i in range(len(batch)):
        for l in (2, 3):  # the merged pair: each layer sees exactly its unmerged tokens and K/V
            mine, ref = merged.layer_contents(l, i), plain.layer_contents(l, i)
            for h in range(ref["pos"].shape[1]):
                seen = mine["visible"][:, h]
                assert mine["pos"][seen, h].tolist() == ref["pos"][:, h].tolist()
                # Prompt slots bit for bit; decode tokens to rounding (their hidden states went through
                # attention calls with a differently shaped mask, so a different summation order).
                prompt = ref["pos"][:, h] < len(batch[i])
                assert torch.equal(mine["k"][seen, h][prompt], ref["k"][prompt, h])
                torch.testing.assert_close(mine["k"][seen, h], ref["k"][:, h], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine["v"][seen, h], ref["v"][:, h], rtol=1e-5, atol=1e-6)
    if name == "full":
        assert got == run(model, batch)[0]  # and plain generate


# --- batched == one by one ------------------------------------------------------------------------------
BATCH_POLICIES = [
    dict(p="minicache", minicache=dict(start=0.0)),
    dict(p="h2o+minicache", budget=0.5, evict_every=2, minicache=dict(retain_ratio=0.2)),
    dict(p="pyramid+tova+minicache", budget=6, minicache=dict(start=0.0, t=0.25)),
]


@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.integers(1, 15), min_size=2, max_size=3),
    spec=st.sampled_from(BATCH_POLICIES),
    kind=st.sampled_from(["llama", "gptj", "mpt"]),
    seed=st.integers(0, 99),
)
def test_batched_equals_one_by_one(lens, spec, kind, seed):
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    model = model_of(kind, "sdpa" if kind == "llama" else "eager")
    batch = prompts(lens, seed=seed)
    # A prompt that opens with one token repeated ([62, 62]) has bit-equal hidden states at those positions
    # (each attends over equal keys and values), so their merge angles tie exactly and the batch's rounding
    # (1 ulp) decides which of them is retained: both answers are right, the comparison is not defined.
    assume(all(p[0] != p[1] for p in batch if len(p) > 1))
    tokens, cache = run(model, batch, policy)
    for i, p in enumerate(batch):
        alone_tokens, alone = run(model, [p], policy)
        assert tokens[i] == alone_tokens[0], f"sequence {i}"
        for l, (got, want) in enumerate(zip(contents(cache, i), contents(alone, 0))):
            assert_same_contents(got, want, f"sequence {i} layer {l}", atol=1e-5)


def test_context_manager_merges():
    model = model_of("llama")
    batch = prompts([10, 6], seed=4)
    policy = compose("h2o", "minicache", budget=0.5)
    explicit, cache = run(model, batch, policy)
    with compressed(model, policy) as caches:
        ids, mask = left_pad(batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert out[:, ids.shape[1] :].tolist() == explicit
    assert caches[0].report().bytes_per_layer.tolist() == cache.report().bytes_per_layer.tolist()


# --- what stays refused -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Pairs(MergePolicy):
    """A merge policy of its own: fixed pairs, a region with its own retention and no ``t``/``retain_ratio``
    fields for a cache to read."""

    fixed: tuple = ((0, 1),)
    keep: float = 0.05

    def pairs(self, n_layers: int) -> list[tuple[int, int]]:
        return list(self.fixed)

    def region(self, *tokens):
        return merge_region(*tokens, t=0.5, retain_ratio=self.keep)


def test_both_caches_store_the_merge_policys_region(monkeypatch):
    """The caches store what the merge policy's ``region`` returns: a region retaining every token keeps
    each layer's exact K/V in private slots, so both caches generate what the unmerged cache generates,
    and the bridge's regions equal kvmodels'. Mutation: a cache merging with MiniCache's own defaults
    (retain 5%) instead of calling ``region`` changes the regions."""
    model = model_of("llama")
    batch = prompts([10, 6], seed=4)
    exact = dataclasses.replace(compose("full"), merge=_Pairs(keep=1.0))
    tokens, cache = run(model, batch, exact)
    ref_tokens, ref = in_house(model, batch, exact, monkeypatch)
    plain, _ = run(model, batch, compose("full"))
    assert cache.merged_pairs == [(0, 1)]
    assert tokens == ref_tokens == plain
    for b in range(len(batch)):
        got = contents(cache, b)
        assert not bool(got[0]["visible"].all())  # private slots only: nothing is shared
        for l, (g, w) in enumerate(zip(got, ref[b])):
            assert_same_contents(g, w, f"sequence {b} layer {l}")


def test_unusable_merge_policies_are_refused():
    model = model_of("llama")
    base = compose("h2o", budget=0.5)
    with pytest.raises(TypeError, match="defines pairs but not region"):
        class _NoRegion(MergePolicy):  # pairs layers without saying how a pair is stored
            def pairs(self, n_layers: int) -> list[tuple[int, int]]:
                return [(0, 1)]
    with pytest.raises(ValueError, match="disjoint and in range"):
        hf_cache(dataclasses.replace(base, merge=_Pairs(((0, 1), (1, 2)))), model)
    with pytest.raises(ValueError, match="disjoint and in range"):
        hf_cache(dataclasses.replace(base, merge=_Pairs(((3, 4),))), model)


# --- the real checkpoint ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_minicache_equals_in_house(monkeypatch):
    """SmolLM2-135M (30 layers: 7 merged pairs, GQA 3:1): the same tokens and regions as kvmodels."""
    model, batch = smollm2_hf(monkeypatch)
    policy = compose("minicache", minicache=dict(retain_ratio=0.1))
    tokens, cache = run(model, batch, policy, new=6)
    ref_tokens, ref = in_house(model, batch, policy, monkeypatch, new=6)
    assert len(cache.merged_pairs) == 7
    for b in range(len(batch)):
        for l, (got, want) in enumerate(zip(contents(cache, b), ref[b])):
            assert_same_contents(got, want, f"sequence {b} layer {l}", atol=1e-4)
    assert tokens == ref_tokens
