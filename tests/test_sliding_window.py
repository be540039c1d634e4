"""Models with sliding-window layers on the paged cache (Gemma 3's local layers, Mistral's window):
``CacheLayout.windows`` -> ``PagedKVCache(windows=...)`` -> ``ComposedPolicy.plan(windows=...)``.

A layer with window ``W`` attends to its last ``W`` tokens, itself included (the mask transformers builds), so
the cache keeps its last ``W - 1`` and compacts it to them after every decode step; the policy acts on the
layers that attend to every token. The reference is the model's own ``generate`` on its own cache
(transformers' sliding masks and caches):

* with ``full``, a ragged batch of tiny random Gemma 3 (sliding and global layers) and Mistral (every layer
  sliding) models generates the tokens transformers generates, prompts shorter and longer than the window,
  windows inside a page and across pages; each sliding layer holds exactly its window's positions, with the
  K/V the model wrote (bit for bit: the same tensors as a cache without windows holds for them);
* with a compressing policy (scores at the prompt and while decoding, layer budgets, 4-bit rows) the sliding
  layers still hold exactly their window and the others what the policy keeps, under kvmodels' ``Decoder``,
  the compiled decode step and ``model.generate`` with a ``paged_cache`` alike;
* a chunked prefill and follow-up turns (extensions) attend in the windows too: with ``full``, the model's
  own ``generate`` on the whole sequence; under compressing policies (kvzip's reconstruction pass included)
  the windows still hold exactly;
* the policies that cannot hold a window (merging, per-head budgets, two formats) are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from hf_models import V, hf_generate, kept, prompts  # noqa: E402
from kvmodels import Decoder, generate  # noqa: E402
from kvmodels.hf import UnsupportedModelError, paged_cache, wrap_transformers  # noqa: E402
from kvpolicies import compose  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12
_MODELS: dict[tuple[str, int], torch.nn.Module] = {}
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def sliding_model(kind: str, window: int) -> torch.nn.Module:
    """A tiny random ``gemma3`` (layers 0, 1, 3 sliding, 2 global; GQA 2:1, q/k norms, two rope bases) or
    ``mistral`` (every layer sliding) model with sliding window ``window``; weights large enough that greedy
    decoding does not settle on one token, so a wrong window changes the tokens."""
    if (kind, window) not in _MODELS:
        torch.manual_seed(0)
        shape = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, sliding_window=window,
                     initializer_range=0.3, pad_token_id=0)
        if kind == "gemma3":
            cfg = transformers.Gemma3TextConfig(**shape, num_hidden_layers=4, head_dim=16,
                                                layer_types=GEMMA_LAYERS, tie_word_embeddings=False)
            model = transformers.Gemma3ForCausalLM(cfg)
        else:
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, num_hidden_layers=3))
        model.config._attn_implementation = "sdpa"
        model.generation_config.eos_token_id = None  # every run produces exactly the tokens asked for
        _MODELS[kind, window] = model.eval().to(DEVICE)
    return _MODELS[kind, window]


def own_generate(model: torch.nn.Module, batch: list[list[int]], new: int = NEW) -> list[list[int]]:
    """The model's own greedy ``generate`` (its own sliding-window cache), one sequence at a time."""
    out = []
    for p in batch:
        ids = torch.tensor([p], device=DEVICE)
        with torch.no_grad():
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        out.append(got[0, len(p):].tolist())
    return out


def assert_windows_hold(cache, model: torch.nn.Module, batch: list[list[int]], new: int) -> None:
    """Every sliding layer of every sequence holds exactly the positions of its window after ``new`` tokens
    (the last one generated is not fed back: ``len + new - 1`` tokens seen), in every KV head."""
    windows = wrap_transformers(model).cache_layout().windows
    for b, p in enumerate(batch):
        seen = len(p) + new - 1
        for l, w in enumerate(windows):
            if w:
                want = list(range(max(0, seen - (w - 1)), seen))
                assert kept(cache, b)[l] == [want] * len(kept(cache, b)[l]), f"sequence {b} layer {l}"


def test_the_layout_names_each_layers_window() -> None:
    assert wrap_transformers(sliding_model("gemma3", 5)).cache_layout().windows == (5, 5, 0, 5)
    assert wrap_transformers(sliding_model("mistral", 7)).cache_layout().windows == (7, 7, 7)
    no_window = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=None))
    assert wrap_transformers(no_window).cache_layout().windows == ()


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
@pytest.mark.parametrize("window,page_size", [(5, 16), (18, 4)])
def test_full_policy_is_the_models_own_generate(kind: str, window: int, page_size: int) -> None:
    model = sliding_model(kind, window)
    batch = prompts([1, window - 1, window, window + 1, 33], seed=1)
    dec = Decoder(wrap_transformers(model), compose("full"), page_size=page_size)
    dec.extend(batch, max_new_tokens=NEW)
    assert dec.generate(NEW).tokens == own_generate(model, batch)
    assert_windows_hold(dec.cache, model, batch, NEW)
    report = dec.cache.report()  # the uncompressed equivalent is the model's own cache: windows included
    assert report.total_bytes == report.full_cache_bytes


@settings(deadline=None, max_examples=12)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), window=st.integers(2, 20),
       page_size=st.sampled_from([1, 4, 16]), kind=st.sampled_from(["gemma3", "mistral"]),
       seed=st.integers(0, 50))
@example(lens=[1], window=2, page_size=1, kind="gemma3", seed=0)  # the smallest window, one-slot pages
@example(lens=[16, 17], window=17, page_size=16, kind="mistral", seed=3)  # a window of one page and a slot
def test_ragged_batches_match_the_models_own_generate(lens, window, page_size, kind, seed) -> None:
    model = sliding_model(kind, window)
    batch = prompts(lens, seed=seed)
    dec = Decoder(wrap_transformers(model), compose("full"), page_size=page_size)
    dec.extend(batch, max_new_tokens=8)
    assert dec.generate(8).tokens == own_generate(model, batch, 8)
    assert_windows_hold(dec.cache, model, batch, 8)


@given(L=st.integers(1, 40), window=st.integers(2, 20), block=st.integers(1, 16), G=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
@example(L=33, window=5, block=4, G=1, seed=0)  # blocks shorter than the window
def test_the_prompts_banded_attention_is_the_sliding_mask(L, window, block, G, seed) -> None:
    """``sliding_causal_attention`` in blocks of query rows equals one dense softmax under transformers'
    sliding mask (``i - W < j <= i``)."""
    from kvmodels.hf.model import sliding_causal_attention

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, 2 * G, 8, generator=g)
    k, v = torch.randn(L, 2, 8, generator=g), torch.randn(L, 2, 8, generator=g)
    got = sliding_causal_attention(q, k, v, window, scale=0.3, block=block)
    i = torch.arange(L)
    outside = (i[None, :] > i[:, None]) | (i[None, :] <= i[:, None] - window)
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(G, dim=1)) * 0.3
    want = torch.einsum("hqk,khd->qhd", logits.masked_fill(outside, float("-inf")).softmax(-1),
                        v.repeat_interleave(G, dim=1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_windows_kv_are_the_tokens_the_model_wrote() -> None:
    """After the prompt, the K/V a sliding layer keeps are the last ``W - 1`` the model's own cache holds:
    bit for bit in the first layer (the same input, the same projections; compaction moves rows, it does not
    recompute or round them), to rounding in the later ones (their inputs went through the cache's
    attention, not transformers' own kernel)."""
    model, batch = sliding_model("gemma3", 5), prompts([13], seed=2)
    dec = Decoder(wrap_transformers(model), compose("full"))
    dec.extend(batch, max_new_tokens=4)
    with torch.no_grad():
        own = model(input_ids=torch.tensor(batch, device=DEVICE), use_cache=True).past_key_values
    for l in (0, 1, 3):
        layer = own.layers[l]
        for h, got in enumerate(dec.cache.head_contents(l, 0)):
            assert got["pos"].tolist() == [9, 10, 11, 12]
            for name, theirs in (("k", layer.keys), ("v", layer.values)):
                want = theirs[0, h, -4:]
                if l == 0:
                    assert torch.equal(got[name], want)
                else:
                    torch.testing.assert_close(got[name], want)


POLICIES = [("h2o", 0.5), ("snapkv(window=3)", 0.4), ("streaming(sinks=2)", 0.5), ("tova", 0.4),
            ("chunkkv(window=4, chunk=3)", 0.4),  # layer-wise index reuse: a global layer may read a local's
            ("squeeze+keyformer", 0.5), ("snapkv(window=3)+kivi(bits=4, group=8, residual=0)", 0.5)]


@pytest.mark.parametrize("spec,budget", POLICIES, ids=[s for s, _ in POLICIES])
def test_compressing_policies_keep_the_windows_and_compress_the_rest(spec: str, budget: float) -> None:
    model = sliding_model("gemma3", 5)
    batch = prompts([30, 1, 17], seed=5)
    first, *rest = spec.split("+")
    policy = compose(first, *rest, budget=budget)
    dec = Decoder(wrap_transformers(model), policy, seed=4)
    dec.extend(batch, max_new_tokens=NEW)
    tokens = dec.generate(NEW).tokens
    assert_windows_hold(dec.cache, model, batch, NEW)
    held = [len(h) for h in kept(dec.cache, 0)[2]]  # the global layer of the 30-token prompt: compressed
    assert max(held) < 30 + NEW - 1
    report = dec.cache.report()
    assert report.total_bytes < report.full_cache_bytes
    # model.generate with a paged cache under it: the same tokens and kept positions
    cache = paged_cache(model, policy, max_new_tokens=NEW, seed=4)
    assert hf_generate(model, batch, cache, NEW) == tokens
    for b in range(len(batch)):
        assert kept(cache, b) == kept(dec.cache, b)


def test_compiled_decode_step_keeps_the_windows() -> None:
    model = wrap_transformers(sliding_model("gemma3", 5))
    batch, policy = prompts([19, 4], seed=9), compose("h2o", budget=0.5)
    assert generate(model, batch, 8, policy, compile=True).tokens == generate(model, batch, 8, policy).tokens


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_chunked_prefill_and_follow_up_turns_are_the_models_own_generate(kind: str) -> None:
    """An extension (the next chunk of a prompt, a follow-up turn) attends in each sliding layer's window
    over the kept tokens and itself, then the layer is compacted back to it: with ``full``, the tokens of
    the model's own ``generate`` on the whole sequence."""
    model = sliding_model(kind, 5)
    wrapped, batch = wrap_transformers(model), prompts([23, 3, 12], seed=8)
    dec = Decoder(wrapped, compose("full"), page_size=4)
    dec.extend(batch, chunk=4, max_new_tokens=4)  # chunks shorter and longer than the window
    first = dec.generate(4).tokens
    assert first == own_generate(model, batch, 4)
    assert_windows_hold(dec.cache, model, batch, 4)
    follow = prompts([7, 1, 2], seed=9)
    dec.extend(follow, max_new_tokens=4)
    whole = [p + t + f for p, t, f in zip(batch, first, follow, strict=True)]
    assert dec.generate(4).tokens == own_generate(model, whole, 4)
    assert_windows_hold(dec.cache, model, whole, 4)


@pytest.mark.parametrize("spec,budget,probe", [("h2o", 0.5, ()), ("snapkv(window=3)", 0.4, ()),
                                               ("kvzip(skip=0)", 0.4, (5, 6, 7))])
def test_extensions_under_compressing_policies_keep_the_windows(spec, budget, probe) -> None:
    model = sliding_model("gemma3", 5)
    batch = prompts([30, 9], seed=5)
    dec = Decoder(wrap_transformers(model), compose(spec, budget=budget), probe_prefix=list(probe))
    dec.extend(batch, chunk=None if probe else 8, max_new_tokens=4)
    first = dec.generate(4).tokens
    assert_windows_hold(dec.cache, model, batch, 4)
    assert max(len(h) for h in kept(dec.cache, 0)[2]) < 30 + 3  # the global layer: compressed
    follow = prompts([6, 2], seed=6)
    dec.extend(follow, max_new_tokens=4)
    dec.generate(4)
    whole = [p + t + f for p, t, f in zip(batch, first, follow, strict=True)]
    assert_windows_hold(dec.cache, model, whole, 4)


def test_what_cannot_hold_a_window_is_refused_by_name() -> None:
    wrapped, batch = wrap_transformers(sliding_model("gemma3", 5)), prompts([12, 9], seed=3)
    for spec, what in (("snapkv(window=3)+minicache(start=1)", "minicache"),
                       ("snapkv(window=3)+adakv", "rows per KV head"),
                       ("snapkv(window=3)+kivi(bits=4, group=8, residual=2)", "two storage formats")):
        first, *rest = spec.split("+")
        with pytest.raises(ValueError, match="sliding-window layers") as err:
            Decoder(wrapped, compose(first, *rest, budget=0.5)).extend(batch, max_new_tokens=2)
        assert what in str(err.value)


def test_other_layer_types_and_softcapping_are_refused() -> None:
    hybrid = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4))
    hybrid.config.layer_types = ["chunked_attention", "full_attention"]  # (Llama 4's kind of layer)
    with pytest.raises(UnsupportedModelError, match=r"\['chunked_attention'\] layers"):
        wrap_transformers(hybrid)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4, attn_implementation="eager")).eval()
    with pytest.raises(UnsupportedModelError, match="softcap"):
        generate(wrap_transformers(gemma2), [[1, 2, 3]], 2)
