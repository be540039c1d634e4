"""experiments/question_agnostic.py at a tiny setting: the question fed after the context's compression
(both protocols) equals one-shot greedy decoding under the full cache, replayed contexts change nothing,
head-budget configs run through the feed protocol, and the script's pieces (question split, table, entry
point, the story task's records) work."""

from __future__ import annotations

import pytest
import torch

from evals.tasks import PrefillReplay
from experiments import question_agnostic as qa
from kvmodels.generate import generate
from kvpolicies import compose
from test_generate import V, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
G = torch.Generator().manual_seed(3)
CONTEXT = [int(x) for x in torch.randint(0, V, (30,), generator=G)]
REST = [int(x) for x in torch.randint(0, V, (5,), generator=G)]


def test_full_cache_answers_as_one_shot_greedy():
    want = generate(MODEL, [CONTEXT + REST], 4).tokens[0]
    policy = compose("full", evict_every=qa.EVICT_EVERY)
    assert qa.answer_feed(MODEL, policy, CONTEXT, REST, 4) == want
    assert qa.answer_extend(MODEL, policy, CONTEXT, REST, 4) == want


def test_streamed_protocols_answer_as_one_shot_greedy_under_the_full_cache():
    """``stream`` / ``stream-sized`` / ``stream-pool``: the context and the question fed 8 tokens at a time;
    the full cache keeps every token, in a cache of the model's context or of exactly the tokens."""
    want = generate(MODEL, [CONTEXT + REST], 4).tokens[0]
    policy = compose("full", evict_every=qa.EVICT_EVERY)
    for bound in (None, "layer", "pool"):
        assert qa.answer_stream(MODEL, policy, CONTEXT, REST, 4, chunk=8, bound=bound) == want


def test_replayed_contexts_change_nothing():
    replay = PrefillReplay(MODEL)
    replay.record([CONTEXT, CONTEXT[:8]])  # and the first chunk of the stream protocols
    model = replay  # the context replayed, the rest (the question, kvzip's reconstruction) the model's
    for text in ("snapkv(window=4)", "streaming", "kvzip"):
        policy = compose(text, budget=0.5, evict_every=qa.EVICT_EVERY)
        assert (qa.answer_feed(model, policy, CONTEXT, REST, 3)
                == qa.answer_feed(MODEL, policy, CONTEXT, REST, 3))
        assert (qa.answer_extend(model, policy, CONTEXT, REST, 3)
                == qa.answer_extend(MODEL, policy, CONTEXT, REST, 3))
        for bound in ("layer", "pool"):
            assert (qa.answer_stream(model, policy, CONTEXT, REST, 3, chunk=8, bound=bound)
                    == qa.answer_stream(MODEL, policy, CONTEXT, REST, 3, chunk=8, bound=bound))


def test_head_budget_configs_run_through_the_feed_protocol():
    policies = qa.build_policies(["snapkv+duo", "profile+snapkv+duo", "full"], [0.3], MODEL,
                                 snapkv="snapkv(window=4)")
    assert set(policies) == {("snapkv+duo", 0.3), ("profile+snapkv+duo", 0.3), ("full", 1.0)}
    policy = policies[("profile+snapkv+duo", 0.3)]
    assert policy.heads.per_head and len(policy.heads.weights) == 2 and len(policy.budget_policy.weights) == 2
    out = qa.answer_feed(MODEL, policy, CONTEXT, REST, 3)
    assert len(out) == 3
    ht = qa.after_context(MODEL, policy, CONTEXT).head_tokens
    assert len(ht) == 2 and all(len(layer[0]) == 2 for layer in ht)
    with pytest.raises(ValueError, match="evict_every"):
        qa.answer_feed(MODEL, compose("streaming", budget=0.5), CONTEXT, REST, 3)


class _Tok:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) if i < 26 else " " for i in ids)


def test_split_question_and_table(tmp_path, capsys):
    prompt = [0, 1, 2, 30, 3, 4, 5, 6]  # "abc" + " " + "defg"
    assert qa.split_question(_Tok(), prompt, "def") == ([0, 1, 2, 30], [3, 4, 5, 6])  # the shortest suffix
    with pytest.raises(ValueError, match="question"):
        qa.split_question(_Tok(), prompt, "xyz")
    records = [{"config": "full", "budget": 1.0, "protocol": "feed", "correct": 5, "n": 6},
               {"config": "snapkv", "budget": 0.5, "protocol": "feed", "correct": 2, "n": 6},
               {"config": "snapkv+duo", "budget": 0.2, "protocol": "feed", "correct": 1, "n": 6}]
    text = qa.table(records)
    assert text.splitlines()[0] == "| config | 0.2, feed | 0.5, feed |"
    assert "| full | 5/6 | 5/6 |" in text and "| snapkv | — | 2/6 |" in text
    from evals.sweep import append_record

    out = tmp_path / "r.jsonl"
    for r in records:
        append_record(out, r)
    assert qa.main(["--report", "--out", str(out)]) == 0
    append_record(out, {"config": "snapkv", "budget": 0.5, "protocol": "feed", "correct": 4, "n": 6,
                        "task": "story"})
    capsys.readouterr()
    assert qa.main(["--report", "--out", str(out), "--task", "story"]) == 0
    story = capsys.readouterr().out  # the story's record alone: the passkey records stay in their table
    assert "| snapkv | 4/6 |" in story and "full" not in story
    append_record(out, {"config": "snapkv", "budget": 0.5, "protocol": "feed", "correct": 6, "n": 6,
                        "seed": 1})
    assert qa.main(["--report", "--out", str(out)]) == 0
    assert "| snapkv | — | 2/6 |" in capsys.readouterr().out  # seed 0's table: seed 1's record stays out
    assert qa.main(["--report", "--out", str(out), "--seed", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == ["| snapkv | 6/6 |"]  # seed 1's record alone
    with pytest.raises(SystemExit) as e:
        qa.main(["--help"])
    assert e.value.code == 0


def test_quantized_configs_record_their_bytes():
    """A cache holding every context token at 4 bits: its held share of an fp16 cache is its slot's bytes over
    an fp16 slot's, and the unquantized full cache's same-dtype share is 1 (the tiny model's head dim is 8, so
    the configs' group of 32 becomes 8 here)."""
    from experiments.quantized_kv import fp16_share

    assert qa.CONFIGS["full+kivi4"] == "full+kivi(bits=4, residual=0)"
    assert "kvzip(skip=24)+pooled+kivi4+repeat" in qa.REPEAT_CONFIGS
    kivi4 = compose("full+kivi(bits=4, residual=0, group=8)", budget=1.0, evict_every=qa.EVICT_EVERY)
    quant = fp16_share(qa.after_context(MODEL, kivi4, CONTEXT), MODEL)
    full = fp16_share(qa.after_context(MODEL, compose("full"), CONTEXT), MODEL)
    assert full["held_vs_full_same_dtype"] == pytest.approx(1.0)
    assert quant["slot_bytes"] < quant["fp16_slot_bytes"] < full["slot_bytes"]  # fp32 model: 4 < 16 < 32 bits
    assert quant["held_vs_fp16"] == pytest.approx(quant["slot_bytes"] / quant["fp16_slot_bytes"])
    assert len(qa.answer_feed(MODEL, kivi4, CONTEXT, REST, 3)) == 3
