"""Any transformers decoder on the paged cache (``kvmodels.hf.wrap_transformers``), through its attention
interface: the model computes projections, norms and rotary embeddings, the cache stores, scores and attends.

* with ``full``, a wrapped Llama, Qwen2 (biased projections), Qwen3 (per-head q/k norms), Mistral, Phi-3 (one
  fused q|k|v projection), Granite (its own softmax scale) and GPT-J generate what ``generate`` does;
* on a Llama, for every kind of policy (scores while decoding and at the prompt, layer and head budgets,
  Keyformer's noise, MiniCache, KIVI, ZipCache, MiKV, kvzip's reconstruction pass), a ragged batch generates
  the tokens kvmodels' own Llama on the same weights generates and keeps the same positions per (layer,
  sequence, KV head); so does a follow-up question on a ``Decoder`` (an extension);
* MPT (ALiBi) and GPT-J before transformers 5.24, whose attention does not call the interface, through their
  own attention methods: the tokens and positions of kvmodels' own MPT and GPT-J, and the same refusals;
* the model is the user's again between calls (its attention implementation restored), and a model whose
  attention neither calls the interface nor is one of those is refused, naming ``from_transformers``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from hf_models import V, hf_generate, in_house, kept, left_pad, model_of, prompts  # noqa: E402
from kvmodels import Decoder, generate  # noqa: E402
from kvmodels.hf import ATTENTION, UnsupportedModelError, compressed, paged_cache, wrap_transformers  # noqa: E402
from kvpolicies import compose  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10
_MODELS: dict[str, torch.nn.Module] = {}


def other(kind: str) -> torch.nn.Module:
    """A tiny random model of an architecture kvmodels does not implement (or GPT-J, which it does)."""
    if kind not in _MODELS:
        torch.manual_seed(7)
        shape = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config = {
            "qwen2": lambda: transformers.Qwen2Config(**shape),
            "qwen3": lambda: transformers.Qwen3Config(**shape, head_dim=16),
            "mistral": lambda: transformers.MistralConfig(**shape, sliding_window=None),
            "phi3": lambda: transformers.Phi3Config(**shape),
            # a softmax scale that is not head_dim ** -0.5 (the attention interface hands it over)
            "granite": lambda: transformers.GraniteConfig(**shape, attention_multiplier=0.6),
            "gptj": lambda: transformers.GPTJConfig(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                    rotary_dim=8, n_positions=128, bos_token_id=1,
                                                    eos_token_id=2),
        }[kind]()
        attn = {} if kind == "gptj" else {"attn_implementation": "sdpa"}  # GPT-J: sdpa from 5.24 on
        model = transformers.AutoModelForCausalLM.from_config(config, **attn).eval()
        model.generation_config.eos_token_id = None  # generate never stops early, as kvmodels.generate here
        _MODELS[kind] = model.to(DEVICE)
    return _MODELS[kind]


def plain_generate(model: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    """The model's own greedy ``generate`` on its dense cache, one sequence."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=DEVICE)  # an explicit mask: generate takes token 0 for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def model_for(kind: str) -> torch.nn.Module:
    return model_of(kind) if kind == "llama" else model_of(kind, "eager") if kind == "mpt" else other(kind)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "gptj", "mpt"])
def test_full_policy_is_the_models_own_generate(kind: str) -> None:
    model = model_for(kind)
    batch = prompts([23, 1, 40], seed=3)
    implementation = model.config._attn_implementation
    got = generate(wrap_transformers(model), batch, NEW, compose("full"))
    assert got.tokens == [plain_generate(model, p) for p in batch]
    assert model.config._attn_implementation == implementation  # the user's model again
    assert plain_generate(model, batch[0]) == got.tokens[0]


# MPT's attention (ALiBi) and GPT-J's before transformers 5.24 do not call the attention interface: the
# wrapped model routes their own attention methods. Each keeps what kvmodels' own MPT / GPT-J on the same
# weights keeps, and refuses what it refuses, with the same words.
FAMILY_SPECS = ["h2o", "snapkv(window=3)", "squeeze+keyformer", "snapkv(window=3)+minicache(start=1)",
                "snapkv(window=3)+kivi(bits=4, group=8, residual=2)", "snapkv(window=3)+zipcache(group=8)",
                "kvzip(skip=0)"]


@pytest.mark.parametrize("kind", ["gptj", "mpt"])
@pytest.mark.parametrize("spec", FAMILY_SPECS)
def test_mpt_and_gptj_keep_what_kvmodels_own_models_keep(kind: str, spec: str) -> None:
    model = model_for(kind)
    batch = prompts([30, 1, 17], seed=5)
    policy, probe = policy_of(spec, 0.5), [5, 6, 7] if spec.startswith("kvzip") else []
    decoders = []
    outcomes: list[object] = []
    for m in (in_house(model), wrap_transformers(model)):
        try:
            dec = Decoder(m, policy, seed=2, probe_prefix=probe)
            dec.extend(batch, max_new_tokens=NEW)
            outcomes.append(dec.generate(NEW).tokens)
            decoders.append(dec)
        except (ValueError, NotImplementedError) as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    assert outcomes[1] == outcomes[0]
    if isinstance(outcomes[0], str):
        return
    for s in range(len(batch)):
        assert kept(decoders[1].cache, s) == kept(decoders[0].cache, s)
    cache = paged_cache(model, policy, seed=2, probe_prefix=probe)  # and inside model.generate
    assert hf_generate(model, batch, cache, NEW) == outcomes[0]


# (spec, budget, probe prefix): every role and storage the paged cache holds
SPECS = [
    ("h2o", 0.5, ()),
    ("snapkv(window=4)", 0.3, ()),
    ("tova", 0.4, ()),
    ("streaming(sinks=2)", 0.5, ()),
    ("squeeze+keyformer", 0.4, ()),
    ("pyramid+snapkv(window=3)", 0.4, ()),
    ("snapkv(window=3)+adakv", 0.3, ()),
    ("h2o+pooled", 0.5, ()),
    ("snapkv(window=3)+minicache(start=1)", 0.5, ()),
    ("snapkv(window=3)+kivi(bits=4, group=8, residual=2)", 0.5, ()),
    ("snapkv(window=3)+zipcache(group=8)", 0.6, ()),
    ("h2o+mikv(high=4, low=2, group=8)", 0.5, ()),
    ("kvzip(skip=0)", 0.4, (5, 6, 7)),
]


def policy_of(spec: str, budget: float):
    first, *rest = spec.split("+")
    return compose(first, *rest, budget=budget)


def run_both(hf_model, spec: str, budget: float, probe: tuple, batch: list[list[int]], new: int = NEW):
    """The same ragged batch on the wrapped model and on kvmodels' twin: their decoders after ``generate``."""
    decoders = []
    for model in (wrap_transformers(hf_model), in_house(hf_model)):
        dec = Decoder(model, policy_of(spec, budget), probe_prefix=list(probe), seed=4)
        dec.extend(batch, max_new_tokens=new)
        decoders.append((dec, dec.generate(new)))
    return decoders


@pytest.mark.parametrize("spec,budget,probe", SPECS, ids=[s for s, _, _ in SPECS])
def test_every_policy_keeps_what_kvmodels_keeps(spec: str, budget: float, probe: tuple) -> None:
    hf_model = model_of("smollm2")
    batch = prompts([30, 1, 17], seed=5)
    (wrapped, a), (own, b) = run_both(hf_model, spec, budget, probe, batch)
    assert a.tokens == b.tokens
    for s in range(len(batch)):
        assert kept(wrapped.cache, s) == kept(own.cache, s)
    assert a.report.total_bytes == b.report.total_bytes < a.report.full_cache_bytes
    if "adakv" in spec or "pooled" in spec or "minicache" in spec:
        return  # refused by name after the prompt (tests/test_decoder.py)
    # and a follow-up question after the compressed context (an extension of every sequence)
    follow = prompts([6, 2, 9], seed=6)
    for dec in (wrapped, own):
        dec.extend(follow, max_new_tokens=4)
    assert wrapped.generate(4).tokens == own.generate(4).tokens
    for s in range(len(batch)):
        assert kept(wrapped.cache, s) == kept(own.cache, s)


@settings(deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), budget=st.sampled_from([0.2, 0.5, 0.8]),
       spec=st.sampled_from(["h2o", "snapkv(window=2)", "tova", "squeeze+keyformer",
                             "snapkv(window=2)+adakv"]),
       kind=st.sampled_from(["llama", "smollm2"]), seed=st.integers(0, 50))
def test_ragged_batches_keep_what_kvmodels_keeps(lens, budget, spec, kind, seed) -> None:
    hf_model = model_of(kind)
    batch = prompts(lens, seed=seed)
    (wrapped, a), (own, b) = run_both(hf_model, spec, budget, (), batch, new=5)
    assert a.tokens == b.tokens
    for s in range(len(batch)):
        assert kept(wrapped.cache, s) == kept(own.cache, s)


@pytest.mark.parametrize("kind", ["qwen3", "mpt", "gptj"])
def test_compiled_decode_step(kind: str) -> None:
    """``compile=True`` compiles the wrapped model's decode step (``fullgraph``) once: the same tokens; MPT's
    routed attention method too, and GPT-J's (routed before transformers 5.24: .ci/oldest-transformers)."""
    model, batch = wrap_transformers(model_for(kind)), prompts([19, 4], seed=9)
    policy = compose("h2o", budget=0.5)
    assert generate(model, batch, 6, policy, compile=True).tokens == generate(model, batch, 6, policy).tokens


def test_prefill_alone_and_last_only() -> None:
    model = wrap_transformers(model_of("llama"))
    tokens = torch.tensor(prompts([9])[0], device=DEVICE)
    with torch.no_grad():
        full = model.prefill(tokens, None, 0)
        last = model.prefill(tokens, None, 0, last_only=True)
        plain = model.hf(input_ids=tokens[None]).logits[0]
    assert full.shape == (9, V) and last.shape == (1, V)
    torch.testing.assert_close(full, plain)
    torch.testing.assert_close(last, plain[-1:])
    with pytest.raises(ValueError, match="start=3 continues a cached sequence"):
        model.prefill(tokens, None, 0, start=3)


class OwnAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention class from a module without transformers' attention functions (as a model's remote code
    may define one)."""


def test_refusals_name_the_fix() -> None:
    own = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    own.model.layers[0].self_attn.__class__ = OwnAttention
    with pytest.raises(UnsupportedModelError, match="OwnAttention does not call .*from_transformers"):
        wrap_transformers(own)
    # (sliding-window layers run since 2026-12-02; other kinds of layer are refused: test_sliding_window.py)
    # the attention function outside a wrapped model's call
    hf = model_of("llama")
    wrap_transformers(hf)
    hf.config._attn_implementation = ATTENTION
    try:
        with pytest.raises(RuntimeError, match="runs only inside a wrap_transformers model"):
            hf(input_ids=torch.tensor([[1, 2, 3]], device=DEVICE))
    finally:
        hf.config._attn_implementation = "sdpa"


# --- model.generate on the paged cache (kvmodels.hf.paged_cache) -----------------------------------------

GENERATE_SPECS = [
    ("full", 1.0, ()),
    ("h2o", 0.5, ()),
    ("snapkv(window=3)", 0.3, ()),
    ("squeeze+keyformer", 0.4, ()),
    ("snapkv(window=3)+adakv", 0.3, ()),
    ("snapkv(window=3)+zipcache(group=8)", 0.6, ()),
    ("h2o+mikv(high=4, low=2, group=8)", 0.5, ()),
    ("kvzip(skip=0)", 0.4, (5, 6, 7)),
]


@pytest.mark.parametrize("kind", ["smollm2", "qwen3", "phi3"])
@pytest.mark.parametrize("spec,budget,probe", GENERATE_SPECS, ids=[s for s, _, _ in GENERATE_SPECS])
def test_model_generate_with_a_paged_cache_is_kvmodels_generate(kind: str, spec: str, budget: float,
                                                                probe: tuple) -> None:
    model = model_of(kind) if kind == "smollm2" else other(kind)
    batch = prompts([30, 1, 17], seed=5)
    policy = policy_of(spec, budget)
    cache = paged_cache(model, policy, max_new_tokens=NEW, seed=4, probe_prefix=list(probe))
    got = hf_generate(model, batch, cache, NEW)
    own = Decoder(wrap_transformers(model), policy, seed=4, probe_prefix=list(probe))
    own.extend(batch, max_new_tokens=NEW)
    assert got == own.generate(NEW).tokens
    for s in range(len(batch)):
        assert kept(cache.decoder.cache, s) == kept(own.cache, s)
    assert model.config._attn_implementation == "sdpa"
    report = cache.report()
    assert report.total_bytes == own.cache.report().total_bytes
    if spec == "full":  # and the model's own dense cache, row by row
        assert got == [plain_generate(model, p) for p in batch]


@pytest.mark.parametrize("spec,budget", [("h2o", 0.5), ("snapkv(window=3)", 0.3), ("tova", 0.4)])
def test_a_follow_up_generate_continues_the_cache(spec: str, budget: float) -> None:
    """A second ``generate`` with the history and a question: the decoder's ``extend`` + ``generate``."""
    model = model_of("smollm2")
    batch, question = prompts([30, 12], seed=5), prompts([6, 6], seed=6)
    policy = policy_of(spec, budget)
    cache = paged_cache(model, policy, max_new_tokens=NEW, max_tokens=64)  # room for the follow-up
    ids, mask = left_pad(batch)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             past_key_values=cache, pad_token_id=0)
        q = torch.tensor(question, device=DEVICE)
        ids2 = torch.cat([out, q], dim=1)
        mask2 = torch.cat([mask, torch.ones_like(ids2[:, mask.shape[1]:])], dim=1)
        out2 = model.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=NEW, do_sample=False,
                              past_key_values=cache, pad_token_id=0)
    own = Decoder(wrap_transformers(model), policy, max_tokens=64)
    own.extend(batch, max_new_tokens=NEW)
    first = own.generate(NEW)
    own.extend(question, max_new_tokens=NEW)
    assert out[:, ids.shape[1]:].tolist() == first.tokens
    assert out2[:, ids2.shape[1]:].tolist() == own.generate(NEW).tokens
    for s in range(len(batch)):
        assert kept(cache.decoder.cache, s) == kept(own.cache, s)


def test_paged_cache_refusals_and_a_failed_step() -> None:
    model = model_of("smollm2")
    batch = prompts([9, 4], seed=2)
    policy = compose("h2o", budget=0.5)
    with pytest.raises(NotImplementedError, match="beam search"):
        hf_generate(model, batch, paged_cache(model, policy, max_new_tokens=4), NEW, num_beams=2)
    with pytest.raises(ValueError, match="runs more steps than max_new_tokens=2"):
        hf_generate(model, batch, paged_cache(model, policy, max_new_tokens=2), new=4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        paged_cache(model, policy, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_tokens=9"):  # the decoder's own check, naming the fix
        hf_generate(model, batch, paged_cache(model, policy, max_new_tokens=4, max_tokens=9), NEW)
    cache = paged_cache(model, policy, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="report\\(\\) before the cache held a prompt"):
        cache.report()
    with pytest.raises(ValueError, match="not return_dict=False"), torch.no_grad():
        model(input_ids=torch.tensor([[3]], device=DEVICE), past_key_values=cache, return_dict=False)
    hf_generate(model, batch, cache, new=2)
    attend = cache.decoder.cache.attend

    def broken(*args, **kwargs):
        raise RuntimeError("a failing decode step")

    cache.decoder.cache.attend = broken
    ids = torch.tensor([[3], [4]], device=DEVICE)
    with pytest.raises(RuntimeError, match="a failing decode step"), torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    assert model.config._attn_implementation == "sdpa"  # restored though the step raised
    cache.decoder.cache.attend = attend
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="raised part way through"):  # its layers are out of step
            model(input_ids=ids, past_key_values=cache)
        assert model(input_ids=ids).logits.shape[:2] == (2, 1)  # the model itself runs on
        cache = paged_cache(model, policy, max_new_tokens=4)
        hf_generate(model, batch, cache, new=2)
        assert model(input_ids=ids, past_key_values=cache).logits.shape[:2] == (2, 1)  # one more step
        for another in (model_of("llama"), other("qwen2")):  # the hooks of a model with a PagedCache too
            paged_cache(another, compose("full"), max_new_tokens=1)
            with pytest.raises(RuntimeError, match="stores through the model it was built for"):
                another(input_ids=ids, past_key_values=cache)  # not routed through the wrong model


def test_a_row_that_stops_early_leaves_the_others_as_kvmodels() -> None:
    """``generate`` stops a row at its eos and feeds it pad tokens after; the other rows, attending only to
    their own tokens in the paged cache, generate what kvmodels' decoder with the same eos generates."""
    model = model_of("smollm2")
    batch = prompts([30, 12, 20], seed=5)
    policy = compose("h2o", budget=0.5)
    own = Decoder(wrap_transformers(model), policy)
    own.extend(batch, max_new_tokens=NEW)
    plain = own.generate(NEW).tokens
    eos = plain[1][2]  # row 1's third token: it stops there (and any row that makes it earlier)
    cache = paged_cache(model, policy, max_new_tokens=NEW)
    got = hf_generate(model, batch, cache, NEW, eos_token_id=eos)
    own = Decoder(wrap_transformers(model), policy)
    own.extend(batch, max_new_tokens=NEW)
    want = own.generate(NEW, eos_ids=eos).tokens
    assert any(len(w) < NEW for w in want)
    for g, w in zip(got, want, strict=True):
        assert g[:len(w)] == w and all(t == 0 for t in g[len(w):])  # then generate's pad tokens


@pytest.mark.parametrize("spec,budget", [("squeeze+keyformer", 0.4), ("snapkv(window=3)", 0.3)])
def test_generate_tells_the_cache_its_length(spec: str, budget: float) -> None:
    """Without ``max_new_tokens``, each ``generate`` call sets it as transformers resolves it (the keyword,
    or ``max_length`` less the prompt's width): Keyformer's schedule and the squeeze cap plan for it, so the
    tokens are those of a cache told the length; driving the model by hand needs it, by name."""
    model = model_of("smollm2")
    batch = prompts([30, 1, 17], seed=5)
    policy = policy_of(spec, budget)
    told = hf_generate(model, batch, paged_cache(model, policy, max_new_tokens=NEW, seed=4), NEW)
    learned = paged_cache(model, policy, seed=4)
    assert hf_generate(model, batch, learned, NEW) == told and learned.max_new_tokens == NEW
    by_length = paged_cache(model, policy, seed=4)
    ids, mask = left_pad(batch)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_length=ids.shape[1] + NEW,
                             do_sample=False, past_key_values=by_length, pad_token_id=0)
    assert out[:, ids.shape[1]:].tolist() == told and by_length.max_new_tokens == NEW
    by_hand = paged_cache(model, policy)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=by_hand)  # a prompt: Decoder.extend's plan
        with pytest.raises(ValueError, match="a decode step on a PagedCache built without max_new_tokens"):
            model(input_ids=ids[:, -1:], past_key_values=by_hand)


def test_compressed_gives_each_generate_a_fresh_paged_cache() -> None:
    """``with compressed(model, policy)``: each ``generate`` given no cache gets a fresh one, equal to an
    explicit ``paged_cache``; a call given a cache keeps it; ``generate`` is the model's again on exit."""
    model = model_of("smollm2")
    batch, policy = prompts([30, 12], seed=5), compose("snapkv(window=3)", budget=0.3)
    want = hf_generate(model, batch, paged_cache(model, policy, seed=3), NEW)
    before = model.generate
    mine = paged_cache(model, compose("full"))
    with compressed(model, policy, seed=3) as caches:
        ids, mask = left_pad(batch)
        for _ in range(2):
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                     pad_token_id=0)
            assert out[:, ids.shape[1]:].tolist() == want
        hf_generate(model, batch, mine, NEW)
    assert len(caches) == 2 and caches[0] is not caches[1]
    assert all(kept(c.decoder.cache, 0) == kept(caches[0].decoder.cache, 0) for c in caches)
    assert caches[1].report().total_bytes < mine.report().total_bytes
    assert model.generate == before
