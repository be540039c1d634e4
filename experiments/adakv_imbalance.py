"""How unequal Ada-KV's head-adaptive budgets are on a real model, and what they would cost in today's
paged layout (docs/design-adakv.md).

For each passkey prompt (the evaluation's samples, SmolLM2-135M) and each layer: SnapKV's prompt scores per
KV head (observation window 32, max-pooling 7, as ``compose("snapkv")`` computes them), then Ada-KV's
selection: the layer keeps ``Hkv * B`` tokens chosen by one top-k over all heads' scores (after a floor of
``alpha * B`` tokens per head, the observation window forced in every head), instead of ``B`` per head. The
per-head counts ``n_h`` are reported as ``max_h n_h / B``: in today's layout, where a page holds every KV
head of ``S`` slots and a layer's length is one number per sequence, the layer would need ``max_h n_h``
slots for every head (the rest empty), i.e. that factor more pages than uniform budgets. Also reported: how
many of the uniform top-``B`` tokens Ada-KV moves between heads, and where the key goes: the share of
(layer, KV head) pairs that keep all of the key's digit tokens with uniform budgets and with Ada-KV's, and
the mean budget Ada-KV gives the heads that keep the whole key with uniform budgets (in units of ``B``).
The split is the policy's own (``compose("snapkv", "adakv").head_budgets``). Writes one JSON line per
(budget, alpha).
Run: ``python -m experiments.adakv_imbalance --context 1024 --n 24``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch


def kept(scores: torch.Tensor, counts: torch.Tensor, forced_recent: int) -> torch.Tensor:
    """``[Hkv, L]`` bool: the tokens each head keeps with ``counts[h]`` slots: its last ``forced_recent``
    tokens, then its best scores (ties to the earlier token), by ``topk_compact``'s own reference rule."""
    from kvkernels.topk_compact import _select_ref

    mask = torch.zeros(scores.shape, dtype=torch.bool)
    for h in range(scores.shape[0]):
        mask[h, _select_ref(scores[h], int(counts[h]), 0, forced_recent)] = True
    return mask


def key_span(tokenizer, prompt: list[int], key: str) -> list[int]:
    """Positions of the key's digit tokens in the prompt (SmolLM2 writes each digit as one token)."""
    n = len(tokenizer.encode(key, add_special_tokens=False))
    for i in range(len(prompt) - n + 1):
        if tokenizer.decode(prompt[i:i + n]).strip() == key:
            return list(range(i, i + n))
    raise ValueError(f"key {key} not found in the prompt")


def main(argv: list[str] | None = None) -> int:
    from evals.sweep import Runner, device_name
    from kvkernels import prefill_scores
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--budgets", default="0.1,0.2,0.5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alphas", default="0.2,0.5")
    p.add_argument("--out", default="experiments/results/adakv-imbalance.jsonl")
    args = p.parse_args(argv)
    runner = Runner(seed=args.seed)
    samples = runner.samples("passkey", args.context, args.n)
    runner.replay.record([list(s.prompt) for s in samples])
    snap = compose("snapkv", budget=0.2).eviction
    class Scorer:  # receives a replayed prefill as a cache would, and keeps SnapKV's prompt scores
        def __init__(self) -> None:
            self.layers: list[torch.Tensor] = []  # [Hkv, L] per layer

        def prefill_layer(self, l, b, q, k, v, positions, *, scale, alibi_slopes=None, lse=None):
            window = snap.prefill_window(q.shape[0])
            sc = prefill_scores(q, k, scale=scale, mode="accumulate", window=window, lse=lse)
            self.layers.append(snap.postprocess_prefill_scores(sc))

        def observe(self, l, b, h_in, attn_out):
            pass

    per_prompt = []  # [(L, [layer scores [Hkv, L]], key positions)]
    for s in samples:
        scorer = Scorer()
        runner.replay.prefill(torch.tensor(list(s.prompt)), scorer, 0, last_only=True)
        key = key_span(runner.tokenizer, list(s.prompt), s.answer)
        per_prompt.append((len(s.prompt), scorer.layers, key))
    for budget in [float(b) for b in args.budgets.split(",")]:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            ada = compose("snapkv", "adakv", adakv={"alpha": alpha})
            factors, moved, key_even, key_ada, key_heads_budget = [], [], [], [], []
            for L, layers, key in per_prompt:
                B = math.ceil(budget * L)
                window = min(snap.prefill_window(L), B)
                for sc in layers:
                    n = ada.head_budgets(sc, B, 0, window)
                    factors.append(float(n.max()) / B)
                    moved.append(float((n - B).abs().sum()) / 2 / (sc.shape[0] * B))
                    even = kept(sc, torch.full_like(n, B), window)[:, key].all(1)  # [Hkv]
                    key_even += even.tolist()
                    key_ada += kept(sc, n, window)[:, key].all(1).tolist()
                    key_heads_budget += (n[even].double() / B).tolist()
            record = {"context": args.context, "n": args.n, "seed": args.seed, "budget": budget,
                      "alpha": alpha,
                      "max_over_uniform_mean": statistics.mean(factors),
                      "max_over_uniform_p90": sorted(factors)[int(0.9 * len(factors))],
                      "max_over_uniform_max": max(factors), "moved_fraction_mean": statistics.mean(moved),
                      "key_kept_heads_uniform": statistics.mean(key_even),
                      "key_kept_heads_adakv": statistics.mean(key_ada),
                      "adakv_budget_of_uniform_key_heads": (statistics.mean(key_heads_budget)
                                                            if key_heads_budget else None),
                      "device": device_name(), "torch": torch.__version__}
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
