"""An extension in the transformers bridge: a forward of several tokens after the prompt (a question after
the context, a follow-up turn) does what ``kvmodels.decoder.Decoder.extend`` does: its tokens are scored with
``kvkernels.extend_attention`` over the kept tokens and themselves, then the policy re-plans every sequence
from all it has seen and each layer is compacted to the plan.

Checked against the Decoder on the tiny models of tests/test_hf_bridge.py: a forward on the left-padded
contexts, then ``generate`` with left-padded questions (kvmodels: ``extend([context])``,
``extend([question])``, ``generate``) keeps the same positions per (sequence, layer, KV head) and generates
the same tokens, for accumulating (h2o), decaying (a2sf), noisy (keyformer), window-voting (snapkv, tova),
forced-only (streaming), open-rule (knorm), layer-budget (squeeze), head-budget (duo) and quantized-row
(kivi(residual=0)) policies; so does a
second question after the first answer (per sequence, against a Decoder of it alone: see that test); a
ragged batch equals each sequence alone; merge policies are refused, as kvmodels refuses them. (Before, the
bridge ran such a forward as decode steps: h2o, snapkv, tova, squeeze+snapkv kept other tokens.)
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from kvmodels.decoder import Decoder  # noqa: E402
from kvpolicies import compose  # noqa: E402
from test_hf_bridge import NEW, left_pad, prompts  # noqa: E402
from test_hf_heads import DUO  # noqa: E402
from test_hf_kvzip import in_house, kept, model, prefill  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = {
    "h2o": lambda kind: compose("h2o", budget=0.4),
    "snapkv": lambda kind: compose("snapkv(window=4)", budget=0.4),
    "tova": lambda kind: compose("tova", budget=0.4),
    "streaming": lambda kind: compose("streaming", budget=0.4),
    "knorm": lambda kind: compose("knorm", budget=0.4),
    "squeeze+snapkv": lambda kind: compose("squeeze", "snapkv(window=4)", budget=0.4),
    "snapkv+duo": lambda kind: compose("snapkv(window=4)", ("duo", {"weights": DUO[kind], "fraction": 0.34}),
                                       budget=0.4),
    "h2o+kivi": lambda kind: compose("h2o", "kivi(bits=4, residual=0, group=8)", budget=0.4),
    "a2sf": lambda kind: compose("a2sf", budget=0.4),  # decayed scores: times decay**n, then the rows'
    "keyformer": lambda kind: compose("keyformer", budget=0.4, seed=3),  # the extension's noise is kvmodels'
}
CONTEXTS, QUESTIONS, FOLLOW_UPS = [20, 13], [5, 7], [3, 6]


def bridge(hf_model, policy, contexts, *turns):
    """A forward on the left-padded ``contexts``, then per turn ``generate`` with its left-padded questions
    after everything so far; returns the new tokens of each turn and the cache."""
    cache = policy.hf_cache(hf_model)
    ids, mask = left_pad(contexts)
    prefill(hf_model, cache, ids, mask)
    answers = []
    for questions in turns:
        q_ids, q_mask = left_pad(questions)
        ids, mask = torch.cat([ids, q_ids], 1), torch.cat([mask, q_mask], 1)
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                    past_key_values=cache, pad_token_id=0, use_cache=True)
        answers.append(out[:, ids.shape[1]:].tolist())
        ids, mask = out, torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], 1)
    return answers, cache


def decoder(hf_model, policy, contexts, *turns):
    """kvmodels: ``extend([context])``, then per turn ``extend(questions)`` and ``generate``."""
    dec = Decoder(in_house(hf_model), policy)
    dec.extend(contexts)
    answers = []
    for questions in turns:
        dec.extend(questions, max_new_tokens=NEW)
        answers.append(dec.generate(NEW).tokens)
    return answers, dec.cache


def assert_same(kind: str, spec: str, *turns) -> None:
    hf_model, policy = model(kind), SPECS[spec](kind)
    contexts = prompts(CONTEXTS, seed=7)
    ours, cache = bridge(hf_model, policy, contexts, *turns)
    theirs, ref = decoder(hf_model, policy, contexts, *turns)
    assert ours == theirs
    for b, ctx in enumerate(contexts):
        assert kept(cache, b) == kept(ref, b), f"sequence {b}"
        held = max(len(head) for layer in kept(cache, b) for head in layer)
        if spec != "knorm":  # compressed to the budget of everything seen (knorm evicts nothing after it)
            assert held < len(ctx) + sum(len(t[b]) for t in turns)


@pytest.mark.parametrize("spec", list(SPECS))
def test_question_after_context_keeps_what_the_decoder_keeps(spec):
    assert_same("llama", spec, prompts(QUESTIONS, seed=8))


@pytest.mark.parametrize("kind,spec", [("gptj", "snapkv"), ("mpt", "h2o"), ("smollm2", "tova")])
def test_question_after_context_on_other_models(kind, spec):
    assert_same(kind, spec, prompts(QUESTIONS, seed=8))


@pytest.mark.parametrize("spec", ["h2o", "snapkv", "snapkv+duo"])
def test_a_follow_up_after_the_answer_keeps_what_the_decoder_keeps(spec):
    """Context, question + generate, follow-up + generate: the second extension is the first answer's last
    token (generated, not yet fed) and the follow-up, as the Decoder feeds its pending token first. The bridge
    extends every sequence of the batch at once, the Decoder one after another (each ``end_extend``
    compresses its own sequence only): the same tokens kept either way."""
    hf_model, policy = model("llama"), SPECS[spec]("llama")
    contexts, questions, follow_ups = prompts(CONTEXTS, seed=7), prompts(QUESTIONS, seed=8), prompts(
        FOLLOW_UPS, seed=9)
    ours, cache = bridge(hf_model, policy, contexts, questions, follow_ups)
    theirs, ref = decoder(hf_model, policy, contexts, questions, follow_ups)
    assert ours == theirs
    for b in range(len(contexts)):
        assert kept(cache, b) == kept(ref, b), f"sequence {b}"


@pytest.mark.parametrize("spec", ["h2o", "snapkv+duo", "h2o+kivi"])
def test_ragged_batch_equals_each_sequence_alone(spec):
    hf_model, policy = model("llama"), SPECS[spec]("llama")
    contexts, questions = prompts([18, 9, 14], seed=5), prompts([6, 2, 4], seed=6)
    answers, cache = bridge(hf_model, policy, contexts, questions)
    for b, (ctx, question) in enumerate(zip(contexts, questions, strict=True)):
        alone, one = bridge(hf_model, policy, [ctx], [question])
        assert answers[0][b] == alone[0][0], f"sequence {b}"
        assert kept(cache, b) == kept(one, 0), f"sequence {b}"


def test_the_extension_differs_from_decode_steps():
    """The extension re-plans and compresses: after a question h2o holds each layer at the budget of the
    context and the question (decode steps kept the context's budgets)."""
    hf_model, policy = model("llama"), SPECS["h2o"]("llama")
    ctx, question = prompts([20, 6], seed=3)
    cache = policy.hf_cache(hf_model, max_new_tokens=4)
    with torch.no_grad():
        hf_model(input_ids=torch.tensor([ctx], device=DEVICE), past_key_values=cache, use_cache=True)
        hf_model(input_ids=torch.tensor([question], device=DEVICE), past_key_values=cache, use_cache=True)
    after = cache.report()
    assert after.layer_budgets[:, 0].tolist() == compose("h2o", budget=0.4).plan(
        torch.tensor([26]), len(cache.layers)).storage.budgets[:, 0].tolist()
    assert after.tokens_per_layer[:, 0].tolist() == after.layer_budgets[:, 0].tolist()


def test_merge_policies_are_refused_as_kvmodels_refuses_them():
    hf_model = model("llama")
    policy = compose("h2o", "minicache", budget=0.5)
    ctx, question = prompts([20, 4], seed=3)
    cache = policy.hf_cache(hf_model, max_new_tokens=4)
    with torch.no_grad():
        hf_model(input_ids=torch.tensor([ctx], device=DEVICE), past_key_values=cache, use_cache=True)
        with pytest.raises(NotImplementedError, match="merges layers.*several tokens.*kvmodels.Decoder"):
            hf_model(input_ids=torch.tensor([question], device=DEVICE), past_key_values=cache, use_cache=True)
        step = torch.tensor([question[:1]], device=DEVICE)
        hf_model(input_ids=step, past_key_values=cache, use_cache=True)  # a decode step goes on
    dec = Decoder(in_house(hf_model), policy)
    dec.extend([ctx])
    with pytest.raises(NotImplementedError, match="merges layers"):
        dec.extend([question])
