"""Random compositions of every role, run for several turns: each runs, or is refused by name.

``test_model_policy_matrix`` runs every eviction x layer-budget x merge policy on every model family, one
turn, in one storage. This draws the rest of the space at random: a head-budget policy and a precision too,
ragged prompts of 1-31 tokens, page sizes from 1 to 16, budgets as fractions and as token counts, chunked
prefill and follow-up turns (some sequences given nothing new), caches of the model's context or smaller
(``max_tokens``), on models whose head dim (32) every storage format fits.
What may not happen: an error that is not a refusal naming the policy or the argument (an ``IndexError`` or a
shape error from deep inside; a ``RuntimeError`` when a step finds a layer full), a token outside the
vocabulary, a turn that generates fewer tokens than asked (no eos ids), a report whose bytes exceed the
full cache's, a refusal of the model's fit (``duo`` without weights) after a turn ran, or the cache's own
refusal of a chunk past ``max_tokens``, which the Decoder must make before the prompt's first chunk.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, example, given

from devices import DEVICE
from kvmodels.decoder import Decoder
from kvmodels.gptj import GPTJ, GPTJConfig
from kvmodels.lckv import LCKV, LCKVConfig
from kvmodels.llama import Llama, LlamaConfig
from kvmodels.mpt import MPT, MPTConfig
from kvpolicies import available, compose
from test_model_policy_matrix import widen

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 29
DEFAULTS = {"full", "uniform", "even", "native", "none"}  # what compose fills in: a refusal names another
EVICTIONS = [p.name for p in available(role="eviction")]
BUDGETS = [p.name for p in available(role="budget")]
HEADS = [p.name for p in available(role="heads")]
PRECISIONS = ["native", "kivi", "kivi(bits=2, residual=0)", "kivi(bits=4, group=8, residual=8)",
              "kivi(bits=8, residual=0, rotate=True)", "zipcache", "zipcache(rotate=True, every=3)", "mikv",
              "mikv(low=4)"]


# (cache layers, KV heads) of each model below: the weights profile and duo are drawn with
LAYOUTS = {"llama": (3, 1), "gptj": (3, 2), "mpt": (3, 2), "lckv": (2, 1)}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)  # built, moved and checked once for every example
    llama = LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=2, n_kv_heads=1, intermediate=32,
                        max_seq_len=80)
    models = {
        "llama": widen(Llama(llama), 0.1),
        "gptj": widen(GPTJ(GPTJConfig(vocab_size=VOCAB, n_layers=3, n_heads=2, hidden_size=64, rotary_dim=8,
                                      intermediate_size=32, max_seq_len=80)), 0.1),
        "mpt": widen(MPT(MPTConfig(vocab_size=VOCAB, n_layers=3, n_heads=2, hidden_size=64,
                                   intermediate_size=32, max_seq_len=80)), 0.1),
        "lckv": widen(LCKV(LCKVConfig(LlamaConfig(**{**llama.to_dict(), "n_layers": 4}), warmup_bottom=1,
                                      warmup_top=1, forward_iterations=2, backward_iterations=1)), 0.1),
    }
    for family, model in models.items():
        layout = model.to(DEVICE).cache_layout()
        assert (layout.n_layers, layout.n_kv_heads) == LAYOUTS[family]
    return models


def _part(draw, name: str, n_layers: int, n_kv_heads: int):
    """``name``, with the weights ``profile`` and ``duo`` need drawn for this model."""
    if name == "profile":
        return name, {"weights": tuple(draw(st.floats(0.1, 2.0)) for _ in range(n_layers))}
    if name == "duo":
        if draw(st.integers(0, 4)) == 0:
            return name  # not calibrated: refused where the Decoder is built
        row = st.tuples(*[st.floats(0.0, 1.0)] * n_kv_heads)
        return name, {"weights": tuple(draw(row) for _ in range(n_layers))}
    return name


@st.composite
def runs(draw):
    family = draw(st.sampled_from(sorted(LAYOUTS)))
    n_layers, n_kv_heads = LAYOUTS[family]
    parts = [draw(st.sampled_from(EVICTIONS)),
             _part(draw, draw(st.sampled_from(BUDGETS)), n_layers, n_kv_heads),
             _part(draw, draw(st.one_of(st.just("even"), st.sampled_from(HEADS))), n_layers, n_kv_heads),
             draw(st.one_of(st.just("native"), st.sampled_from(PRECISIONS))),
             draw(st.sampled_from(["none", "none", "none", "minicache"]))]
    kw = {"budget": draw(st.sampled_from([0.1, 0.2, 0.5, 1.0, 3, 8])), "evict_every": draw(st.integers(1, 3))}
    batch = draw(st.integers(1, 3))
    prompts = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=31), min_size=batch,
                            max_size=batch))
    # later turns: 0-6 new tokens per sequence (some nothing), at least one sequence given some
    turn = st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=6), min_size=batch, max_size=batch)
    turns = draw(st.lists(turn.map(lambda t: t if any(t) else [[1], *t[1:]]), max_size=2))
    return dict(family=family, parts=parts, kw=kw, prompts=prompts, turns=turns,
                page_size=draw(st.sampled_from([1, 2, 4, 16])),
                # a cache of the model's context, or one too small for some layers' budgets or a prompt
                max_tokens=draw(st.sampled_from([80, 80, 80, 12, 20, 32])),
                chunk=draw(st.sampled_from([None, None, 1, 4, 7])),
                new=draw(st.lists(st.integers(1, 4), min_size=len(turns) + 1, max_size=len(turns) + 1)))


def _refused_by_name(e: Exception, policy) -> bool:
    msg = str(e)
    parts = [p.name for p in policy.policies().values() if p.name not in DEFAULTS]
    return (any(n in msg for n in [policy.name, *parts])  # the policy, or the part that refuses,
            or "chunk" in msg or "max_tokens" in msg  # or the argument that cannot be served
            or any(n in msg for n in ("LCKV", "ALiBi")))  # or the model that cannot take it


def _found(precision: str, evict_every: int) -> dict:
    """The draw that found a decode step past max_tokens (a follow-up appended to two formats' main region
    whole, then the first steps before an eviction): refused before the generation since."""
    return dict(family="gptj", parts=["a2sf", "pyramid", "even", precision, "none"],
                kw={"budget": 0.1, "evict_every": evict_every}, prompts=[[0], [0], [0, 0, 0, 0]],
                turns=[[[], [], [0] * 6]], page_size=1, max_tokens=12, chunk=None, new=[1, 3])


@given(runs())
@example(run=_found("kivi", 1))
@example(run=_found("mikv", 2))
def test_random_compositions_run_or_are_refused_by_name(models, run):
    try:
        policy = compose(*run["parts"], **run["kw"])
    except (ValueError, TypeError) as e:  # checked up front; the message names a policy composed
        names = {(p if isinstance(p, str) else p[0]).split("(")[0] for p in run["parts"]} - DEFAULTS
        assert any(n in str(e) for n in names), e
        event("refused by compose")
        return
    model = models[run["family"]]
    generated = False
    try:
        dec = Decoder(model, policy, page_size=run["page_size"], max_tokens=run["max_tokens"])
        for turn, (tokens, new) in enumerate(zip([run["prompts"], *run["turns"]], run["new"])):
            dec.extend(tokens, chunk=run["chunk"] if turn == 0 else None)
            res = dec.generate(new)
            generated = True
            assert [len(t) for t in res.tokens] == [new] * len(run["prompts"]), res.tokens
            assert all(0 <= t < VOCAB for seq in res.tokens for t in seq)
            rep = res.report
            assert 0 < rep.total_bytes <= rep.full_cache_bytes or policy.precision.name == "mikv", rep
        event("ran every turn")
    except (ValueError, NotImplementedError) as e:
        assert _refused_by_name(e, policy), f"{type(e).__name__} (turns generated: {generated}): {e}"
        assert not (generated and "weights is empty" in str(e)), e
        assert "slots per layer" not in str(e), e  # the cache's own overflow: the Decoder must refuse first
        event(f"refused by the model or cache ({'after' if generated else 'before'} a turn)")
