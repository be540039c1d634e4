"""One transformers model, three routes to a compressed cache (SmolLM2-135M-Instruct, CPU, float32): kvmodels'
own Llama (``load_checkpoint``), the same ``transformers`` ``LlamaForCausalLM`` wrapped onto the paged cache
(``kvmodels.hf.wrap_transformers``) through ``kvmodels.generate``, and that model's ``generate`` with the
paged cache (``kvmodels.hf.paged_cache``). (The records of 2026-11-28 have a fourth: its ``generate`` with the
transformers bridge ``kvpolicies.hf``, retired since.)
The question about ``docs/examples/lighthouse.txt`` inside the prompt, a batch of ``--batch`` copies, greedy,
``--new`` tokens; each route's wall time for the whole generation (prefill and compression included), its
answer and whether its tokens equal kvmodels'.

Run: ``python -m experiments.hf_wrap_speed --out experiments/results/hf-wrap-speed.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

CONFIGS = ["full", "snapkv", "squeeze+keyformer", "snapkv+kivi", "snapkv+zipcache", "h2o+mikv(high=4)"]
QUESTION = "What was the name of the keeper's cat?"


def timed(fn) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    with torch.no_grad():
        tokens = fn()
    return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/hf-wrap-speed.jsonl")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", help="'|'-separated configs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    from evals.sweep import append_record, device_name
    from kvmodels import generate, load_checkpoint
    from kvmodels.hf import paged_cache, wrap_transformers
    from kvmodels.loading import _cached_conversion, default_model_path
    from kvpolicies import compose

    loaded = load_checkpoint()
    tok = loaded.tokenizer
    text = (Path(__file__).resolve().parents[1] / "docs/examples/lighthouse.txt").read_text()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{text}\n{QUESTION}"}],
                                             add_generation_prompt=True))
    batch = [ids] * args.batch
    directory, _ = _cached_conversion(default_model_path())
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
    hf_model.generation_config.eos_token_id = None  # every route generates --new tokens
    wrapped = wrap_transformers(hf_model)

    def hf_generate(policy) -> list[list[int]]:
        cache = paged_cache(wrapped, policy, max_new_tokens=args.new)
        inputs = torch.tensor(batch)
        out = hf_model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                past_key_values=cache, max_new_tokens=args.new, do_sample=False,
                                pad_token_id=0)
        return out[:, len(ids):].tolist()

    for spec in CONFIGS if not args.only else args.only.split("|"):
        first, *rest = spec.split("+")
        policy = compose(first, *rest, budget=1.0 if spec == "full" else args.budget)
        routes = {"kvmodels": lambda p=policy: generate(loaded.model, batch, args.new, p).tokens,
                  "wrap_transformers": lambda p=policy: generate(wrapped, batch, args.new, p).tokens,
                  "paged_cache": lambda p=policy: hf_generate(p)}
        reference = None
        for route, fn in routes.items():
            try:
                tokens, seconds = timed(fn)
            except (NotImplementedError, ValueError) as e:  # what a route refuses, by name
                print(f"{spec} / {route}: refused: {e}", file=sys.stderr, flush=True)
                append_record(Path(args.out), {"policy": spec, "route": route, "refused": str(e)})
                continue
            reference = tokens if reference is None else reference
            rec = {"policy": spec, "route": route, "budget": policy.budget, "batch": args.batch,
                   "prompt_tokens": len(ids), "new": args.new, "seconds": round(seconds, 2),
                   "same_tokens_as_kvmodels": tokens == reference, "answer": tok.decode(tokens[0]),
                   "threads": args.threads, "device": device_name(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            append_record(Path(args.out), rec)
            print(f"{spec} / {route}: {seconds:.2f} s, same as kvmodels: {tokens == reference}, "
                  f"{rec['answer']!r}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
