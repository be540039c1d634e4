"""kvzip in the transformers bridge: the cache runs the reconstruction pass itself (the context's ids fed
again, after ``probe_prefix``, as nested forwards of the model) before the first forward after the prefill.

Checked against ``kvmodels.decoder.Decoder`` on the tiny models of tests/test_hf_bridge.py (Llama, SmolLM2-
shaped, GPT-J, MPT), with ``kvzip`` alone, with ``pooled``, in spans, with ``skip`` and a probe prefix:
* one shot (``model.generate(prompt)``) and a question after the context (a forward on the context, then
  ``generate`` with the question; kvmodels: ``extend([context])``, ``extend([question])``, ``generate``):
  the same kept positions per (sequence, layer, KV head) and the same generated tokens;
* a left-padded ragged batch (contexts of different lengths, so different numbers of passes) equals each
  sequence alone;
* the probe stores nothing: after it the cache holds the budget's tokens at the context's positions only,
  its bytes are the budget's, and the logical length is the context's;
* bad inputs fail with a message naming the argument and the fix.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from kvmodels.decoder import Decoder  # noqa: E402
from kvpolicies import compose  # noqa: E402
from kvpolicies.hf import compressed  # noqa: E402
from test_hf_bridge import _IN_HOUSE, NEW, left_pad, model_of, prompts, run, smollm2_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama", "smollm2", "gptj", "mpt"]
PREFIX = [5, 6, 7]  # a probe prefix (KVzip's instruction, in miniature)
#: (policy, probe prefix). Few forced tokens (sinks, recent), so that the pass's ranking decides most kept
#: tokens of these short contexts (kvzip's defaults force 12) and ``pooled`` splits them unevenly; with spans
#: the contexts of the batch below take 3 and 4 passes (2 and 3 with ``skip``).
SPECS = {
    "kvzip": ("kvzip(sinks=1, recent=2)", []),
    "kvzip+pooled": ("kvzip(sinks=1, recent=2)+pooled", []),
    "kvzip(span)": ("kvzip(span=6, sinks=1, recent=2)", []),
    "kvzip(skip)+pooled+prefix": ("kvzip(skip=3, sinks=2, recent=2)+pooled", PREFIX),
    "kvzip(span, skip)+pooled+prefix": ("kvzip(span=5, skip=2, sinks=1, recent=2)+pooled", PREFIX),
}
BATCH = [20, 13]


def model(kind: str) -> torch.nn.Module:
    return model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")


def in_house(hf_model):
    """The kvmodels twin of ``hf_model`` (one conversion per model, shared with test_hf_bridge)."""
    from kvmodels.gptj import GPTJ
    from kvmodels.loading import from_transformers
    from kvmodels.mpt import MPT

    if id(hf_model) not in _IN_HOUSE:
        build = {"GPTJForCausalLM": GPTJ.from_hf, "MptForCausalLM": MPT.from_hf}.get(
            type(hf_model).__name__, from_transformers)
        _IN_HOUSE[id(hf_model)] = build(hf_model)
    return _IN_HOUSE[id(hf_model)]


def kept(cache, b: int) -> list[list[list[int]]]:
    """[layer][KV head] -> sorted positions sequence ``b`` keeps (the bridge's or a kvmodels cache's)."""
    n = getattr(cache, "n_layers", None) or len(cache.layers)
    return [[sorted(d["pos"].tolist()) for d in cache.head_contents(l, b)] for l in range(n)]


def policy_of(spec: str):
    text, prefix = SPECS[spec]
    first, *heads = text.split("+")
    return compose(first, *heads, budget=0.3), prefix


def prefill(hf_model, cache, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """A forward on the (left-padded) context: the cache's prefill. Positions from the mask, as generate
    derives them (MPT takes none: ALiBi, the bridge's positions)."""
    kw = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    if type(hf_model).__name__.startswith("Mpt"):
        kw = {}
    with torch.no_grad():
        hf_model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", list(SPECS))
def test_one_shot_keeps_what_the_decoder_keeps(kind, spec):
    policy, prefix = policy_of(spec)
    hf_model, batch = model(kind), prompts(BATCH, seed=7)
    ids, mask = left_pad(batch)
    cache = policy.hf_cache(hf_model, probe_prefix=prefix)
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                past_key_values=cache, pad_token_id=0, use_cache=True)
    dec = Decoder(in_house(hf_model), policy, probe_prefix=prefix)
    dec.extend(batch)
    assert out[:, ids.shape[1]:].tolist() == dec.generate(NEW).tokens
    for b, p in enumerate(batch):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"
        # compressed: each head keeps its budget's share of the context, then every decoded token
        context = [[x for x in head if x < len(p)] for layer in kept(cache, b) for head in layer]
        assert max(map(len, context)) < len(p)
    if policy.heads.per_head:  # pooled really moved slots between heads and layers
        split = cache.plan.head_budgets
        assert bool((split != split[..., :1]).any()), split.tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["kvzip+pooled", "kvzip(span)", "kvzip(skip)+pooled+prefix"])
def test_question_after_context_keeps_what_the_decoder_keeps(kind, spec):
    """A forward on the left-padded contexts, then ``generate`` with the left-padded questions after them:
    the pass runs before the question's forward, which attends to the compressed context."""
    policy, prefix = policy_of(spec)
    hf_model = model(kind)
    contexts, questions = prompts(BATCH, seed=7), prompts([4, 6], seed=8)
    (ctx_ids, ctx_mask), (q_ids, q_mask) = left_pad(contexts), left_pad(questions)
    cache = policy.hf_cache(hf_model, probe_prefix=prefix)
    prefill(hf_model, cache, ctx_ids, ctx_mask)
    ids, mask = torch.cat([ctx_ids, q_ids], 1), torch.cat([ctx_mask, q_mask], 1)
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                past_key_values=cache, pad_token_id=0, use_cache=True)
    dec = Decoder(in_house(hf_model), policy, probe_prefix=prefix)
    dec.extend(contexts)
    dec.extend(questions, max_new_tokens=NEW)
    assert out[:, ids.shape[1]:].tolist() == dec.generate(NEW).tokens
    for b in range(len(contexts)):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"


@pytest.mark.parametrize("kind", ["llama", "mpt"])
def test_ragged_batch_equals_each_sequence_alone(kind):
    policy, prefix = policy_of("kvzip(span, skip)+pooled+prefix")
    hf_model, batch = model(kind), prompts([22, 9, 16], seed=5)  # 4, 2 and 3 passes

    def generate(prompts_):
        ids, mask = left_pad(prompts_)
        cache = policy.hf_cache(hf_model, probe_prefix=prefix)
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                    past_key_values=cache, pad_token_id=0, use_cache=True)
        return out[:, ids.shape[1]:].tolist(), cache

    tokens, cache = generate(batch)
    for b, p in enumerate(batch):
        alone_tokens, alone = generate([p])
        assert tokens[b] == alone_tokens[0], f"sequence {b}"
        assert kept(cache, b) == kept(alone, 0), f"sequence {b}"


@pytest.mark.parametrize("spec", ["kvzip", "kvzip+pooled"])
def test_the_probe_stores_nothing(spec):
    """After the pass (here forced by report()) each head holds exactly its budget of context tokens, at the
    context's positions; the bytes are the budget's; the cache's logical length is still the context's."""
    policy, _ = policy_of(spec)
    hf_model = model("gptj")  # 4 KV heads
    context = prompts([30], seed=2)
    cache = policy.hf_cache(hf_model, probe_prefix=PREFIX)
    prefill(hf_model, cache, *left_pad(context))
    rep = cache.report()
    assert cache.get_seq_length() == 30 and cache.prompt_lens.tolist() == [30]
    budgets = cache.plan.head_budgets if policy.heads.per_head else cache.plan.layers.budgets[..., None]
    for l, layer in enumerate(cache.layers):
        heads = cache.head_contents(l, 0)
        assert [len(h["pos"]) for h in heads] == budgets[l, 0].expand(4).tolist()
        assert all(int(h["pos"].max()) < 30 for h in heads)  # no probe token stored
        B, H, n, D = layer.dense()[0].shape  # the view a forward reads: padded to the longest head only
        assert n == int(budgets[l, 0].max()) < 30
        kept = sum(len(h["pos"]) for h in heads)  # held: each head its own count (ragged with head budgets)
        assert rep.bytes_per_layer[l] == 2 * kept * D * layer.keys.element_size()
    assert rep.peak_bytes == rep.full_cache_bytes  # the uncompressed prompt, never more: the pass stored none
    if not policy.heads.per_head:  # K+V x layers x heads x ceil(0.3 * 30) x D x fp32
        assert rep.total_bytes == 2 * len(cache.layers) * 4 * 9 * 16 * 4


def test_compressed_takes_the_probe_prefix():
    policy, prefix = policy_of("kvzip(skip)+pooled+prefix")
    hf_model, batch = model("llama"), prompts(BATCH, seed=7)
    explicit, cache = run(hf_model, batch, policy)  # no prefix: a different pass
    ids, mask = left_pad(batch)
    with compressed(hf_model, policy, probe_prefix=prefix) as caches, torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)
    dec = Decoder(in_house(hf_model), policy, probe_prefix=prefix)
    dec.extend(batch)
    assert out[:, ids.shape[1]:].tolist() == dec.generate(NEW).tokens
    assert caches[0].probe_prefix == prefix and kept(caches[0], 0) == kept(dec.cache, 0) != kept(cache, 0)


def test_bad_inputs_name_the_argument_and_the_fix():
    hf_model = model("llama")  # 128 positions
    kvzip = compose("kvzip", budget=0.3)
    long = left_pad(prompts([70], seed=1))
    with pytest.raises(ValueError, match=r"input_ids\[0\].*70 tokens again.*context of 128.*kvzip\(span=N\)"):
        prefill(hf_model, kvzip.hf_cache(hf_model), *long)
    with pytest.raises(ValueError, match=r"after the 3 tokens of probe_prefix.*lower span"):
        prefill(hf_model, compose("kvzip(span=60)", budget=0.3).hf_cache(hf_model, probe_prefix=PREFIX),
                *long)
    prefill(hf_model, compose("kvzip(span=16)", budget=0.3).hf_cache(hf_model, probe_prefix=PREFIX), *long)
    with pytest.raises(ValueError, match=r"input_ids\[1\].*from token 12 on.*lower skip"):
        prefill(hf_model, compose("kvzip(skip=12)", budget=0.3).hf_cache(hf_model),
                *left_pad(prompts([20, 12])))
    embeds = hf_model.get_input_embeddings()(long[0])
    with pytest.raises(ValueError, match=r"'kvzip'.*pass the prompt as input_ids=, not inputs_embeds="):
        with torch.no_grad():
            hf_model(inputs_embeds=embeds, past_key_values=kvzip.hf_cache(hf_model), use_cache=True)
    with pytest.raises(ValueError, match="probe_prefix.*'h2o' runs none; use kvzip"):
        compose("h2o", budget=0.3).hf_cache(hf_model, probe_prefix=PREFIX)
    with pytest.raises(ValueError, match="probe_prefix must be a list of token ids.*tokenize"):
        kvzip.hf_cache(hf_model, probe_prefix="Repeat the previous context.")
    with pytest.raises(ValueError, match="'kvzip\\+minicache'.*merge policy 'minicache'"):
        compose("kvzip", "minicache", budget=0.3).hf_cache(hf_model)


@pytest.mark.slow
def test_smollm2_question_agnostic_setting_matches_the_decoder(monkeypatch):
    """The setting of docs/hf.md on the real SmolLM2: kvzip(skip=24)+pooled at 0.2 with KVzip's instruction
    as the probe prefix, the chat template's opening left out; a context, then a question."""
    from kvmodels.loading import from_transformers
    from kvpolicies.eviction.kvzip import REPEAT

    hf_model, _ = smollm2_hf(monkeypatch)
    tok = transformers.AutoTokenizer.from_pretrained(hf_model.name_or_path)
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
    cache = policy.hf_cache(hf_model, probe_prefix=prefix)
    ids = torch.tensor([ctx], device=DEVICE)
    with torch.no_grad():
        hf_model(input_ids=ids, past_key_values=cache, use_cache=True)
        asked = torch.cat([ids, torch.tensor([question], device=DEVICE)], 1)
        out = hf_model.generate(input_ids=asked, past_key_values=cache, max_new_tokens=6, do_sample=False)
    dec = Decoder(from_transformers(hf_model), policy, probe_prefix=prefix)
    dec.extend([ctx])
    dec.extend([question], max_new_tokens=6)
    assert out[0, len(ctx) + len(question):].tolist() == dec.generate(6).tokens[0]
    assert kept(cache, 0) == kept(dec.cache, 0)
