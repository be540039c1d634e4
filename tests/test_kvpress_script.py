"""experiments/kvpress_question_agnostic.py (kvpress on the question-agnostic passkey prompts, issue 37), the
parts that run without kvpress: the report table from a JSON lines file, argument errors, a missing kvpress
named in one line with its install, the ratio for a budget, and the (context, question) texts the pipeline
gets from our split. The runs themselves need kvpress (its own venv, see the script's docstring)."""

from __future__ import annotations

import pytest

from experiments import kvpress_question_agnostic as kq


def _records(press, budget, correct, n=3, context=1024, **extra):
    return [{"press": press, "budget": budget, "sample": i, "correct": bool(c), "n": n, "context": context,
             **extra} for i, c in enumerate(correct)]


RECORDS = (_records("full", 1.0, [1, 1, 0])
           + _records("snapkv", 0.2, [0, 0, 1]) + _records("snapkv", 0.5, [1, 1, 0])
           + _records("expected_attention", 0.5, [1, 0])  # 2 of 3 prompts run
           + _records("kvzip", 0.2, [0, 0, 0], error="RuntimeError: boom")
           + _records("snapkv", 0.5, [1, 1, 0], context=2048))  # another --context: not in the 1024 table


def test_table():
    text = kq.table([r for r in RECORDS if r["context"] == 1024])
    assert text.splitlines() == [
        "| press | 0.2 | 0.5 |",
        "|---|---|---|",
        "| full | 2/3 | 2/3 |",
        "| snapkv | 1/3 | 2/3 |",
        "| expected_attention | — | 1/3 (partial: 2 run) |",
        "| kvzip | error | — |",
    ]
    assert kq.table([]) == "(no records)"
    # a later record of a prompt replaces the earlier one
    again = kq.table(_records("snapkv", 0.5, [0, 0, 0]) + _records("snapkv", 0.5, [1, 1, 1]))
    assert again.splitlines()[2] == "| snapkv | 3/3 |"
    # the feed protocol's records are rows of their own, after the pipeline's row of the same press
    feed = kq.table(_records("full", 1.0, [1, 1, 1], protocol="feed") + _records("full", 1.0, [1, 1, 0])
                    + _records("pyramidkv", 0.5, [0, 0, 0], error="RuntimeError: mask")
                    + _records("pyramidkv", 0.5, [1, 0, 1], protocol="feed"))
    assert feed.splitlines()[2:] == ["| full | 2/3 |", "| full (feed) | 3/3 |", "| pyramidkv | error |",
                                     "| pyramidkv (feed) | 2/3 |"]


def test_report_prints_the_table_of_one_context(tmp_path, capsys):
    from evals.sweep import append_record

    out = tmp_path / "r.jsonl"
    for r in RECORDS:
        append_record(out, r)
    assert kq.main(["--report", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == kq.table([r for r in RECORDS if r["context"] == 1024])
    assert kq.main(["--report", "--out", str(out), "--context", "2048"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[2] == "| snapkv | 2/3 |"
    assert kq.main(["--report", "--out", str(tmp_path / "none.jsonl")]) == 0
    assert capsys.readouterr().out.strip() == "(no records)"


@pytest.mark.parametrize("argv, message", [
    (["--presses", "full,h2o"], "--presses: unknown"),
    (["--budgets", "0.2,half"], "--budgets"),
    (["--budgets", "1.0"], "(0, 1)"),
    (["--n", "0"], "--n"),
    (["--new", "0"], "--new"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        kq.main([*argv, "--report"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_kvpress_is_one_line_with_its_install(monkeypatch, capsys):
    monkeypatch.setattr(kq, "KVPRESS_MODULE", "no_such_kvpress_module")
    with pytest.raises(SystemExit) as e:
        kq.main(["--n", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pip install kvpress" in err
    # --report needs no kvpress
    assert kq.parse(["--report"]).report


def test_compression_ratio_and_presses():
    assert kq.compression_ratio(0.2) == 0.8 and kq.compression_ratio(0.5) == 0.5
    assert kq.compression_ratio(0.7) == 0.3  # not 0.30000000000000004
    assert kq.PRESSES["full"] is None
    for name in ("streaming_llm", "snapkv", "tova", "knorm", "expected_attention", "observed_attention"):
        assert kq.PRESSES[name][-1].endswith("Press")
    assert kq.PRESSES["adakv_snapkv"] == ("AdaKVPress", "SnapKVPress")  # the wrapper first
    assert kq.EAGER == {"observed_attention"}


class _ChatTok:
    """A chat tokenizer in miniature: one character a token, a template like SmolLM2's (system turn, user
    turn, assistant header)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        assert add_generation_prompt and not tokenize
        return f"<s>sys</s><s>user {messages[0]['content']}</s><s>bot "

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        text = "".join(chr(i) for i in ids)
        return text.replace(" '", "'") if clean_up_tokenization_spaces else text  # as transformers' clean-up


def test_pipeline_inputs_from_our_split():
    tok = _ChatTok()
    assert kq.template_parts(tok) == ("<s>sys</s><s>user ", "</s><s>bot ")
    user = "Text 'mong. Key 5. What is it?"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": user}]) + "It is")
    cut = prompt.index(ord("W")) - 1  # our split: the question starts with its space
    context, question = kq.pipeline_inputs(tok, prompt[:cut], prompt[cut:], "It is")
    assert (context, question) == ("Text 'mong. Key 5.", " What is it?")  # the space before ' is kept
    with pytest.raises(ValueError, match="answer prefix|It is"):
        kq.pipeline_inputs(tok, prompt[:cut], prompt[cut:-1], "It is")
    with pytest.raises(ValueError, match="user prefix"):
        kq.pipeline_inputs(tok, prompt[3:cut], prompt[cut:], "It is")


# --- --task story ---------------------------------------------------------------------------------------

# A word-level tokenizer and a text, so prompts need no checkpoint (tests/test_eval.py's).
from test_eval import TEXT as _TEXT  # noqa: E402
from test_eval import WordTokenizer as _WordTok  # noqa: E402


@pytest.mark.parametrize("task", kq.TASKS)
def test_prompts_and_cut_are_the_harness_ones(task):
    """The samples, the cut and the answer prefix of experiments/question_agnostic.py's main()
    (Runner.samples, then split_question with the sample's question): the same prompts for the same seed,
    context and n."""
    from types import SimpleNamespace

    from evals import tasks
    from evals.sweep import Runner
    from experiments.question_agnostic import split_question

    tok = _WordTok()
    corpus = tasks.Corpus.from_text(_TEXT, tok)
    runner = SimpleNamespace(tokenizer=tok, corpus=corpus, seed=3, _samples={})
    theirs = Runner.samples(runner, task, 300, 6)  # what question_agnostic.main() runs
    samples, pieces, prefixes = kq.build_prompts(task, tok, corpus, 6, 300, 3)
    assert samples == theirs
    assert pieces == [split_question(tok, s.prompt, s.question or tasks.PASSKEY_QUESTION) for s in theirs]
    for s, (context, rest), prefix in zip(samples, pieces, prefixes, strict=True):
        assert list(context) + list(rest) == list(s.prompt)
        question = s.question or tasks.PASSKEY_QUESTION
        assert tok.decode(rest).startswith(question) and tok.decode(rest).endswith(prefix)
        assert question not in tok.decode(context)
        if task == "story":
            role_pet = question.removeprefix("What was the ").removesuffix(" called?")
            assert prefix == f"The {role_pet} was called" and s.answer in tasks.STORY_NAMES
        else:
            assert prefix == tasks.PASSKEY_ANSWER_PREFIX
    assert len({s.prompt for s in samples}) == 6


def test_story_answer_prefix():
    from evals import tasks

    assert (kq.answer_prefix("story", "What was the first mate's goat called?")
            == "The first mate's goat was called")
    assert kq.answer_prefix("passkey", tasks.PASSKEY_QUESTION) == tasks.PASSKEY_ANSWER_PREFIX
    for role in tasks.STORY_ROLES:
        for pet in tasks.STORY_PETS:
            question = tasks.STORY_QUESTION.format(role=role, pet=pet)
            assert kq.answer_prefix("story", question) == tasks.STORY_ANSWER_PREFIX.format(role=role, pet=pet)
    with pytest.raises(ValueError, match="story question"):
        kq.answer_prefix("story", tasks.PASSKEY_QUESTION)


def test_record_keys_of_passkey_records_are_unchanged():
    assert kq.record_key("passkey", "M", 1024, 24, 0, "full", 1.0, 10, 0) == (
        "kvpress-qa|M|ctx=1024|n=24|seed=0|full|1|new=10|0")
    assert kq.record_key("passkey", "M", 1024, 24, 0, "pyramidkv", 0.5, 10, 7, "feed") == (
        "kvpress-qa|M|ctx=1024|n=24|seed=0|pyramidkv|0.5|new=10|7|feed")
    assert kq.record_key("story", "M", 1024, 24, 0, "kvzip", 0.2, 10, 3) == (
        "kvpress-story-qa|M|ctx=1024|n=24|seed=0|kvzip|0.2|new=10|3")
    # every recorded line's key is the one a rerun computes (so a rerun skips it)
    from pathlib import Path

    from evals.sweep import read_records

    recorded = read_records(Path(__file__).resolve().parents[1] / kq.DEFAULT_OUT)
    for r in recorded:
        assert r["key"] == kq.record_key(r.get("task", "passkey"), r["model"], r["context"], r["n"],
                                         r["seed"], r["press"], r["budget"], r["new_tokens"], r["sample"],
                                         r.get("protocol", "pipeline"))


def test_report_prints_the_table_of_one_task(tmp_path, capsys):
    from evals.sweep import append_record

    out = tmp_path / "r.jsonl"
    story = _records("full", 1.0, [0, 0, 1], task="story") + _records("kvzip", 0.2, [1, 0, 0], task="story")
    for r in RECORDS + story:  # RECORDS have no "task": passkey records
        append_record(out, r)
    assert kq.main(["--report", "--out", str(out), "--task", "story"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "| press | 0.2 |", "|---|---|", "| full | 1/3 |", "| kvzip | 1/3 |"]
    assert kq.main(["--report", "--out", str(out)]) == 0  # the passkey table, as before
    assert capsys.readouterr().out.strip() == kq.table([r for r in RECORDS if r["context"] == 1024])
    with pytest.raises(SystemExit) as e:
        kq.main(["--report", "--task", "summary"])
    assert e.value.code == 2
