"""``model.generate`` with a compressed cache: ``kvmodels.hf.paged_cache`` / ``compressed`` on the model
families the retired transformers bridge (``kvpolicies.hf``) drove, with the assertions of its tests, which
this file takes over (tests/test_hf_wrap.py checks the wrapped models themselves and more policies on Llama).

On tiny random Llama (GQA, sdpa and eager), SmolLM2-shaped Llama (tied embeddings, 3 query heads per KV head),
GPT-J (partial rotary) and MPT (ALiBi) models, and on the real SmolLM2 checkpoint (slow):
* the ``full`` policy reproduces the model's own ``generate`` token for token, and holds every real token;
* a left-padded batch generates, and keeps, exactly what each sequence does alone;
* for the same inputs, policy and seed, the tokens kept per (layer, sequence, KV head) equal those kvmodels'
  own models keep on the same weights, and so do the generated tokens (Keyformer included: same noise);
* a question after the context (a forward on the context, then ``generate`` after it), and a follow-up after
  the answer, keep and generate what ``kvmodels.Decoder``'s ``extend`` + ``generate`` do, kvzip's
  reconstruction pass included (with its probe prefix, also through ``compressed``);
* ``generate`` tells the cache its length (the keyword or ``max_length``); bad inputs fail naming the fix.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from hf_models import (  # noqa: E402
    NEW,
    assert_transformers_keeps_what_kvmodels_keeps,
    in_house,
    kept,
    left_pad,
    model_of,
    prompts,
    python_output,
    run,
    smollm2_hf,
)
from kvmodels.decoder import Decoder  # noqa: E402
from kvmodels.hf import compressed, paged_cache  # noqa: E402
from kvpolicies import compose  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama", "smollm2", "gptj", "mpt"]


# --- full policy == the model's own generate ------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,attn",
    [("llama", "sdpa"), ("llama", "eager"), ("smollm2", "sdpa"), ("gptj", "eager"), ("mpt", "eager")])
def test_full_policy_equals_plain_generate(kind, attn):
    model = model_of(kind, attn)
    batches = [prompts([11])] if kind == "mpt" else [prompts([11]), prompts([11, 6, 9], seed=1)]
    for batch in batches:
        plain, _ = run(model, batch)
        ours, cache = run(model, batch, compose("full"))
        assert ours == plain
        # full keeps every real token (padding is never stored) in every layer
        for b, p in enumerate(batch):
            every = list(range(len(p) + NEW - 1))
            assert kept(cache, b) == [[every] * len(layer) for layer in kept(cache, b)]


def test_mpt_padded_batch_full_policy_equals_each_alone():
    """Plain MPT generate is wrong on padded rows once a Cache is passed (design notes §9); ours is not."""
    model = model_of("mpt")
    batch = prompts([11, 5, 8], seed=3)
    ours, _ = run(model, batch, compose("full"))
    assert ours == [run(model, [p])[0][0] for p in batch]


# --- batched == one by one ----------------------------------------------------------------------------
POLICIES = [
    dict(p="squeeze+tova", budget=0.5),
    dict(p="pyramid+scissorhands", budget=0.5, evict_every=3),
    dict(p="a2sf", budget=0.4, evict_every=2),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", POLICIES, ids=lambda s: s["p"])
def test_batched_equals_one_by_one(kind, spec):
    spec = dict(spec)
    policy = compose(spec.pop("p"), **spec)
    model = model_of(kind)
    batch = prompts([13, 7], seed=5)
    tokens, cache = run(model, batch, policy)
    for b, p in enumerate(batch):
        alone_tokens, alone = run(model, [p], policy)
        assert tokens[b] == alone_tokens[0], f"sequence {b}"
        assert kept(cache, b) == kept(alone, 0), f"sequence {b}"


# --- kept tokens == kvmodels' own models' -------------------------------------------------------------
IN_HOUSE_POLICIES = [
    dict(p="keyformer", budget=0.5, seed=3),  # Gumbel noise at prefill (hash) and decode (generator)
    dict(p="squeeze+h2o", budget=0.5),  # cos-sim layer budgets, accumulated scores
    dict(p="snapkv", budget=0.5, snapkv=dict(window=4, kernel=3)),  # pooled prompt votes, ties
    dict(p="chunkkv", budget=0.5, chunkkv=dict(window=4, chunk=3, per_head=False)),  # one selection per layer
    dict(p="snapkv", budget=0.5, snapkv=dict(window=4, chunk=2, align="scores")),  # chunks placed on votes
    dict(p="pyramid+tova", budget=6, evict_every=2),  # int budget, evict every other step
    dict(p="streaming", budget=5),
    dict(p="knorm", budget=0.5),  # the open score hook: each token's score from its own key
    dict(p="snapkv+adakv", budget=0.4, snapkv=dict(window=4)),  # head budgets
    dict(p="h2o+minicache", budget=0.5),  # merged layer pairs
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", IN_HOUSE_POLICIES, ids=lambda s: s["p"])
def test_kept_tokens_equal_in_house(kind, spec):
    spec = dict(spec)
    assert_transformers_keeps_what_kvmodels_keeps(kind, compose(spec.pop("p"), **spec))


# --- the generation's length --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["h2o", "keyformer", "tova", "a2sf", "scissorhands", "squeeze+snapkv"])
def test_generate_tells_the_cache_its_length(name):
    """paged_cache(model, policy) needs no max_new_tokens: generate's own (keyword or max_length) reaches the
    cache, and the run equals one given the length explicitly."""
    model = model_of("llama")
    ids, mask = left_pad(prompts([12, 9], seed=5))
    policy = compose(name, budget=0.4)
    explicit, _ = run(model, prompts([12, 9], seed=5), policy, new=5, max_new_tokens=5)
    for length in (dict(max_new_tokens=5), dict(max_length=ids.shape[1] + 5)):
        cache = paged_cache(model, policy)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, past_key_values=cache,
                                 pad_token_id=0, **length)
        assert cache.max_new_tokens == 5
        assert out[:, ids.shape[1]:].tolist() == explicit


def test_policy_must_be_composed():
    from kvpolicies.eviction.h2o import H2O

    with pytest.raises(TypeError, match="compose"):
        paged_cache(model_of("llama"), H2O())


# --- a question after the context, a follow-up after the answer --------------------------------------------
#: DuoAttention's per-head weights for each tiny model's layers and KV heads.
DUO = {"llama": ((1.0, 0.0), (0.0, 0.5), (0.2, 0.1)), "smollm2": ((1.0, 0.0), (0.0, 0.5)),
       "gptj": ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.5, 0.0), (0.0, 0.3, 0.0, 0.0)),
       "mpt": ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.5, 0.0), (0.0, 0.3, 0.0, 0.0))}
SPECS = {
    "h2o": lambda: compose("h2o", budget=0.4),
    "snapkv": lambda: compose("snapkv(window=4)", budget=0.4),
    "tova": lambda: compose("tova", budget=0.4),
    "streaming": lambda: compose("streaming", budget=0.4),
    "knorm": lambda: compose("knorm", budget=0.4),
    "squeeze+snapkv": lambda: compose("squeeze", "snapkv(window=4)", budget=0.4),
    "snapkv+duo": lambda kind: compose("snapkv(window=4)", ("duo", {"weights": DUO[kind], "fraction": 0.34}),
                                       budget=0.4),  # fixed per-head budgets (Ada-KV's cannot extend)
    "h2o+kivi": lambda: compose("h2o", "kivi(bits=4, residual=0, group=8)", budget=0.4),
    "a2sf": lambda: compose("a2sf", budget=0.4),  # decayed scores
    "keyformer": lambda: compose("keyformer", budget=0.4, seed=3),  # the extension's noise is kvmodels'
}
CONTEXTS, QUESTIONS, FOLLOW_UPS = [20, 13], [5, 7], [3, 6]


def prefill(model, cache, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """A forward on the (left-padded) contexts by hand: the cache's prompt."""
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)


def transformers_turns(model, policy, contexts, *turns, probe_prefix=()):
    """A forward on the left-padded ``contexts``, then per turn ``generate`` with its left-padded questions
    after everything so far; returns the new tokens of each turn and the cache."""
    cache = paged_cache(model, policy, max_tokens=64, probe_prefix=list(probe_prefix))
    ids, mask = left_pad(contexts)
    prefill(model, cache, ids, mask)
    answers = []
    for questions in turns:
        q_ids, q_mask = left_pad(questions)
        ids, mask = torch.cat([ids, q_ids], 1), torch.cat([mask, q_mask], 1)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 past_key_values=cache, pad_token_id=0)
        answers.append(out[:, ids.shape[1]:].tolist())
        ids, mask = out, torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], 1)
    return answers, cache


def decoder_turns(model, policy, contexts, *turns, probe_prefix=()):
    """kvmodels' own model: ``extend(contexts)``, then per turn ``extend(questions)`` and ``generate``."""
    dec = Decoder(in_house(model), policy, max_tokens=64, probe_prefix=list(probe_prefix))
    dec.extend(contexts)
    answers = []
    for questions in turns:
        dec.extend(questions, max_new_tokens=NEW)
        answers.append(dec.generate(NEW).tokens)
    return answers, dec.cache


def spec_policy(spec: str, kind: str):
    make = SPECS[spec]
    return make(kind) if spec == "snapkv+duo" else make()


def assert_same_turns(kind: str, policy, *turns, probe_prefix=()) -> None:
    model, contexts = model_of(kind), prompts(CONTEXTS, seed=7)
    ours, cache = transformers_turns(model, policy, contexts, *turns, probe_prefix=probe_prefix)
    theirs, ref = decoder_turns(model, policy, contexts, *turns, probe_prefix=probe_prefix)
    assert ours == theirs
    for b, ctx in enumerate(contexts):
        assert kept(cache, b) == kept(ref, b), f"sequence {b}"
        held = max(len(head) for layer in kept(cache, b) for head in layer)
        # compressed (knorm evicts nothing after the context; pooled may give one head all it saw)
        if policy.eviction.name != "knorm" and not policy.heads.per_head:
            assert held < len(ctx) + sum(len(t[b]) for t in turns)


@pytest.mark.parametrize("spec", list(SPECS))
def test_question_after_context_keeps_what_the_decoder_keeps(spec):
    assert_same_turns("llama", spec_policy(spec, "llama"), prompts(QUESTIONS, seed=8))


@pytest.mark.parametrize("kind,spec", [("gptj", "snapkv"), ("mpt", "h2o"), ("smollm2", "tova"),
                                       ("gptj", "keyformer"), ("mpt", "snapkv+duo")])
def test_question_after_context_on_other_models(kind, spec):
    assert_same_turns(kind, spec_policy(spec, kind), prompts(QUESTIONS, seed=8))


@pytest.mark.parametrize("spec", ["h2o", "snapkv", "snapkv+duo"])
def test_a_follow_up_after_the_answer_keeps_what_the_decoder_keeps(spec):
    assert_same_turns("llama", spec_policy(spec, "llama"), prompts(QUESTIONS, seed=8),
                      prompts(FOLLOW_UPS, seed=9))


@pytest.mark.parametrize("spec", ["h2o", "snapkv+duo", "h2o+kivi"])
def test_ragged_batch_with_a_question_equals_each_sequence_alone(spec):
    model, policy = model_of("llama"), spec_policy(spec, "llama")
    contexts, questions = prompts([18, 9, 14], seed=5), prompts([6, 2, 4], seed=6)
    answers, cache = transformers_turns(model, policy, contexts, questions)
    for b, (ctx, question) in enumerate(zip(contexts, questions, strict=True)):
        alone, one = transformers_turns(model, policy, [ctx], [question])
        assert answers[0][b] == alone[0][0], f"sequence {b}"
        assert kept(cache, b) == kept(one, 0), f"sequence {b}"


def test_merge_policies_are_refused_after_the_prompt_as_kvmodels_refuses_them():
    model, policy = model_of("llama"), compose("h2o", "minicache", budget=0.5)
    ctx, question = prompts([20, 4], seed=3)
    cache = paged_cache(model, policy, max_new_tokens=4, max_tokens=64)
    with torch.no_grad():
        model(input_ids=torch.tensor([ctx], device=DEVICE), past_key_values=cache)
        with pytest.raises(NotImplementedError, match="merges layers"):
            model(input_ids=torch.tensor([question], device=DEVICE), past_key_values=cache)
    dec = Decoder(in_house(model), policy)
    dec.extend([ctx])
    with pytest.raises(NotImplementedError, match="merges layers"):
        dec.extend([question])


# --- kvzip: the reconstruction pass -------------------------------------------------------------------
PREFIX = [5, 6, 7]  # a probe prefix (KVzip's instruction, in miniature)
#: Few forced tokens (sinks, recent), so that the pass's ranking decides most kept tokens of these short
#: contexts and ``pooled`` splits them unevenly; with spans the contexts take several passes.
KVZIP = {
    "kvzip": ("kvzip(sinks=1, recent=2)", []),
    "kvzip+pooled": ("kvzip(sinks=1, recent=2)+pooled", []),
    "kvzip(span)": ("kvzip(span=6, sinks=1, recent=2)", []),
    "kvzip(skip)+pooled+prefix": ("kvzip(skip=3, sinks=2, recent=2)+pooled", PREFIX),
    "kvzip(span, skip)+pooled+prefix": ("kvzip(span=5, skip=2, sinks=1, recent=2)+pooled", PREFIX),
}


def kvzip(spec: str):
    text, prefix = KVZIP[spec]
    first, *heads = text.split("+")
    return compose(first, *heads, budget=0.3), prefix


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", list(KVZIP))
def test_kvzip_one_shot_keeps_what_the_decoder_keeps(kind, spec):
    policy, prefix = kvzip(spec)
    model, batch = model_of(kind), prompts([20, 13], seed=7)
    tokens, cache = run(model, batch, policy, probe_prefix=prefix)
    dec = Decoder(in_house(model), policy, probe_prefix=prefix)
    dec.extend(batch, max_new_tokens=NEW)
    assert tokens == dec.generate(NEW).tokens
    for b, p in enumerate(batch):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"
        # compressed: each head keeps its budget's share of the context, then every decoded token
        context = [[x for x in head if x < len(p)] for layer in kept(cache, b) for head in layer]
        assert max(map(len, context)) < len(p)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["kvzip+pooled", "kvzip(span)", "kvzip(skip)+pooled+prefix"])
def test_kvzip_question_after_context_keeps_what_the_decoder_keeps(kind, spec):
    policy, prefix = kvzip(spec)
    assert_same_turns(kind, policy, prompts([4, 6], seed=8), probe_prefix=prefix)


def test_compressed_takes_the_probe_prefix():
    policy, prefix = kvzip("kvzip(skip)+pooled+prefix")
    model, batch = model_of("llama"), prompts([20, 13], seed=7)
    _, without = run(model, batch, policy)  # no prefix: a different pass
    ids, mask = left_pad(batch)
    with compressed(model, policy, probe_prefix=prefix) as caches, torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    dec = Decoder(in_house(model), policy, probe_prefix=prefix)
    dec.extend(batch, max_new_tokens=NEW)
    assert out[:, ids.shape[1]:].tolist() == dec.generate(NEW).tokens
    assert caches[0].decoder.probe_prefix == prefix
    assert kept(caches[0], 0) == kept(dec.cache, 0) != kept(without, 0)


def test_kvzip_bad_inputs_name_the_argument_and_the_fix():
    model = model_of("llama")  # 128 positions
    policy = compose("kvzip", budget=0.3)
    long = left_pad(prompts([70], seed=1))
    with pytest.raises(ValueError, match=r"70 tokens.*context of 128.*kvzip\(span=N\)"):
        prefill(model, paged_cache(model, policy), *long)
    with pytest.raises(ValueError, match=r"after the 3 tokens of probe_prefix.*lower span"):
        prefill(model, paged_cache(model, compose("kvzip(span=60)", budget=0.3), probe_prefix=PREFIX), *long)
    prefill(model, paged_cache(model, compose("kvzip(span=16)", budget=0.3), probe_prefix=PREFIX), *long)
    with pytest.raises(ValueError, match=r"from token 12 on.*lower skip"):
        prefill(model, paged_cache(model, compose("kvzip(skip=12)", budget=0.3)),
                *left_pad(prompts([20, 12])))
    embeds = model.get_input_embeddings()(long[0])
    with pytest.raises(ValueError, match=r"input_ids=.*not inputs_embeds"), torch.no_grad():
        model(inputs_embeds=embeds, past_key_values=paged_cache(model, policy), use_cache=True)
    with pytest.raises(ValueError, match="probe_prefix.*'h2o' runs none; use kvzip"):
        paged_cache(model, compose("h2o", budget=0.3), probe_prefix=PREFIX)
    with pytest.raises(ValueError, match="probe_prefix must be a list of token ids.*tokenize"):
        paged_cache(model, policy, probe_prefix="Repeat the previous context.")


# --- imports ----------------------------------------------------------------------------------------------
def test_core_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvpolicies, kvkernels, kvmodels, kvmodels.cache, kvmodels.generate, kvmodels.decoder\n"
        "try:\n    import kvmodels.hf\nexcept ImportError as e:\n    print('hf:', e)\n"
    )
    assert "pip install 'kvpolicies[hf]'" in python_output(code)


def test_the_retired_bridge_says_where_it_went():
    code = "try:\n    import kvpolicies.hf\nexcept ImportError as e:\n    print(e)\n"
    assert "kvmodels.hf" in python_output(code) and "paged_cache" in python_output(code)
    with pytest.raises(AttributeError, match=r"kvmodels\.hf\.paged_cache\(model, policy\)"):
        compose("h2o", budget=0.5).hf_cache(model_of("llama"))


# --- the real checkpoint --------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_full_equals_generate_and_squeeze_h2o_matches_in_house(monkeypatch):
    model, batch = smollm2_hf(monkeypatch)
    plain, _ = run(model, batch, new=6)
    full, _ = run(model, batch, compose("full"), new=6)
    assert full == plain
    policy = compose("squeeze+h2o", budget=0.3)
    tokens, cache = run(model, batch, policy, new=6)
    dec = Decoder(in_house(model), policy)
    dec.extend(batch, max_new_tokens=6)
    assert tokens == dec.generate(6).tokens
    assert [kept(cache, b) for b in range(2)] == [kept(dec.cache, b) for b in range(2)]


@pytest.mark.slow
def test_smollm2_minicache_equals_in_house(monkeypatch):
    model, batch = smollm2_hf(monkeypatch)
    policy = compose("snapkv", "minicache", budget=0.5)
    tokens, cache = run(model, batch, policy, new=6)
    dec = Decoder(in_house(model), policy)
    dec.extend(batch, max_new_tokens=6)
    assert tokens == dec.generate(6).tokens
    assert cache.report().merged_pairs == dec.cache.report().merged_pairs != ()
    assert [kept(cache, b) for b in range(2)] == [kept(dec.cache, b) for b in range(2)]


@pytest.mark.slow
def test_smollm2_question_agnostic_setting_matches_the_decoder(monkeypatch):
    """The setting of docs/hf.md on the real SmolLM2: kvzip(skip=24)+pooled at 0.2 with KVzip's instruction
    as the probe prefix, the chat template's opening left out; a context, then a question."""
    from kvpolicies.eviction.kvzip import REPEAT

    model, _ = smollm2_hf(monkeypatch)
    tok = transformers.AutoTokenizer.from_pretrained(model.name_or_path)
    chat = tok.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                   tokenize=False)
    opening, _, gen = chat.partition("\x00")
    colours = ["red", "blue", "green", "gold", "grey", "pink", "teal", "jade", "rust", "plum"] * 2
    document = " ".join(f"The {w} key of room {i} is {i * 7 % 10}." for i, w in enumerate(colours))
    ctx = tok(opening + document).input_ids
    skip = len(tok(opening).input_ids)
    question = tok("\n\nWhat is the green key?" + gen, add_special_tokens=False).input_ids
    policy = compose(f"kvzip(skip={skip})", "pooled", budget=0.2)
    prefix = tok(REPEAT + gen, add_special_tokens=False).input_ids
    cache = paged_cache(model, policy, probe_prefix=prefix)
    ids = torch.tensor([ctx], device=DEVICE)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        asked = torch.cat([ids, torch.tensor([question], device=DEVICE)], 1)
        out = model.generate(input_ids=asked, past_key_values=cache, max_new_tokens=6, do_sample=False)
    dec = Decoder(in_house(model), policy, probe_prefix=prefix)
    dec.extend([ctx])
    dec.extend([question], max_new_tokens=6)
    assert out[0, len(ctx) + len(question):].tolist() == dec.generate(6).tokens[0]
    assert kept(cache, 0) == kept(dec.cache, 0)
