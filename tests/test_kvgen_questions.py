"""``kvgen --context FILE --question TEXT ...``: several questions on one compressed context.

(a) The context is prefilled once: every ``prefill`` call the model gets is counted; each question costs
    its own tokens (plus the previous answer's last token, which no decode step fed).
(b) Each answer equals an oracle written against :class:`kvmodels.decoder.Decoder` directly (context, then
    question 1, generate, question 2, generate, ...), greedy and sampled, for compressing policies.
(c) The summary after each turn: tokens held per layer of the tokens seen, KV bytes kept vs full.
(d) Chat templates: the context's turn opening comes once; the text in the cache is the template's
    rendering of the conversation so far; a template that cannot do this is refused.
(e) Bad input: one ``kvgen: error:`` line naming the argument.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

import test_cli
from kvmodels.cli import PLAIN_TURNS, CliError, chat_turns
from kvmodels.decoder import Decoder
from kvmodels.llama import Llama
from kvmodels.loading import Tokenizer, load_checkpoint
from kvpolicies import compose
from test_cli import WORDS, run_cli

tiny_ckpt = test_cli.tiny_ckpt  # the fixture: a random tiny Llama (context 64) with a word-level tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = {w: i for i, w in enumerate(WORDS)}
CONTEXT = "hello world the cache is small a b the cache is big world hello a the small b"  # 18 words
QUESTIONS = ["the cache is", "a small world b", "big hello"]
SMOL_TEMPLATE = (  # SmolLM2-Instruct's chat template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def sharp_ckpt(tiny_ckpt, tmp_path_factory):
    """``tiny_ckpt`` with its weight matrices scaled by 20: its 0.02-std weights give near-uniform logits
    and the same repetitive answer whatever the context; scaled, a greedy answer depends on the cache."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("sharp") / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    weights = load_file(d / "model.safetensors")
    save_file({k: v * 20 if v.dim() == 2 else v for k, v in weights.items()}, d / "model.safetensors",
              metadata={"format": "pt"})
    return d


@pytest.fixture
def context_file(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text(CONTEXT + "\n")
    return path


@pytest.fixture
def prefills(monkeypatch):
    """Every ``Llama.prefill`` call: (number of tokens, start position)."""
    calls: list[tuple[int, int]] = []
    original = Llama.prefill

    def counted(self, tokens, cache, b, *, start=0, **kw):
        calls.append((len(tokens), start))
        return original(self, tokens, cache, b, start=start, **kw)

    monkeypatch.setattr(Llama, "prefill", counted)
    return calls


@pytest.fixture
def decoders(monkeypatch):
    """Every ``Decoder`` the CLI builds, in order."""
    made: list[Decoder] = []

    class Recording(Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("kvmodels.decoder.Decoder", Recording)
    return made


def ask(capsys, ckpt, context_file, questions, *extra):
    argv = ["--model", str(ckpt), "--no-chat", "--context", str(context_file)]
    for q in questions:
        argv += ["--question", q]
    return run_cli(capsys, *argv, *extra)


def answers(out: str, questions: list[str]) -> list[str]:
    """The answer printed under each ``[k] question`` line."""
    lines = out.split("\n")  # per question: "[k] question", the answer (one line here), a blank line
    assert len(lines) == 3 * len(questions) + 1 and lines[-1] == ""
    assert lines[::3][:-1] == [f"[{k + 1}] {q}" for k, q in enumerate(questions)]
    assert lines[2::3] == [""] * len(questions)
    return lines[1::3]


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def oracle(ckpt, policy, questions, n, temperature=0.0, seed=0) -> list[str]:
    """The answers of a Decoder fed the context, then each question after the previous answer."""
    lm = load_checkpoint(str(ckpt))
    dec = Decoder(lm.model, policy, seed=seed)
    dec.extend([ids(CONTEXT)])
    out = []
    for q in questions:
        dec.extend([ids(q)])
        res = dec.generate(n, temperature=temperature)
        out.append(lm.tokenizer.decode(res.tokens[0], skip_special_tokens=True))
    return out


# ----------------------------------------------------------------------------------------------- (a), (c)
def test_context_is_prefilled_once_and_each_question_costs_its_own_tokens(capsys, tiny_ckpt, context_file,
                                                                          prefills):
    n = 4
    rc, out, err = ask(capsys, tiny_ckpt, context_file, QUESTIONS, "--policy", "h2o", "--budget", "0.5",
                       "--max-new-tokens", str(n), "--page-size", "1")  # bytes: exactly tokens
    assert rc == 0, err
    own = [len(ids(QUESTIONS[0]))] + [1 + len(ids(q)) for q in QUESTIONS[1:]]  # + the pending token
    # one prefill from position 0 (the context), then each question continuing the sequence
    assert prefills[0] == (18, 0) and [s for _, s in prefills].count(0) == 1
    assert [t for t, _ in prefills[1:]] == own
    seen, starts = 18, []
    for k, q in enumerate(own):
        starts.append(seen)
        budget = -(-(seen + q) // 2)  # ceil(0.5 x every token seen up to the question), held while decoding
        seen += q + n - 1  # the answer's last token is not cached yet
        line = next(x for x in err.splitlines() if x.startswith(f"question {k + 1}: "))
        assert f"prefill {q} tokens (this question's own" in line
        held = int(line.split("; held ")[1].split(" of ")[0])
        assert f" of {seen} tokens per layer" in line and held == budget
        assert f"full ({held / seen:.1%})" in line
    assert [s for _, s in prefills[1:]] == starts  # true positions: every token seen, kept or evicted
    assert "context: 18 tokens prefilled once" in err and "held 9 of 18 tokens per layer" in err
    assert f"3 question(s) on one context: its 18 tokens prefilled once; the questions prefilled " \
           f"{own[0]} + {own[1]} + {own[2]} tokens" in err
    assert f"layer budgets (sequence 0): {held} {held}" in err  # the budget after the last question
    assert len(answers(out, QUESTIONS)) == 3


def test_full_policy_holds_every_token(capsys, tiny_ckpt, context_file):
    rc, out, err = ask(capsys, tiny_ckpt, context_file, QUESTIONS[:2], "--max-new-tokens", "3")
    assert rc == 0, err
    lines = [x for x in err.splitlines() if x.startswith("question ")]
    assert "held 23 of 23 tokens per layer" in lines[0] and "(100.0%)" in lines[0]  # 18 + 3 + 3 - 1
    assert "held 30 of 30 tokens per layer" in lines[1]                              # 23 + 1 + 4 + 3 - 1


# ----------------------------------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("policy, budget, extra", [
    ("h2o", "0.5", []),
    ("streaming", "8", []),
    ("snapkv(window=4)", "0.4", []),
    ("tova", "0.5", ["--temperature", "1.5", "--seed", "3"]),
])
def test_each_answer_equals_the_decoder_oracle(capsys, sharp_ckpt, context_file, policy, budget, extra):
    n = 6
    rc, out, err = ask(capsys, sharp_ckpt, context_file, QUESTIONS, "--policy", policy, "--budget", budget,
                       "--max-new-tokens", str(n), *extra)
    assert rc == 0, err
    temperature = float(extra[1]) if extra else 0.0
    seed = int(extra[3]) if extra else 0
    budget_value = float(budget) if "." in budget else int(budget)
    want = oracle(sharp_ckpt, compose(policy, budget=budget_value), QUESTIONS, n, temperature, seed)
    got = answers(out, QUESTIONS)
    assert got == want
    # the oracle can tell: question 2 asked right after the context (no question 1 turn) answers otherwise
    skipped = oracle(sharp_ckpt, compose(policy, budget=budget_value), QUESTIONS[1:], n, temperature, seed)
    assert skipped[0] != got[1]


def test_duo_answers_equal_the_decoder_oracle(capsys, sharp_ckpt, context_file):
    """``duo``'s per-head pages take the questions too: kvgen calibrates it on the model (retrieval heads)
    and each answer equals a Decoder's with the same calibrated policy."""
    from kvmodels.cli import _calibrated

    n = 6
    rc, out, err = ask(capsys, sharp_ckpt, context_file, QUESTIONS, "--policy", "snapkv(window=4)+duo",
                       "--budget", "0.4", "--max-new-tokens", str(n))
    assert rc == 0, err
    lm = load_checkpoint(str(sharp_ckpt))
    policy = _calibrated(compose("snapkv(window=4)", "duo", budget=0.4), lm.model)
    assert answers(out, QUESTIONS) == oracle(sharp_ckpt, policy, QUESTIONS, n)


def test_questions_from_stdin_equal_the_same_questions_as_arguments(capsys, tiny_ckpt, context_file,
                                                                    monkeypatch):
    rc, want, _ = ask(capsys, tiny_ckpt, context_file, QUESTIONS, "--policy", "h2o", "--budget", "0.5",
                      "--max-new-tokens", "4")
    assert rc == 0
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTIONS[1]}\n\n  \n{QUESTIONS[2]}\n"))
    rc, out, err = ask(capsys, tiny_ckpt, context_file, [QUESTIONS[0], "-"], "--policy", "h2o", "--budget",
                       "0.5", "--max-new-tokens", "4")
    assert rc == 0, err
    assert out == want and "3 question(s) on one context" in err


# ----------------------------------------------------------------------------------------------------- (d)
@pytest.fixture
def chat_tokenizer(tiny_ckpt, tmp_path):
    def make(template: str) -> Tokenizer:
        d = tmp_path / f"tok{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        shutil.copy(tiny_ckpt / "tokenizer.json", d)
        (d / "tokenizer_config.json").write_text(json.dumps({"unk_token": "a", "eos_token": "<eos>",
                                                             "chat_template": template}))
        return Tokenizer(d)
    return make


def test_chat_layout_is_the_templates_rendering_of_the_conversation(chat_tokenizer):
    tok = chat_tokenizer(SMOL_TEMPLATE)
    turns = chat_turns(tok)
    system = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
              "<|im_end|>\n")
    assert turns.before_context == system + "<|im_start|>user\n"  # the system prompt once, before the context
    ctx, q1, a1, q2, a2, q3 = "The story.", "Who?", "Elias.", "Where?", "On an island.", "When?"
    conversation = [{"role": "user", "content": f"{ctx}\n\n{q1}"}, {"role": "assistant", "content": a1},
                    {"role": "user", "content": q2}, {"role": "assistant", "content": a2},
                    {"role": "user", "content": q3}]
    end = "<|im_end|>"
    # answer 1 ended on its end-of-turn token (fed already), answer 2 was cut by --max-new-tokens
    cached = (turns.before_context + ctx + turns.question(0, q1) + a1 + end + turns.question(1, q2, fed=end)
              + a2 + turns.question(2, q3, fed=""))
    assert cached == tok.apply_chat_template(conversation)
    assert turns.question(1, q2, fed=end) == "\n<|im_start|>user\nWhere?<|im_end|>\n<|im_start|>assistant\n"
    assert PLAIN_TURNS.question(0, q1) == PLAIN_TURNS.question(1, q1, fed="x") == "\n\nWho?\n"


def test_a_template_that_wants_alternating_roles_works(chat_tokenizer):
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
              "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    turns = chat_turns(chat_tokenizer(strict))
    assert turns.before_context == "[user]" and turns.question(1, "q", fed="") == "[user]q[assistant]"


@pytest.mark.parametrize("template", [
    "{{ messages[-1]['content'] }}",                          # renders only the last message
    "{{ raise_exception('no') }}",                            # refuses every conversation
    "{% for m in messages %}{{ m['content'] | lower }}{% endfor %}",  # rewrites the text
])
def test_a_template_that_cannot_grow_a_conversation_is_refused(chat_tokenizer, template):
    with pytest.raises(CliError, match="pass --no-chat"):
        chat_turns(chat_tokenizer(template))


def test_chat_run_prefills_the_context_turn_once(capsys, tiny_ckpt, tmp_path, prefills):
    context_file = tmp_path / "short.txt"
    context_file.write_text("hello world")  # the template's text takes most of the 64 tokens (unk words)
    d = tmp_path / "chat_ckpt"
    shutil.copytree(tiny_ckpt, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"unk_token": "a", "chat_template": SMOL_TEMPLATE}))
    rc, out, err = run_cli(capsys, "--model", str(d), "--context", str(context_file), "--question",
                           QUESTIONS[0], "--question", QUESTIONS[1], "--max-new-tokens", "2")
    assert rc == 0, err
    tok = Tokenizer(d)
    turns = chat_turns(tok)
    n_ctx = len(tok.encode(turns.before_context + "hello world"))
    assert f"context {n_ctx} tokens (chat template)" in err
    assert prefills[0] == (n_ctx, 0) and [s for _, s in prefills].count(0) == 1
    assert [t for t, _ in prefills[1:]] == [len(tok.encode(turns.question(0, QUESTIONS[0]))),
                                            1 + len(tok.encode(turns.question(1, QUESTIONS[1])))]


@pytest.mark.parametrize("policy,skip", [("kvzip+pooled", None), ("kvzip(skip=2)+pooled", 2)])
def test_chat_kvzip_skips_the_templates_opening(capsys, tiny_ckpt, tmp_path, prefills, policy, skip):
    """With a chat template, kvzip's copy leaves the template's opening (system prompt, user header) out:
    ``kvzip(skip=<its tokens>)`` unless ``skip`` was given; the copy follows KVzip's instruction and the
    generation prompt, after the context."""
    from kvpolicies.eviction.kvzip import REPEAT

    context_file = tmp_path / "short.txt"
    context_file.write_text("hello world again")
    d = tmp_path / "chat_ckpt"
    shutil.copytree(tiny_ckpt, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"unk_token": "a", "chat_template": SMOL_TEMPLATE}))
    rc, out, err = run_cli(capsys, "--model", str(d), "--context", str(context_file), "--question",
                           QUESTIONS[0], "--policy", policy, "--budget", "0.9", "--max-new-tokens", "2")
    assert rc == 0, err
    tok = Tokenizer(d)
    turns = chat_turns(tok)
    n_ctx = len(tok.encode(turns.before_context + "hello world again"))
    n_open = len(tok.encode(turns.before_context)) if skip is None else skip
    assert 0 < n_open < n_ctx - 1
    n_probe = len(tok.encode(REPEAT + turns.first[1], add_special_tokens=False))
    assert prefills[:2] == [(n_ctx, 0), (n_probe + n_ctx - n_open, n_ctx)]  # the copy: after the opening
    assert f"kvzip(skip={n_open})" in err


# ----------------------------------------------------------------------------------------------------- (e)
@pytest.mark.parametrize("argv, needle", [
    (["--question", "hi"], "--question needs --context FILE"),
    (["--context", "/no/such/file.txt", "--question", "hi"], "cannot read --context /no/such/file.txt"),
    (["--context", "{ctx}"], "needs at least one --question TEXT"),
    (["--context", "{ctx}", "--question", "  "], "--question number 1 is empty"),
    (["--context", "{ctx}", "--question", "-", "--question", "-"], "--question - is given more than once"),
    (["--context", "{ctx}", "--question", "a", "hello"], "not from a prompt"),
    (["--context", "{ctx}", "--question", "a", "--batch-file", "{ctx}"], "not from --batch-file"),
    (["--context", "{empty}", "--question", "a"], "is empty; write the document"),
    (["--context", "{ctx}", "--question", "a", "--max-new-tokens", "0"], "--max-new-tokens 0"),
])
def test_bad_input_is_one_line(capsys, tmp_path, context_file, argv, needle):
    (tmp_path / "empty.txt").write_text("\n")
    argv = [a.format(ctx=context_file, empty=tmp_path / "empty.txt") for a in argv]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvgen: error: ") and needle in err, err


def error_line(err: str) -> str:
    errors = [x for x in err.splitlines() if x.startswith("kvgen: error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err
    return errors[0]


@pytest.mark.parametrize("policy, needle", [
    ("snapkv+adakv", "--policy snapkv+adakv: per-head budgets (adakv) cannot take questions"),
    ("h2o+minicache", "--policy h2o+minicache: merging layers (minicache) cannot take questions"),
])
def test_policies_that_cannot_continue_are_refused_before_the_prefill(capsys, tiny_ckpt, context_file,
                                                                      prefills, policy, needle):
    rc, out, err = ask(capsys, tiny_ckpt, context_file, ["a"], "--policy", policy, "--budget", "0.5")
    assert rc == 2 and needle in error_line(err) and prefills == []


def test_a_model_that_cannot_continue_is_refused(capsys, tiny_ckpt, context_file, monkeypatch, prefills):
    monkeypatch.setattr(Llama, "can_extend", False)
    rc, out, err = ask(capsys, tiny_ckpt, context_file, ["a"])
    assert rc == 2 and "--model: Llama cannot continue a cached sequence" in error_line(err)
    assert prefills == []


def test_past_the_models_context_is_refused_with_the_argument(capsys, tiny_ckpt, tmp_path, context_file):
    long = tmp_path / "long.txt"
    long.write_text("hello " * 60)
    rc, _, err = ask(capsys, tiny_ckpt, long, ["a"], "--max-new-tokens", "8")
    assert rc == 2 and f"--context {long} has 60 tokens" in error_line(err)
    # 18 + 3 + (1 + 4 + 20 - 1) + ... : question 2 would reach 18 + 3 + 19 + 1 + 4 + 20 = 65 > 64
    rc, out, err = ask(capsys, tiny_ckpt, context_file, QUESTIONS[:2], "--max-new-tokens", "20")
    line = error_line(err)
    assert rc == 2 and "--question number 2: the conversation would reach 65 tokens" in line
    assert "context of 64" in line and out.startswith(f"[1] {QUESTIONS[0]}")  # question 1 was answered


# ----------------------------------------------------------------------------------------------- --chunk
def peak_mib(err: str, where: str) -> float:
    """The ``peak X MiB`` of the stderr line starting with ``where``."""
    line = next(x for x in err.splitlines() if x.startswith(where))
    return float(line.split("peak ")[1].split(" MiB")[0])


def test_chunk_prefills_a_prompt_a_chunk_at_a_time(capsys, sharp_ckpt, prefills):
    """``kvgen --chunk N PROMPT``: the prompt is prefilled N tokens at a time (each chunk a prefill call at
    its true position), the answer equals a Decoder's fed the same chunks, and the peak KV is lower than
    the unchunked run's (the cache holds the budget plus a chunk, not the whole prompt)."""
    n, budget = 6, 8
    common = ["--model", str(sharp_ckpt), "--no-chat", "--policy", "h2o", "--budget", str(budget),
              "--max-new-tokens", str(n), CONTEXT]
    rc, whole_out, whole_err = run_cli(capsys, *common)
    assert rc == 0, whole_err
    prefills.clear()
    rc, out, err = run_cli(capsys, "--chunk", "5", *common)
    assert rc == 0, err
    assert prefills == [(5, 0), (5, 5), (5, 10), (3, 15)]  # 18 tokens, 5 at a time
    lm = load_checkpoint(str(sharp_ckpt))
    dec = Decoder(lm.model, compose("h2o", budget=budget))
    dec.extend([ids(CONTEXT)], chunk=5, max_new_tokens=n)
    want = lm.tokenizer.decode(dec.generate(n).tokens[0], skip_special_tokens=True)
    assert out.strip() == want.strip()
    assert peak_mib(err, "KV cache:") < peak_mib(whole_err, "KV cache:")


def test_chunk_sizes_the_pool_for_the_budget_plus_a_chunk(capsys, sharp_ckpt, decoders):
    """``kvgen --chunk N``: the page pool holds every layer's budget plus one chunk plus the generation (and a
    page of rounding per layer), not the model's context (what it was); the layers share it, so a
    layer-budget policy keeps its shape (pyramid's budgets, whole)."""
    n, budget, chunk = 4, 6, 5
    args = ["--policy", "pyramid+h2o", "--budget", str(budget), "--max-new-tokens", str(n),
            "--chunk", str(chunk), "--page-size", "4"]
    rc, out, err = run_cli(capsys, "--model", str(sharp_ckpt), "--no-chat", *args, CONTEXT)
    assert rc == 0, err
    dec = decoders[-1]
    Lc = dec.model.n_cache_layers
    assert dec.cache.num_pages == Lc * (-(-(budget + chunk + n) // 4) + 1) == Lc * 5
    assert dec.cache.num_pages < Lc * dec.model.max_seq_len // 4
    line = next(x for x in err.splitlines() if x.startswith("layer budgets (sequence 0):"))
    budgets = [int(x) for x in line.split(":")[1].split()]
    assert sum(budgets) == budget * Lc and len(set(budgets)) > 1  # pyramid's, whole
    assert budgets == compose("pyramid+h2o", budget=budget).plan(
        torch.tensor([len(ids(CONTEXT))]), Lc, max_new_tokens=n).layers.budgets[:, 0].tolist()  # uncapped


@pytest.mark.parametrize("spec", ["snapkv(window=2)+kivi(bits=4, group=4, residual=3)",
                                  "h2o+kivi(bits=8, group=4, residual=4)",
                                  "snapkv(window=2)+zipcache(high=8, low=4, group=4)"])
def test_chunk_streams_a_prompt_into_two_formats(capsys, sharp_ckpt, decoders, spec):
    """``kvgen --chunk N`` with KIVI's residual or ZipCache (two formats): the prompt streams in chunks, each
    layer held at its budget (over both formats, KIVI's residual whole, ZipCache's high bits their salient
    share), in two pools sized apart by ``chunked_num_pages`` (the higher format's for the residual, a group
    and a chunk, or the salient share, a chunk and the answer; the lower one's for the budget, a chunk and
    the answer), and the answer equals an unbounded Decoder's fed the same chunks."""
    n, budget, chunk = 3, 6, 5
    rc, out, err = run_cli(capsys, "--model", str(sharp_ckpt), "--no-chat", "--policy", spec, "--budget",
                           str(budget), "--max-new-tokens", str(n), "--chunk", str(chunk), "--page-size", "2",
                           CONTEXT)
    assert rc == 0, err
    dec = decoders[-1]
    policy = compose(spec, budget=budget)
    p = policy.precision
    Lc = dec.model.n_cache_layers
    T = len(ids(CONTEXT))
    high = p.residual + p.group + chunk if p.name == "kivi" else p.high_share(budget) + chunk + n
    main, side = min(T + n, high), min(T + n, budget + chunk + n)
    assert dec.cache.num_pages == Lc * (-(-main // 2) + 1) and main < budget + chunk + n
    assert dec.cache.side.pool.num_pages == Lc * (-(-side // 2) + 1) < Lc * dec.model.max_seq_len // 2
    want = Decoder(load_checkpoint(str(sharp_ckpt)).model, policy, page_size=2)
    want.extend([ids(CONTEXT)], chunk=chunk, max_new_tokens=n)
    main, side = want.cache.host.lens[:, 0], want.cache.side.lens[:, 0]
    assert (main + side == max(budget, int(main.max()))).all()
    assert (main <= (p.residual + p.group if p.name == "kivi" else p.high_share(budget))).all()
    text = load_checkpoint(str(sharp_ckpt)).tokenizer.decode(want.generate(n).tokens[0],
                                                             skip_special_tokens=True)
    assert text.strip() and text.strip() in out


def test_chunk_sizes_the_pool_of_questions(capsys, sharp_ckpt, context_file, prefills, decoders,
                                           monkeypatch):
    """``kvgen --context FILE --chunk N``: the page pool holds the budget the conversation reaches after its
    last question plus one chunk plus an answer on every layer (it held the model's context); the answers
    equal an unbounded Decoder's fed the same turns (the pool changes no plan). Questions from stdin have
    unknown lengths: the budget of the model's whole context, and a long question streams in a chunk at a
    time."""
    n, budget, chunk, spec = 4, 0.5, 5, "pyramid+snapkv(window=2)"
    rc, out, err = ask(capsys, sharp_ckpt, context_file, QUESTIONS, "--policy", spec, "--budget", str(budget),
                       "--max-new-tokens", str(n), "--chunk", str(chunk), "--page-size", "1")
    assert rc == 0, err
    lm = load_checkpoint(str(sharp_ckpt))
    Lc, limit = lm.model.n_cache_layers, lm.model.max_seq_len
    want_dec = Decoder(lm.model, compose(spec, budget=budget), page_size=1)
    want_dec.extend([ids(CONTEXT)], chunk=chunk, max_new_tokens=n)
    want, asked = [], []
    for k, q in enumerate(QUESTIONS):
        toks = lm.tokenizer.encode("\n\n" + q + "\n", add_special_tokens=False)
        asked.append(len(toks))
        if k == len(QUESTIONS) - 1:  # the conversation before its last answer (the previous one's last token)
            last = want_dec.lengths[0] + 1 + len(toks)
        want_dec.extend([toks], chunk=chunk, max_new_tokens=n)
        want.append(lm.tokenizer.decode(want_dec.generate(n).tokens[0], skip_special_tokens=True))
    assert answers(out, QUESTIONS) == want
    counted = len(ids(CONTEXT)) + sum(asked) + (len(QUESTIONS) - 1) * n
    assert counted == last  # what the CLI sizes for: answers of n tokens (no eos), no end-of-turn fed
    assert decoders[-1].cache.num_pages == Lc * (-(-counted // 2) + chunk + n + 1) < Lc * limit

    long = " ".join(["the cache is small"] * 3)  # longer than a chunk
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{long}\n"))
    rc, out, err = ask(capsys, sharp_ckpt, context_file, ["-"], "--policy", "h2o", "--budget", "0.5",
                       "--max-new-tokens", str(n), "--chunk", str(chunk), "--page-size", "1")
    assert rc == 0, err
    assert decoders[-1].cache.num_pages == Lc * (-(-(limit - n) // 2) + chunk + n + 1) < Lc * limit
    asked = len(lm.tokenizer.encode("\n\n" + long + "\n", add_special_tokens=False))
    assert asked == 12 and [size for size, _ in prefills[-3:]] == [5, 5, 2]  # a chunk at a time


def test_chunk_sizes_the_two_pools_of_questions_over_two_formats(capsys, sharp_ckpt, context_file, decoders):
    """``kvgen --context FILE --chunk N`` with KIVI's residual: the context streams into both formats, the
    questions and answers join whole (two formats keep follow-ups), and each pool is sized for that
    (``chunked_num_pages(region=, follow_ups=)``: the 4-bit pool the context's budget plus every later turn,
    the unquantized one its residual, a group and a chunk); the answers equal an unbounded Decoder's."""
    n, budget, chunk, spec = 3, 6, 5, "snapkv(window=2)+kivi(bits=4, group=4, residual=3)"
    rc, out, err = ask(capsys, sharp_ckpt, context_file, QUESTIONS, "--policy", spec, "--budget", str(budget),
                       "--max-new-tokens", str(n), "--chunk", str(chunk), "--page-size", "1")
    assert rc == 0, err
    lm = load_checkpoint(str(sharp_ckpt))
    policy = compose(spec, budget=budget)
    want_dec = Decoder(lm.model, policy, page_size=1)
    want_dec.extend([ids(CONTEXT)], chunk=chunk, max_new_tokens=n)
    want, asked = [], []
    for q in QUESTIONS:
        toks = lm.tokenizer.encode("\n\n" + q + "\n", add_special_tokens=False)
        asked.append(len(toks))
        want_dec.extend([toks], chunk=chunk, max_new_tokens=n)
        want.append(lm.tokenizer.decode(want_dec.generate(n).tokens[0], skip_special_tokens=True))
    assert answers(out, QUESTIONS) == want
    cache, Lc = want_dec.cache, lm.model.n_cache_layers
    follow_ups = sum(asked) + (len(QUESTIONS) - 1) * n
    main = min(len(ids(CONTEXT)) + follow_ups + n, 3 + 4 + chunk)
    side = min(len(ids(CONTEXT)) + follow_ups + n, budget + follow_ups + chunk + n)
    got = decoders[-1].cache
    assert (got.num_pages, got.side.pool.num_pages) == (Lc * (main + 1), Lc * (side + 1))
    assert main < side < lm.model.max_seq_len
    held = cache.host.lens[:, 0] + cache.side.lens[:, 0]  # what the unbounded run holds fits them
    assert (held <= side).all() and (cache.host.lens[:, 0] <= main).all()


def test_chunk_streams_the_context_of_questions(capsys, sharp_ckpt, context_file, prefills):
    """``kvgen --context FILE --chunk N``: the context is prefilled a chunk at a time, once; the answers equal
    a Decoder's fed the context in the same chunks, then each question."""
    n = 6
    rc, out, err = ask(capsys, sharp_ckpt, context_file, QUESTIONS[:2], "--policy", "h2o", "--budget", "8",
                       "--max-new-tokens", str(n), "--chunk", "7")
    assert rc == 0, err
    assert prefills[:3] == [(7, 0), (7, 7), (4, 14)]
    assert "7 at a time, compressed after each chunk" in err
    lm = load_checkpoint(str(sharp_ckpt))
    dec = Decoder(lm.model, compose("h2o", budget=8))
    dec.extend([ids(CONTEXT)], chunk=7, max_new_tokens=n)
    want = []
    for q in QUESTIONS[:2]:
        dec.extend([ids(q)], max_new_tokens=n)
        want.append(lm.tokenizer.decode(dec.generate(n).tokens[0], skip_special_tokens=True))
    assert answers(out, QUESTIONS[:2]) == want


@pytest.mark.parametrize("argv, needle", [
    (["--chunk", "0"], "--chunk 0 must be >= 1"),
    (["--chunk", "2", "--policy", "snapkv(window=4)", "--budget", "0.5"],
     "--chunk 2: chunk=2 is smaller than snapkv's observation window of 4"),
])
def test_a_chunk_the_policy_cannot_take_is_one_line(capsys, tiny_ckpt, argv, needle):
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "2", *argv,
                           CONTEXT)
    assert rc == 2 and needle in error_line(err), err


def test_kvzip_reconstruction_starts_with_the_repeat_instruction(capsys, tiny_ckpt, context_file, prefills):
    """With kvzip the context's copy follows KVzip's instruction and the turn's generation prompt (plain
    text here: a newline); the probe stores nothing, so the question continues at the context's end."""
    from kvpolicies.eviction.kvzip import REPEAT

    rc, out, err = ask(capsys, tiny_ckpt, context_file, QUESTIONS[:1], "--policy", "kvzip+pooled",
                       "--budget", "0.5", "--max-new-tokens", "2")
    assert rc == 0, err
    prefix = load_checkpoint(str(tiny_ckpt)).tokenizer.encode(REPEAT + "\n", add_special_tokens=False)
    assert len(prefix) > 0
    assert prefills[:2] == [(18, 0), (len(prefix) + 18, 18)]  # the context, then the probe after it
    assert prefills[2] == (len(ids(QUESTIONS[0])), 18)
    assert "context: 18 tokens prefilled once" in err and "tokens per KV head" in err  # pooled's rows
