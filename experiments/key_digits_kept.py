"""How many of the passkey's digit tokens each layer's prompt selection keeps, per prompt: the check behind
"a chunk boundary cuts the key in two" (docs/results.md, "Chunks placed on the scores").

For each sample of the evaluation's passkey task (SmolLM2-135M), the prompt is prefilled densely; for each
named policy and layer, the policy's own prompt scores (``prefill_scores`` with its window, then
``postprocess_prefill_scores``) select ``ceil(budget * L)`` tokens by ``topk_compact``'s reference rule, and
the record holds, per layer, how many of the key's digits the first KV head keeps (with ``per_head=False``
every head keeps the same tokens). One JSON line per prompt, printed; nothing is written.

Run: ``python -m experiments.key_digits_kept --context 4096 --seed 2 --budget 0.2 --only 4,5,8 \\
"snapkv(chunk=10, window=16, per_head=False)" "snapkv(chunk=10, window=16, per_head=False, align='scores')"``
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from experiments.adakv_imbalance import kept, key_span  # the same selection rule and key locator


def main(argv: list[str] | None = None) -> int:
    from evals.sweep import Runner
    from kvkernels import prefill_attention, prefill_scores
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policies", nargs="+", help="eviction policies by name, parameters inside the name")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--only", default="", help="comma-separated sample indices (default: all)")
    args = p.parse_args(argv)
    only = {int(i) for i in args.only.split(",") if i}
    runner = Runner(seed=args.seed)
    model, tok = runner.model, runner.tokenizer
    policies = {name: compose(name, budget=args.budget).eviction for name in args.policies}

    class Recorder:  # receives the dense prefill as a cache would; keeps each layer's q and k
        def __init__(self) -> None:
            self.qk: list[tuple[torch.Tensor, torch.Tensor, float]] = []

        def prefill_attend(self, l, b, q, k, v, positions, *, scale):
            self.qk.append((q, k, scale))
            return prefill_attention(q, k, v, scale=scale)[0]

        def observe(self, l, b, h_in, attn_out):
            pass

    with torch.no_grad():
        for i, s in enumerate(runner.samples("passkey", args.context, args.n)):
            if only and i not in only:
                continue
            prompt = list(s.prompt)
            key = key_span(tok, prompt, s.answer)
            rec = Recorder()
            model.prefill(torch.tensor(prompt), rec, 0, last_only=True)
            L, B = len(prompt), math.ceil(args.budget * len(prompt))
            row: dict = {"sample": i, "prompt_tokens": L, "key": s.answer, "key_position": key[0]}
            for name, policy in policies.items():
                window = policy.prefill_window(L)
                counts = []
                for q, k, scale in rec.qk:
                    raw = prefill_scores(q, k, scale=scale, mode="accumulate", window=window)
                    scores = policy.postprocess_prefill_scores(raw)
                    mask = kept(scores, torch.full((scores.shape[0],), B), min(window, B))
                    counts.append(int(mask[0, key].sum()))
                row[name] = counts
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
