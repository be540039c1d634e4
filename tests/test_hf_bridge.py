"""The transformers bridge (kvpolicies.hf): a policy-driven cache inside ``model.generate``.

Checked on tiny random Llama (GQA, sdpa and eager), SmolLM2-shaped Llama (tied embeddings, 3 query heads
per KV head), GPT-J (partial rotary) and MPT (ALiBi) models, and on the real SmolLM2 checkpoint when cached:
* the ``full`` policy reproduces plain ``generate`` token for token;
* a left-padded batch generates, and keeps, exactly what each sequence does alone;
* for the same inputs, policy and seed, the tokens kept per (layer, sequence, KV head) equal those the
  in-house models (kvmodels) keep, and so do the generated tokens (Keyformer included: same noise);
* the bridge's selection is ``kvkernels.topk_compact.topk_compact_ref``'s (forced slots, top scores, ties to
  the earlier token), on ragged left-padded rows;
* the cache is physically compacted (``[B, Hkv, kept, D]``, never expanded to query heads);
* unsupported models / attention implementations / policies fail with errors that say what to change.
MiniCache merging (merge policies) is tested in tests/test_hf_merge.py.

Runtime: the models are a few thousand parameters, so torch runs them on one thread (multi-threaded
kernels on matrices this small spend their time waking threads: 20x slower on a busy 2-core machine).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from kvpolicies import compose  # noqa: E402
from kvpolicies.hf import PolicyCache, UnsupportedModelError, compressed, hf_cache  # noqa: E402

V = 96
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str, attn: str = "sdpa", n_layers: int = 3) -> torch.nn.Module:
    """A tiny random ``kind`` model (``smollm2``: SmolLM2's shape in miniature, 2 layers)."""
    torch.manual_seed({"llama": 0, "gptj": 1, "mpt": 2, "smollm2": 3}[kind])
    if kind == "smollm2":  # SmolLM2's shape in miniature: tied embeddings, GQA 3:1, rope_theta 1e5
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            attn_implementation=attn,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            attn_implementation=attn,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gptj":
        cfg = transformers.GPTJConfig(
            vocab_size=V, n_embd=64, n_layer=n_layers, n_head=4, rotary_dim=8, n_positions=128
        )
        model = transformers.GPTJForCausalLM(cfg)
    else:
        cfg = transformers.MptConfig(
            vocab_size=V, d_model=64, n_layers=n_layers, n_heads=4, max_seq_len=128, expansion_ratio=2
        )
        model = transformers.MptForCausalLM(cfg)
    # No eos: generate(min_new_tokens=...) would mask it (Llama's eos is token 2) where kvmodels does not,
    # and every run here must produce exactly NEW tokens on both sides.
    model.generation_config.eos_token_id = None
    return model.eval().to(DEVICE)


_MODELS: dict[tuple[str, str, int], torch.nn.Module] = {}


def model_of(kind: str, attn: str = "sdpa", n_layers: int = 3) -> torch.nn.Module:
    if (kind, attn, n_layers) not in _MODELS:
        _MODELS[kind, attn, n_layers] = tiny(kind, attn, n_layers)
    return _MODELS[kind, attn, n_layers]


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros(len(batch), width, dtype=torch.int64)
    for b, p in enumerate(batch):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def run(model: torch.nn.Module, batch: list[list[int]], policy=None, new: int = NEW):
    """Greedy generate; returns (new tokens per sequence, cache or None)."""
    ids, mask = left_pad(batch)
    cache = None if policy is None else policy.hf_cache(model, max_new_tokens=new)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            past_key_values=cache,
            pad_token_id=0,
            use_cache=True,
        )
    return out[:, ids.shape[1] :].tolist(), cache


def kept(cache: PolicyCache, b: int) -> list[list[list[int]]]:
    """[layer][kv head] -> sorted original positions kept by sequence b."""
    return [cache.kept_positions(l, b).tolist() for l in range(len(cache.layers))]


# --- full policy == plain generate -----------------------------------------------------------
@pytest.mark.parametrize(
    "kind,attn",
    [("llama", "sdpa"), ("llama", "eager"), ("smollm2", "sdpa"), ("gptj", "eager"), ("mpt", "eager")],
)
def test_full_policy_equals_plain_generate(kind, attn):
    model = model_of(kind, attn)
    batches = [prompts([11])] if kind == "mpt" else [prompts([11]), prompts([11, 6, 9], seed=1)]
    for batch in batches:
        plain, _ = run(model, batch)
        ours, cache = run(model, batch, compose("full"))
        assert ours == plain
        # full keeps every real token (padding is never counted) in every layer
        rep = cache.report()
        assert rep.tokens_per_layer.tolist() == [[len(p) + NEW - 1 for p in batch]] * len(cache.layers)


def test_mpt_padded_batch_full_policy_equals_each_alone():
    """Plain MPT generate is wrong on padded rows once a Cache is passed (design notes §9); ours is not."""
    model = model_of("mpt", "eager")
    batch = prompts([11, 5, 8], seed=3)
    ours, _ = run(model, batch, compose("full"))
    assert ours == [run(model, [p])[0][0] for p in batch]


# --- batched == one by one ---------------------------------------------------------------------
POLICIES = [
    dict(p="squeeze+tova", budget=0.5),
    dict(p="pyramid+scissorhands", budget=0.5, evict_every=3),
    dict(p="a2sf", budget=0.4, evict_every=2),
]


@pytest.mark.parametrize("kind", ["llama", "smollm2", "gptj", "mpt"])
@pytest.mark.parametrize("spec", POLICIES, ids=lambda s: s["p"])
def test_batched_equals_one_by_one(kind, spec):
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    model = model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")
    batch = prompts([13, 7], seed=5)
    tokens, cache = run(model, batch, policy)
    for b, p in enumerate(batch):
        alone_tokens, alone = run(model, [p], policy)
        assert tokens[b] == alone_tokens[0], f"sequence {b}"
        assert kept(cache, b) == kept(alone, 0), f"sequence {b}"


# --- kept tokens == the in-house models' ---------------------------------------------------
_IN_HOUSE: dict[int, torch.nn.Module] = {}


def in_house(model: torch.nn.Module, batch: list[list[int]], policy, monkeypatch, new: int = NEW):
    """Generate with kvmodels (eager) on the same weights: (tokens, kept[b][layer][head] positions)."""
    import kvmodels.cache as kcache
    from kvmodels.generate import generate
    from kvmodels.gptj import GPTJ
    from kvmodels.loading import from_transformers
    from kvmodels.mpt import MPT

    snap: dict[int, list[list[list[int]]]] = {}

    class Recording(kcache.PagedKVCache):
        def finish_sequence(self, b: int) -> None:  # snapshot before the pages go back to the pool
            snap[b] = [self.layer_contents(l, b)["pos"].t().tolist() for l in range(self.n_layers)]
            super().finish_sequence(b)

    monkeypatch.setattr(kcache, "PagedKVCache", Recording)
    if id(model) not in _IN_HOUSE:  # one conversion per model
        build = {"GPTJForCausalLM": GPTJ.from_hf, "MptForCausalLM": MPT.from_hf}.get(
            type(model).__name__, from_transformers
        )
        _IN_HOUSE[id(model)] = build(model)
    result = generate(_IN_HOUSE[id(model)], batch, new, policy)  # seed=0, as hf_cache's default
    return result.tokens, [snap[b] for b in range(len(batch))]


IN_HOUSE_POLICIES = [
    dict(p="keyformer", budget=0.5, seed=3),  # Gumbel noise at prefill (hash) and decode (generator)
    dict(p="squeeze+h2o", budget=0.5),  # cos-sim layer budgets, accumulated scores
    dict(p="snapkv", budget=0.5, snapkv=dict(window=4, kernel=3)),  # pooled prompt votes, ties
    dict(p="chunkkv", budget=0.5, chunkkv=dict(window=4, chunk=3, per_head=False)),  # one selection per layer
    dict(p="snapkv", budget=0.5, snapkv=dict(window=4, chunk=2, align="scores")),  # chunks placed on votes
    dict(p="pyramid+tova", budget=6, evict_every=2),  # int budget, evict every other step
    dict(p="streaming", budget=5),
    dict(p="knorm", budget=0.5),  # the open score hook: each token's score from its own key
]


def assert_bridge_keeps_what_kvmodels_keeps(kind: str, policy, monkeypatch) -> None:
    """The bridge and kvmodels on the same weights and batch: same tokens, same kept positions per
    (sequence, layer, head), and (for a compressing policy) something was evicted."""
    model = model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")
    batch = prompts([14, 9], seed=7)
    tokens, cache = run(model, batch, policy)
    ref_tokens, ref_kept = in_house(model, batch, policy, monkeypatch)
    assert tokens == ref_tokens
    for b in range(len(batch)):
        assert kept(cache, b) == ref_kept[b], f"sequence {b}"
    if policy.eviction.name != "full":  # the comparison is not vacuous: something was evicted
        assert cache.report().tokens_per_layer.max() < len(batch[0]) + NEW - 1


@pytest.mark.parametrize("kind", ["llama", "smollm2", "gptj", "mpt"])
@pytest.mark.parametrize("spec", IN_HOUSE_POLICIES, ids=lambda s: s["p"])
def test_kept_tokens_equal_in_house(kind, spec, monkeypatch):
    spec = dict(spec)
    assert_bridge_keeps_what_kvmodels_keeps(kind, compose(spec.pop("p"), **spec), monkeypatch)


# --- selection == kvkernels.topk_compact.topk_compact_ref -----------------------------------
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_selection_equals_topk_compact_ref(data):
    """PolicyLayer.compact keeps, per (sequence, KV head), what topk_compact_ref keeps on a paged pool."""
    from kvkernels.topk_compact import topk_compact_ref

    B, H, N = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9))
    D, S = 2, 4  # head dim, page size of the reference pool
    counts = [data.draw(st.integers(0, N)) for _ in range(B)]
    left_padded = data.draw(st.booleans())  # prompt rows (real tokens at the end) or compacted rows (front)
    valid = torch.zeros(B, N, dtype=torch.bool)
    for b, c in enumerate(counts):
        valid[b, slice(N - c, N) if left_padded else slice(0, c)] = True
    # Few distinct values, so ties are common; NaN ranks lowest in both.
    values = st.sampled_from([0.0, 0.5, 1.0, 2.0, float("nan")])
    scores = torch.tensor([[[data.draw(values) for _ in range(N)] for _ in range(H)] for _ in range(B)])
    budgets, n_sink, n_recent = [], [], []
    for _ in range(B):
        budgets.append(data.draw(st.integers(1, N)))
        n_sink.append(data.draw(st.integers(0, budgets[-1])))
        n_recent.append(data.draw(st.integers(0, budgets[-1] - n_sink[-1])))
    keys = torch.randn(B, H, N, D)

    # The bridge's layer: [B, H, N] slots, original position = index among the row's valid slots.
    layer = hf_cache(compose("h2o", budget=0.5), model_of("llama")).layers[0]
    logical = (valid.cumsum(-1) - 1)[:, None, :].expand(B, H, N)  # [B, H, N]
    layer.keys, layer.values, layer.scores, layer.valid = keys, -keys, scores, valid
    layer.positions = torch.where(valid[:, None, :], logical, -1)
    layer.compact(*(torch.tensor(x) for x in (budgets, n_sink, n_recent)))

    # The reference on a paged pool: each row's valid slots, in order, from page 0 of its own pages.
    M = -(-N // S)
    k_pages = torch.zeros(B * M, S, H, D)
    slot_pos = torch.zeros(B * M, S, H, dtype=torch.int32)
    slot_score = torch.zeros(B * M, S, H)
    page_table = torch.arange(B * M, dtype=torch.int32).view(B, M)
    for b in range(B):
        row = valid[b]
        flat = slice(b * M * S, b * M * S + counts[b])
        k_pages.view(-1, H, D)[flat] = keys[b][:, row].transpose(0, 1)
        slot_pos.view(-1, H)[flat] = torch.arange(counts[b], dtype=torch.int32)[:, None]
        slot_score.view(-1, H)[flat] = scores[b][:, row].t()
    seq_lens = torch.tensor(counts, dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    topk_compact_ref(
        k_pages, k_pages.clone(), slot_pos, slot_score, page_table, seq_lens, i32(budgets), i32(n_sink),
        i32(n_recent), torch.zeros(B * M + 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    )
    for b in range(B):
        n = int(seq_lens[b])
        assert int(layer.valid[b].sum()) == n
        ref_pos = slot_pos.view(B, M * S, H)[b, :n].t()  # [H, n]
        ref_keys = k_pages.view(B, M * S, H, D)[b, :n].transpose(0, 1)  # [H, n, D]
        assert layer.positions[b][:, layer.valid[b]].tolist() == ref_pos.tolist(), f"sequence {b}"
        assert torch.equal(layer.keys[b][:, layer.valid[b]], ref_keys)


# --- real savings, GQA-native -----------------------------------------------------------------
def test_cache_is_compacted_and_gqa_native():
    model = model_of("llama")
    batch = prompts([20, 12], seed=2)
    policy = compose("h2o", budget=0.25, evict_every=2)
    _, cache = run(model, batch, policy)
    rep = cache.report()
    budgets = policy.budget_tokens(torch.tensor([20, 12]))  # [B]
    for l, layer in enumerate(cache.layers):
        B, hkv, n, d = layer.keys.shape
        assert (B, hkv, d) == (2, 2, 16)  # KV heads, never expanded to the 4 query heads
        # between steps a layer holds at most budget + evict_every - 1 real tokens
        assert (rep.tokens_per_layer[l] <= budgets + 1).all()
        assert n == int(layer.valid.sum(-1).max())  # no slot wider than the longest kept row
        assert rep.bytes_per_layer[l] == 2 * layer.keys.numel() * layer.keys.element_size()
    assert rep.peak_bytes >= rep.total_bytes
    full_bytes = 2 * 3 * 2 * 2 * (20 + NEW - 1) * 16 * 4  # K+V, layers, B, Hkv, longest row, D, fp32
    assert rep.total_bytes < full_bytes / 2


# --- context manager ----------------------------------------------------------------------------
def test_context_manager_matches_explicit_cache_and_uninstalls():
    model = model_of("llama")
    batch = prompts([10, 6], seed=4)
    policy = compose("squeeze+h2o", budget=0.5)
    explicit, cache = run(model, batch, policy)
    fresh = tiny("llama")  # hooks not yet installed on this one
    with compressed(fresh, policy) as caches:
        ids, mask = left_pad(batch)
        out = fresh.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert out[:, ids.shape[1] :].tolist() == explicit
    assert (
        len(caches) == 1
        and caches[0].report().tokens_per_layer.tolist() == cache.report().tokens_per_layer.tolist()
    )
    assert "_kvpolicies_hooks" not in fresh.__dict__ and "generate" not in fresh.__dict__
    assert run(fresh, batch)[0] == run(model, batch)[0]  # plain generate untouched afterwards


# --- errors ---------------------------------------------------------------------------------------
def test_unsupported_attention_implementation_is_named():
    model = tiny("llama", "sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        hf_cache(compose("h2o", budget=0.5), model)


def test_sliding_window_model_is_refused():
    cfg = transformers.MistralConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        hf_cache(compose("h2o", budget=0.5), transformers.MistralForCausalLM(cfg))


def test_policy_must_be_composed():
    from kvpolicies.eviction.h2o import H2O

    with pytest.raises(TypeError, match="compose"):
        hf_cache(H2O(), model_of("llama"))


@pytest.mark.parametrize("name", ["h2o", "keyformer", "tova", "a2sf", "scissorhands", "squeeze+snapkv"])
def test_generate_tells_the_cache_its_length(name):
    """hf_cache(policy, model) needs no max_new_tokens: generate's own (keyword or max_length) reaches the
    cache, and the run equals one given the length explicitly."""
    model = model_of("llama")
    ids, mask = left_pad(prompts([12, 9], seed=5))
    policy = compose(name, budget=0.4)
    for length in (dict(max_new_tokens=5), dict(max_length=ids.shape[1] + 5)):
        cache = policy.hf_cache(model)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, past_key_values=cache,
                                 pad_token_id=0, **length)
        assert cache.max_new_tokens == 5
        explicit, _ = run(model, prompts([12, 9], seed=5), policy, new=5)
        assert out[:, ids.shape[1]:].tolist() == explicit


def test_keyformer_by_hand_needs_max_new_tokens():
    """Outside generate nobody knows the generation length; Keyformer's schedule says what to pass."""
    model = model_of("llama")
    cache = PolicyCache(compose("keyformer", budget=0.5), model)
    ids, mask = left_pad(prompts([9]))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        nxt = torch.ones(1, 1, dtype=torch.int64, device=DEVICE)
        with pytest.raises(ValueError, match="max_new_tokens"):
            model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                  past_key_values=cache, use_cache=True)


def test_a_cache_is_driven_only_by_the_hooks_of_its_own_model():
    """Each model's hooks recognise the caches built for it: a cache passed to another model (with hooks of
    its own) is not driven by them, so its first update says how to build one instead of running on a
    family it was not set up for."""
    model, other = model_of("llama"), tiny("llama")
    policy = compose("h2o", budget=0.5)
    hf_cache(policy, other)  # hooks on the other model too
    ids, mask = left_pad(prompts([9]))
    with torch.no_grad(), pytest.raises(RuntimeError, match="not prepared by the kvpolicies hooks"):
        other(input_ids=ids, attention_mask=mask, past_key_values=hf_cache(policy, model), use_cache=True)
    cache = hf_cache(policy, other)
    with torch.no_grad():
        other(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.prefilled and cache.hooks is other._kvpolicies_hooks


def test_report_is_a_table_and_keeps_its_fields():
    model = model_of("llama")
    _, cache = run(model, prompts([20, 12], seed=2), compose("h2o", budget=0.25))
    rep = cache.report()
    text = str(rep)
    assert text.splitlines()[0].split()[:3] == ["layer", "MiB", "tokens"]
    assert len(text.splitlines()) == len(cache.layers) + 2  # header, one row per layer, the total
    assert "full = every prompt and generated token" in text and "tensor(" not in text
    # full: K+V x 3 layers x (20 + 12 prompt + 2 x 7 generated tokens) x 2 KV heads x 16 dims x fp32
    assert rep.full_cache_bytes == 2 * 3 * (20 + 12 + 2 * (NEW - 1)) * 2 * 16 * 4
    assert 0 < rep.total_bytes < rep.full_cache_bytes and rep.tokens_per_layer.shape == (3, 2)


def python_output(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (import state is the point of these tests)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_hf_is_reachable_from_the_package_lazily():
    code = (
        "import sys, kvpolicies\n"
        "assert 'transformers' not in sys.modules and 'kvpolicies.hf' not in sys.modules\n"
        "print(kvpolicies.hf.compressed.__name__, 'transformers' in sys.modules)\n"
    )
    assert python_output(code).split() == ["compressed", "True"]


def test_beam_search_is_refused():
    model = model_of("llama")
    ids, mask = left_pad(prompts([9]))
    with pytest.raises(NotImplementedError, match="beam"):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=3,
            num_beams=2,
            do_sample=False,
            past_key_values=hf_cache(compose("h2o", budget=0.5), model, max_new_tokens=3),
        )


def test_core_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvpolicies, kvkernels, kvmodels, kvmodels.cache, kvmodels.generate\n"
        "try:\n    import kvpolicies.hf\nexcept ImportError as e:\n    print('hf:', e)\n"
    )
    assert "pip install 'kvpolicies[hf]'" in python_output(code)


# --- the real checkpoint ---------------------------------------------------------------------------
def smollm2_hf(monkeypatch):
    """The bundled SmolLM2 as a transformers model (sdpa, fp32, no eos) and a two-prompt batch for it."""
    from kvmodels.loading import CheckpointError, load_checkpoint

    try:
        loaded = load_checkpoint()
    except CheckpointError as e:
        pytest.skip(str(e))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        loaded.directory, dtype=torch.float32, attn_implementation="sdpa"
    ).eval().to(DEVICE)
    # kvmodels' generate runs every row to max_new_tokens (no eos given); make transformers do the same, so
    # a row that happens to emit <|im_end|> is not padded by generate while the in-house row goes on.
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    batch = [[t % model.config.vocab_size for t in p] for p in prompts([40, 25], seed=11)]
    return model, batch


@pytest.mark.slow
def test_smollm2_full_equals_generate_and_h2o_matches_in_house(monkeypatch):
    model, batch = smollm2_hf(monkeypatch)
    plain, _ = run(model, batch, new=6)
    full, _ = run(model, batch, compose("full"), new=6)
    assert full == plain
    policy = compose("squeeze+h2o", budget=0.3)
    tokens, cache = run(model, batch, policy, new=6)
    ref_tokens, ref_kept = in_house(model, batch, policy, new=6, monkeypatch=monkeypatch)
    assert tokens == ref_tokens
    assert [kept(cache, b) for b in range(2)] == ref_kept
